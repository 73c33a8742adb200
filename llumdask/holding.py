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
Without a hold limit the first's wait is not bounded beyond the rule: an instance whose room
shrinks between every two finishes could keep passing it. With `dispatch.hold-limit` set (off by
default), once the first has waited that long since it was held it needs only room for its prompt
behind an instance's queue (read when the scheduler next looks, after a report): room to spare
protects the running requests' growth at the cost of a first token, and past the limit the first
token wins. Later ones still need room to spare to pass it, and memory itself may be short
everywhere. A first that only instances since gone could ever take with room to spare goes at
once where dispatch would send a new one; a request given up on by its requester is withdrawn.
A request's choices (`DispatchInfo.count`) are held and placed together: room for them is room
for each copy's prompt and one request each.

Past capacity thousands may be held, and the scheduler looks for a later one to pass the first
after every report. Each is kept with its floor, at most the prompt tokens it could take anywhere
(the prompt less the most any instance might cache of it, once per copy), so that a look reads only the requests
whose floor fits the room there is. What a request could take grows as caches evict (the floor
stays below it) and shrinks only when one of the prompt's anchors cached nowhere is cached
somewhere: those anchors are watched, and each lowers the floor to what is left past it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from llumdask.policy.dispatch import DispatchInfo


@dataclass(frozen=True, order=True)
class Held:
    """One held request; ordered by (higher execution priority first, then arrival)."""

    rank: tuple[int, int]
    info: DispatchInfo = field(compare=False)
    since: float = field(compare=False)


class HeldRequests:
    """The held queue, in leaving order; a request is found by id to withdraw it."""

    def __init__(self) -> None:
        self._queue: list[Held] = []
        self._by_id: dict[str, Held] = {}
        self._by_rank: dict[tuple[int, int], Held] = {}
        self._arrivals = itertools.count()
        # (floor, rank) of every request held, ascending, and each one's floor.
        self._floors: list[tuple[float, tuple[int, int]]] = []
        self._floor_of: dict[str, float] = {}
        # Of each request watching keys: the keys, its floor before any was cached, and what each
        # such key takes off.
        self._watching: dict[str, tuple[tuple[int, ...], float, float]] = {}
        # Key -> the requests watching it and its place in their prompt past what was cached.
        self._watchers: dict[int, dict[str, int]] = {}

    def add(self, info: DispatchInfo, now: float, floor: float = -math.inf, watch: tuple[int, ...] = (),
            step: float = 0.0) -> None:
        """Hold `info` with its floor, at most the prompt tokens it could take anywhere (none:
        unbounded); each key of `watch` (the prompt's anchors past what any instance caches, in
        order), once cached somewhere, lowers it to what is left past that key: `step` a place."""
        self._refuse_held(info.request_id)
        held = Held((-int(info.execution_priority), next(self._arrivals)), info, now)
        bisect.insort(self._queue, held)
        self._by_id[info.request_id] = held
        self._by_rank[held.rank] = held
        self._set_floor(held, floor, watch, step)

    def remove(self, request_id: str) -> Held | None:
        """Take a request out (placed, or withdrawn by its client); None if it is not held."""
        held = self._by_id.pop(request_id, None)
        if held is not None:
            del self._queue[bisect.bisect_left(self._queue, held)]
            del self._by_rank[held.rank]
            self._drop_floor(held)
        return held

    def refloor(self, request_id: str, floor: float, watch: tuple[int, ...], step: float) -> None:
        """Give a held request a new floor and keys to watch (as `add` does)."""
        held = self._by_id[request_id]
        self._drop_floor(held)
        self._set_floor(held, floor, watch, step)

    def cached(self, keys: Iterable[int]) -> None:
        """Keys newly cached somewhere: the floors of the requests watching them fall."""
        furthest: dict[str, int] = {}  # each request's furthest place cached: one move each
        for key in keys:
            for request_id, place in self._watchers.get(key, {}).items():
                if place > furthest.get(request_id, -1):
                    furthest[request_id] = place
        for request_id, place in furthest.items():
            _, base, step = self._watching[request_id]
            floor = base - (place + 1) * step
            if floor < self._floor_of[request_id]:
                self._move(self._by_id[request_id], floor)

    def within(self, tokens: float) -> Iterator[Held]:
        """The held requests whose floor is at most `tokens`, in leaving order; lazily, as the
        first that is placed ends the look."""
        end = bisect.bisect_right(self._floors, (tokens, (math.inf, math.inf)))
        if end * 8 < len(self._queue):  # few: sorted by rank
            by_rank = self._by_rank
            for rank in sorted(rank for _, rank in self._floors[:end]):
                yield by_rank[rank]
        else:  # most: the queue in order, filtered
            floor_of = self._floor_of
            for held in self._queue:
                if floor_of[held.info.request_id] <= tokens:
                    yield held

    def _set_floor(self, held: Held, floor: float, watch: tuple[int, ...], step: float) -> None:
        request_id = held.info.request_id
        self._floor_of[request_id] = floor
        bisect.insort(self._floors, (floor, held.rank))
        if watch:
            self._watching[request_id] = (watch, floor, step)
            for place, key in enumerate(watch):
                self._watchers.setdefault(key, {})[request_id] = place  # a repeated key: its last place

    def _move(self, held: Held, floor: float) -> None:
        request_id = held.info.request_id
        floors = self._floors
        del floors[bisect.bisect_left(floors, (self._floor_of[request_id], held.rank))]
        self._floor_of[request_id] = floor
        bisect.insort(floors, (floor, held.rank))

    def _drop_floor(self, held: Held) -> None:
        request_id = held.info.request_id
        floor = self._floor_of.pop(request_id)
        del self._floors[bisect.bisect_left(self._floors, (floor, held.rank))]
        watch, _, _ = self._watching.pop(request_id, ((), 0.0, 0.0))
        watchers = self._watchers
        for key in watch:
            ids = watchers.get(key)  # gone already where the prompt repeats it
            if ids is not None:
                ids.pop(request_id, None)
                if not ids:
                    del watchers[key]

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

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Held]:
        return iter(self._queue)

    def oldest(self, now: float) -> float:
        """Seconds the longest-held request has waited (0 when none is held)."""
        return max((now - h.since for h in self._queue), default=0.0)
