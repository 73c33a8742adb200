"""Log probabilities in OpenAI's two shapes: the completions' parallel lists, the chat's entries.

A token is shown as its own decoded text and, in the chat shape, that text's UTF-8 bytes, as
vLLM's server shows them (a token holding part of a character decodes to U+FFFD); with vLLM's
`return_tokens_as_token_ids`, as "token_id:ID" (a chat token's own bytes stay its text's, its
alternatives' are the label's, as vLLM gives them). A position nothing predicts (the prompt's
first) has None in the completions' lists.
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
        out["token_logprobs"].append(entry.logprob)
        top: dict[str, float] = {}
        for t, lp in (*entry.top, (token, entry.logprob)):  # tokens of one text: the likeliest stands
            top.setdefault(label(tokenizer, t), lp)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob],
                  as_token_ids: bool = False) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    label = _label if as_token_ids else _text
    return {"content": [
        {"token": label(tokenizer, token) if as_token_ids else text, "logprob": entry.logprob, "bytes": _bytes(text),
         "top_logprobs": [{"token": (shown := label(tokenizer, t)), "logprob": lp, "bytes": _bytes(shown)}
                          for t, lp in entry.top]}
        for token, entry in zip(token_ids, entries)
        for text in (_text(tokenizer, token),)
    ]}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _label(tokenizer: Tokenizer, token: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token: a tokenizer-free name of it."""
    return f"token_id:{token}"


@functools.lru_cache(maxsize=1 << 16)
def _text(tokenizer: Tokenizer, token: int) -> str:
    """Kept: a streamed token with logprobs shows up to 21 tokens' texts, and a vocabulary's never change."""
    return tokenizer.decode([token])
