"""Fill in the middle: a completion's `suffix`, for models trained with FIM tokens.

OpenAI's completions take a `suffix` that comes after the generated text. Code models learn
that as a prompt of marked parts, prefix then suffix then the middle to write (PSM order), with
tokens of their own; a model without them cannot do it, and pasting the suffix into the prompt
would only produce a different answer, so the request is refused instead. The tokens are looked
up in the model's vocabulary, family by family.
"""

from __future__ import annotations

from collections.abc import Sequence

from llumdask.api.gateway.errors import InvalidRequest
from llumdask.api.gateway.tokenizer import Tokenizer

# (before the prefix, before the suffix, before the middle), as each family spells them.
FIM_FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, granite-code
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)


def fill_in_the_middle(tokenizer: Tokenizer, prefix: str | Sequence[int], suffix: str) -> str:
    """The prompt asking the model for the text between `prefix` and `suffix`; a 400 for a
    token-id prompt or a model with none of the known FIM token families."""
    if not isinstance(prefix, str):
        raise InvalidRequest("suffix needs a text prompt", param="suffix", code="invalid_value")
    for before_prefix, before_suffix, before_middle in FIM_FAMILIES:
        if all(tokenizer.has_token(t) for t in (before_prefix, before_suffix, before_middle)):
            return f"{before_prefix}{prefix}{before_suffix}{suffix}{before_middle}"
    raise InvalidRequest("suffix needs a model trained to fill in the middle (FIM tokens such as "
                         "<fim_prefix>); this model has none", param="suffix", code="unsupported_parameter")
