"""A clairvoyant dispatch policy for the simulator only: the limit of what dispatch can do.

It knows what no real router does: every request's output length at dispatch (in the simulator a
request always runs to its `max_tokens`) and the exact progress of every request on every
instance, at the moment of dispatch. With that it projects each instance's future: its running
requests decode one token per step and leave when done, freeing their KV; its queue is admitted
in order whenever the head's tokens fit (vLLM's rule); steps last what the latency profile says.
The request goes where this projection gives it the earliest first token; among equal ones, where
the projected peak KV usage with it (every request there growing to its end) is the smallest
share of capacity, so that it is the least likely to be preempted.

What it does not do: migrate (it is the bound of one-shot placement), or foresee requests that
arrive after it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from llumdask.engine.latency import LatencyProfile
from llumdask.policy.candidates import Candidate, CandidateTable
from llumdask.policy.dispatch import DispatchInfo, DispatchPolicy


@dataclass(frozen=True)
class Holdings:
    """An instance's requests as (tokens now, tokens still to generate): running ones, and the
    queue in admission order (those dispatched to it and on their way last)."""

    running: Sequence[tuple[int, int]]
    waiting: Sequence[tuple[int, int]]


def projected_peak(holdings: Sequence[tuple[int, int]], prompt: int, output: int) -> int:
    """The most tokens the instance holds at any future step if every request grows to its end
    together, the new one (prompt, output) included.

    A request of `length` tokens with `remaining` to generate holds length + t tokens at step t
    for t < remaining; the new one holds prompt + t for t < output. The sum only drops when a
    request leaves, so its maximum is at step 0 or at the last step of some request.
    """
    if not holdings:
        return prompt + output - 1
    lengths, remaining = (np.asarray(column, dtype=np.int64) for column in zip(*holdings))
    order = np.argsort(-remaining, kind="stable")
    lengths, remaining = lengths[order], remaining[order]
    steps = np.unique(np.concatenate(([0, output - 1], remaining[remaining > 0] - 1)))
    # Requests still present at step t: those with remaining > t, a prefix of the sorted order.
    present = np.searchsorted(-remaining, -steps, side="left")
    held = np.concatenate(([0], np.cumsum(lengths)))[present] + steps * present
    held += np.where(steps < output, prompt + steps, 0)
    return int(held.max())


def projected_first_token(holdings: Holdings, prompt: int, capacity: int, profile: LatencyProfile) -> float:
    """Seconds from now until a request of `prompt` tokens, queued last, yields its first token.

    Between two departures the batch is fixed, so its steps are summed in closed form: b
    sequences holding C tokens decode n steps in n x decode_time(b, C) + f x b x n(n - 1) / 2
    (f: the per-context-token cost; each step adds b tokens). Each admission adds its prefill.
    """
    f = profile.decode.per_context_token_s
    # Running requests as (step they leave, tokens at step 0 minus their start step); held at step
    # t: base + batch x t.
    leaving = [(remaining, length) for length, remaining in holdings.running if remaining > 0]
    heapq.heapify(leaving)
    base, batch = sum(length for _, length in leaving), len(leaving)
    queue = [*holdings.waiting, (prompt, 0)]
    step, seconds = 0, 0.0
    for index, (tokens, remaining) in enumerate(queue):
        while capacity - (base + batch * step) < tokens:
            if not leaving:
                return seconds + profile.prefill_time([tokens])  # an empty instance takes any prompt that fits at all
            until, offset = heapq.heappop(leaving)
            n = until - step
            if n > 0:
                seconds += n * profile.decode_time(batch, base + batch * step) + f * batch * n * (n - 1) / 2
                step = until
            base -= offset
            batch -= 1
        seconds += profile.prefill_time([tokens])
        if index == len(queue) - 1:
            return seconds
        heapq.heappush(leaving, (step + remaining, tokens - step))
        base += tokens - step
        batch += 1
    raise AssertionError("unreachable: the queue ends with the new request")


class ClairvoyantDispatch(DispatchPolicy):
    """The earliest projected first token, then the smallest projected peak share of capacity,
    then the smaller id. `holdings` reads an instance's requests from the simulator;
    `info.max_tokens` is the request's true output length there."""

    def __init__(self, holdings: Callable[[str], Holdings], profile: LatencyProfile) -> None:
        self._holdings = holdings
        self._profile = profile

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        def score(c: Candidate) -> tuple[bool, float, float, tuple]:
            held = self._holdings(c.instance_id)
            capacity = c.load.total_blocks * c.load.block_size
            first = projected_first_token(held, info.num_prompt_tokens, capacity, self._profile)
            peak = projected_peak([*held.running, *held.waiting], info.num_prompt_tokens, info.max_tokens)
            return (peak > capacity, first, peak / capacity, c.order)

        return min(candidates, key=score).instance_id
