"""Requests held at the global scheduler until an instance has room for them (late binding).

Past capacity every instance queues. A request queued at one instance waits for that instance
even when another frees memory first, and an engine admits from its queue as soon as a prompt
fits, so memory fills to the last block and running requests are preempted as they grow. With
`dispatch.hold-freeness` the scheduler places a request only where it leaves at least that
dispatch freeness (free blocks per request: each request's room to grow), and holds it
otherwise, so that it goes to the first instance that has room. Room is counted as dispatch counts
demand: a prompt prefix an instance caches takes none there.

Held requests leave in order (execution priority, then arrival; the scheduler holds normal-priority
requests only: a high-priority one's headroom is the room kept for it). The first is reserved the
instance where it is closest to fitting; a later one may pass it, but only on another instance
(EASY backfilling), so the room a large one waits for is not taken by small ones. The reservation
holds unless that room is shrinking: its free blocks' changes, decayed over about a second and
read at the decision's time, add up to a loss (the requests running there grew more than
finishing ones freed; the blocks the prompts placed there take are no loss, `llumdask.room`).
Where it shrinks the first waits on anyway, and keeping it would only keep later requests from
what may be the only room there is: a later one may go there then. A migrant moving in reads as
a loss for a while (the scheduler pairs instances, not requests, so it does not know its blocks).
The first's wait is not bounded beyond the rule: an instance whose room shrinks between every two
finishes could keep passing it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator

from llumdask.policy.dispatch import DispatchInfo


@dataclass(frozen=True, order=True)
class Held:
    """One held request; ordered by (higher execution priority first, then arrival)."""

    rank: tuple[int, int]
    info: DispatchInfo = field(compare=False)
    since: float = field(compare=False)
    # Prompt tokens it needs room for: less the longest prefix an instance cached when it was held.
    need: int = field(compare=False, default=0)


class HeldRequests:
    """The held queue, in leaving order; a request is found by id to withdraw it."""

    def __init__(self) -> None:
        self._queue: list[Held] = []
        self._by_id: dict[str, Held] = {}
        self._arrivals = itertools.count()
        # (need, rank) of every request held, and of some gone (dropped when on top).
        self._sizes: list[tuple[int, tuple[int, int]]] = []
        # The ranks held now: whether a size entry is still held, in O(1).
        self._ranks: set[tuple[int, int]] = set()

    def add(self, info: DispatchInfo, now: float, need: int | None = None) -> None:
        """Hold `info`; `need`: the prompt tokens it needs room for (default: all of them)."""
        self._refuse_held(info.request_id)
        need = info.num_prompt_tokens if need is None else need
        held = Held((-int(info.execution_priority), next(self._arrivals)), info, now, need)
        bisect.insort(self._queue, held)
        self._by_id[info.request_id] = held
        self._ranks.add(held.rank)
        heapq.heappush(self._sizes, (need, held.rank))

    def remove(self, request_id: str) -> Held | None:
        """Take a request out (placed, or withdrawn by its client); None if it is not held."""
        held = self._by_id.pop(request_id, None)
        if held is not None:
            del self._queue[bisect.bisect_left(self._queue, held)]
            self._ranks.discard(held.rank)
        return held

    def would_lead(self, info: DispatchInfo) -> bool:
        """Whether `info`, held now, would leave first: nothing is held, or it outranks the first
        (a later arrival never passes an equal priority). A request held already is an error."""
        self._refuse_held(info.request_id)
        return not self._queue or -int(info.execution_priority) < self._queue[0].rank[0]

    def _refuse_held(self, request_id: str) -> None:
        if request_id in self._by_id:
            raise ValueError(f"request {request_id} is held already")

    @property
    def first(self) -> Held:
        """The request that leaves next (the queue must not be empty)."""
        return self._queue[0]

    def smallest_need(self) -> float:
        """The fewest prompt tokens any held request needs room for (inf when none is held)."""
        sizes = self._sizes
        while sizes and sizes[0][1] not in self._ranks:
            heapq.heappop(sizes)
        return sizes[0][0] if sizes else math.inf

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Held]:
        return iter(self._queue)

    def oldest(self, now: float) -> float:
        """Seconds the longest-held request has waited (0 when none is held)."""
        return max((now - h.since for h in self._queue), default=0.0)
