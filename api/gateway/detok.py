"""Token ids -> text deltas as they arrive, with stop strings.

Decoding one token at a time is wrong for byte-level and sentencepiece tokenizers: a character
may span tokens (the partial bytes decode to U+FFFD) and a token's leading space depends on its
left neighbour. So each new run is decoded together with the previous run as context and only
the difference is emitted, holding back a trailing U+FFFD until the next token completes it.

Stop strings are matched on the text; the text that could still turn into a stop string
(its last `max(len(stop)) - 1` characters) is held back, so a stream never shows a stop string
or a piece of one. After a stop, the caller aborts the request: the engine knows only token ids.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

from llumdask.api.gateway.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    text: str
    # True once a stop string was found: `text` ends just before it and nothing follows.
    stopped: bool = False
    # Where this batch's text completed a stop string: how many of its tokens the answer keeps,
    # up to the one that completed it (vLLM drops the rest: their ids, logprobs and usage).
    kept: int | None = None


# Every stop string is searched for at every token, and the longest decides how much text is held
# back: bounded, so that one request cannot make its stream scan megabytes per token.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """Stop strings as a detokenizer takes them: non-empty, at most MAX_STOP_STRINGS of at most
    MAX_STOP_CHARS characters each; a ValueError says which bound."""
    stop = tuple(stop)
    if any(not s for s in stop):
        raise ValueError("stop strings must be non-empty")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
    return stop


class IncrementalText:
    """Feed token batches with `add`, then `finish` for the rest; `text` is what was emitted.
    `include_stop`: the text ends with the stop string (or stop token) found instead of just before
    it; `skip_special_tokens`: special tokens have no text (vLLM's default); `stop_token_ids`: the
    tokens that end the request, whose text is left out as vLLM leaves it out (the end-of-sequence
    token shows otherwise once special tokens are kept); `min_tokens`: a stop string counts only
    where it ends in the text of a later token (vLLM's rule)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, include_stop: bool = False,
                 skip_special_tokens: bool = True, stop_token_ids: Sequence[int] = (), min_tokens: int = 0) -> None:
        self._stop = check_stop(stop)
        self._min_tokens = min_tokens
        self._received = 0  # tokens given to `add`, a stop token's included
        # The text's length after min_tokens tokens (a stop string must end past it), once known.
        self._min_offset: int | None = 0 if min_tokens == 0 else None
        self._stop_ids = frozenset(stop_token_ids)
        self._tokenizer = tokenizer
        self._include_stop = include_stop
        self._skip = skip_special_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # start of the context run
        self._read = 0  # tokens before this index are decoded into `_decoded`
        self._decoded = ""  # all text decoded so far (emitted or held back)
        self._pending = 0  # characters of the run after `_read` already in `_decoded`
        self._emitted = 0  # characters of `_decoded` given out
        self.stopped = False
        # The stop string found (vLLM's stop_reason), once one is, and where it ends in the text.
        self.stop_string: str | None = None
        self._stop_end = 0

    @property
    def text(self) -> str:
        return self._decoded[: self._emitted]

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", stopped=True)
        self._received += len(token_ids)
        if token_ids and token_ids[-1] in self._stop_ids and not self._include_stop:
            token_ids = token_ids[:-1]  # the engine ends the request at a stop token: it comes last
        first = len(self._ids)
        self._ids.extend(token_ids)
        if self._min_offset is None and self._stop and self._received > self._min_tokens:
            self._min_offset = self._length(self._min_tokens)
        context = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        new = full[len(context) :]
        if full.endswith(REPLACEMENT):
            # The run ends inside a character: its complete characters count already (a stop
            # string among them is found now, as vLLM finds it), the rest once it is whole.
            self._take(new.rstrip(REPLACEMENT))
        elif len(full) > len(context):
            self._take(new)
            self._pending = 0
            self._prefix, self._read = self._read, len(self._ids)
        delta = self._release(final=False)
        if delta.stopped and token_ids:
            # The first of the new tokens whose text reaches the stop string's end (vLLM's cut; a
            # stop token after it goes too).
            kept = 1 if len(token_ids) == 1 else bisect.bisect_left(
                range(first + 1, len(self._ids) + 1), self._stop_end, key=self._length) + 1
            delta = replace(delta, kept=min(kept, len(token_ids)))
        return delta

    def _length(self, count: int) -> int:
        """The text's length after the first `count` tokens (a trailing partial character not yet counted)."""
        return len(self._decode(self._ids[:count]).rstrip(REPLACEMENT))

    def finish(self) -> TextDelta:
        """Everything still held back (a trailing partial character included)."""
        if not self.stopped:
            context = self._decode(self._ids[self._prefix : self._read])
            self._take(self._decode(self._ids[self._prefix :])[len(context) :])
            self._pending = 0
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _take(self, run: str) -> None:
        """Add the text of the run being decoded past what of it was added already."""
        if len(run) > self._pending:
            self._decoded += run[self._pending :]
            self._pending = len(run)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip)

    def _release(self, final: bool) -> TextDelta:
        if self.stopped:
            return TextDelta("", stopped=True)
        # A stop string may straddle what was emitted and what is new: search from there; one
        # counts once past min_tokens, ending in a later token's text.
        start = max(0, self._emitted - self._hold)
        least = self._min_offset
        # vLLM's choice among several found at once: the one that ends first, then the first listed.
        hits = [] if least is None else [
            (i + len(s), order, i, s)
            for order, (i, s) in enumerate((self._decoded.find(s, max(start, least - len(s) + 1)), s) for s in self._stop)
            if i >= 0]
        if hits:
            self._stop_end, _, at, self.stop_string = min(hits)
            end = self._stop_end if self._include_stop else at
            self.stopped = True
            self._decoded = self._decoded[:end]
        else:
            end = len(self._decoded) if final else max(self._emitted, len(self._decoded) - self._hold)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return TextDelta(delta, stopped=self.stopped)
