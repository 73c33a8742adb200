"""Log probabilities in OpenAI's two shapes: the completions' parallel lists, the chat's entries.

A token is shown as its own decoded text and, in the chat shape, that text's UTF-8 bytes, as
vLLM's server shows them (a token holding part of a character decodes to U+FFFD). A position
nothing predicts (the prompt's first) has None in the completions' lists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from llumdask.api.gateway.tokenizer import Tokenizer
from llumdask.engine.base import TokenLogprob


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        text_offset: int = 0) -> dict[str, list]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}: the top alternatives with the
    token's own (so up to n + 1 of them, as OpenAI's legacy completions give)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries):
        text = _text(tokenizer, token)
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
            top.setdefault(_text(tokenizer, t), lp)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    return {"content": [
        {**_chat_token(tokenizer, token, entry.logprob),
         "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in entry.top]}
        for token, entry in zip(token_ids, entries)
    ]}


def _chat_token(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


@functools.lru_cache(maxsize=1 << 16)
def _text(tokenizer: Tokenizer, token: int) -> str:
    """Kept: a streamed token with logprobs shows up to 21 tokens' texts, and a vocabulary's never change."""
    return tokenizer.decode([token])
