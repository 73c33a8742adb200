"""vLLM's beam search (`use_beam_search`), run where vLLM's server runs it: above the engines.

Each step sends every live beam as a request for one token (its prompt: the request's and the
beam's tokens so far, which the prefix cache mostly holds) asking for twice the width in
alternatives. Of all beams' candidates (a step's alternatives and the token it drew), an end of
sequence ends its beam (unless `ignore_eos`), and the `width` others with the highest summed log
probability go on. After `max_tokens` steps the ended and the live beams are ranked by vLLM's
score: the summed log probability over the sequence's length (the prompt's included, a last
token that is the end of sequence not) to the power `length_penalty`; the best `width` are the
answer. Nothing migrates or needs pinning: each request ends at its first token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from llumdask.engine.base import TokenLogprob

# One step of one beam: its tokens so far and its index -> the token drawn and that position's
# log probabilities (the drawn token's own and the likeliest alternatives'), or None where the
# engine aborted the request (vLLM then ends every beam as aborted).
_Drawn = tuple[int, TokenLogprob] | None
Step = Callable[[Sequence[int], int], Awaitable[_Drawn]]


@dataclass(frozen=True)
class Beam:
    """A sequence the search keeps: its tokens, their summed log probability and each one's
    entry (its log probability beside its step's alternatives)."""

    tokens: tuple[int, ...] = ()
    logprob: float = 0.0
    entries: tuple[TokenLogprob, ...] = ()
    # "stop": ended by an end of sequence, its last token; "length": still live at the end;
    # "abort": live when a step was aborted.
    finish_reason: str = "length"

    def then(self, token: int, entry: TokenLogprob, finish_reason: str = "length") -> "Beam":
        """This beam and `token` (`entry`: its log probability beside its step's alternatives)."""
        return Beam((*self.tokens, token), self.logprob + entry.logprob, (*self.entries, entry), finish_reason)

    def score(self, prompt_tokens: int, length_penalty: float, eos_token_id: int | None) -> float:
        """vLLM's score, logprob / length ** length_penalty, as its logarithm's order: the
        logarithm of -score (lower is better; -inf for a sure sequence), so that no penalty
        overflows a float."""
        length = prompt_tokens + len(self.tokens) - (bool(self.tokens) and self.tokens[-1] == eos_token_id)
        if self.logprob >= 0:  # sure (or past sure by rounding): first
            return -math.inf
        return math.log(-self.logprob) - length_penalty * math.log(max(length, 1))


async def beam_search(step: Step, *, width: int, max_tokens: int, prompt_tokens: int, eos_token_id: int | None,
                      ignore_eos: bool, length_penalty: float) -> list[Beam]:
    """The `width` best beams, best first (fewer if the candidates run out)."""
    live, ended = [Beam()], []
    for _ in range(max_tokens):
        drawn = await _all(step(beam.tokens, i) for i, beam in enumerate(live))
        if any(d is None for d in drawn):
            live = [replace(beam, finish_reason="abort") for beam in live]
            break
        candidates: list[tuple[float, int, Beam, TokenLogprob]] = []
        for beam, (token, entry) in zip(live, drawn):  # type: ignore[misc]
            # The drawn token first, then the alternatives by rank (a token among both counts once).
            ranks = {token: entry.rank, **{t: rank for rank, (t, _) in enumerate(entry.top, start=1)}}
            for candidate, logprob in dict(((token, entry.logprob), *entry.top)).items():
                shown = entry._replace(logprob=logprob, rank=ranks[candidate])
                if candidate == eos_token_id and not ignore_eos:
                    ended.append(beam.then(candidate, shown, "stop"))
                else:
                    candidates.append((beam.logprob + logprob, candidate, beam, shown))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then alternative, order
        live = [beam.then(candidate, shown) for _, candidate, beam, shown in candidates[:width]]
        if not live:
            break
    ranked = sorted((*ended, *live), key=lambda b: b.score(prompt_tokens, length_penalty, eos_token_id))
    return ranked[:width]


async def _all(steps: Iterable[Awaitable[_Drawn]]) -> list[_Drawn]:
    """Every step's result; if one fails (or the search is cancelled), the others are cancelled
    once and awaited, so that each aborts its request, before the error goes on."""
    tasks = [asyncio.ensure_future(s) for s in steps]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        await _cancel({task for task in tasks if not task.done()})
        # Every outcome read (none left for the loop to warn about); a failure, not a cancel, goes on.
        failed = next((e for e in [t.exception() for t in tasks if t.done() and not t.cancelled()] if e is not None),
                      None)
    if failed is not None:
        raise failed
    return [task.result() for task in tasks]


async def _cancel(tasks: set[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
