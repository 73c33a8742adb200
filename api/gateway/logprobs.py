"""Log probabilities in OpenAI's two shapes: the completions' parallel lists, the chat's entries.

A token is shown as its own decoded text (a special token's too) and, in the chat shape, that
text's UTF-8 bytes, as vLLM's server shows them (a token holding part of a character decodes to
U+FFFD, where vLLM's repairs some from the tokens before it); with vLLM's
`return_tokens_as_token_ids`, as "token_id:ID" (a chat token's own bytes stay its text's, its
alternatives' are the label's, as vLLM gives them). A position nothing predicts (the prompt's
first) has None in the completions' lists. An impossible token's -inf shows as vLLM shows it,
-9999.0 (JSON has no infinity).

vLLM's `prompt_logprobs` have a third shape: per prompt token, {token id: {"logprob", "rank",
"decoded_token"}}, the token's own entry first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from llumdask.api.gateway.tokenizer import Tokenizer
from llumdask.engine.base import TokenLogprob


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        text_offset: int = 0, as_token_ids: bool = False) -> dict[str, list]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}: the top alternatives with the
    token's own (so up to n + 1 of them, as OpenAI's legacy completions give)."""
    label = _label if as_token_ids else _text
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries):
        text = label(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for t, lp in (*entry.top, (token, entry.logprob)):  # tokens of one text: the likeliest stands
            top.setdefault(label(tokenizer, t), _finite(lp))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob],
                  as_token_ids: bool = False) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    label = _label if as_token_ids else _text
    return {"content": [
        {"token": label(tokenizer, token) if as_token_ids else text, "logprob": _finite(entry.logprob),
         "bytes": _bytes(text),
         "top_logprobs": [{"token": (shown := label(tokenizer, t)), "logprob": _finite(lp), "bytes": _bytes(shown)}
                          for t, lp in entry.top]}
        for token, entry in zip(token_ids, entries)
        for text in (_text(tokenizer, token),)
    ]}


def prompt_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                    entries: Sequence[TokenLogprob | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a whole response: the prompt token's own entry, then its
    alternatives by rank (an alternative that is the token itself stands once, at the token's
    place, with the alternative's rank, as vLLM's dict keeps it)."""
    shown: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            shown.append(None)
            continue
        position = {str(token): _vllm_logprob(tokenizer, token, entry.logprob, entry.rank)}
        for rank, (t, lp) in enumerate(entry.top, start=1):
            position[str(t)] = _vllm_logprob(tokenizer, t, lp, rank)
        shown.append(position)
    return shown


def within_top(entry: TokenLogprob, token: int, top: int) -> TokenLogprob:
    """`entry` as an echo shows it where the prompt's alternatives were asked beyond the answer's
    `top` (prompt_logprobs > logprobs): the token's own and the first `top` others, as vLLM's."""
    return entry._replace(top=tuple(a for a in entry.top if a[0] != token)[:top])


def _vllm_logprob(tokenizer: Tokenizer, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": _text(tokenizer, token)}


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _label(tokenizer: Tokenizer, token: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token: a tokenizer-free name of it."""
    return f"token_id:{token}"


@functools.lru_cache(maxsize=1 << 16)
def _text(tokenizer: Tokenizer, token: int) -> str:
    """A special token shows its own text (vLLM decodes each token so). Kept: a streamed token
    with logprobs shows up to 21 tokens' texts, and a vocabulary's never change."""
    return tokenizer.decode([token], skip_special_tokens=False)
