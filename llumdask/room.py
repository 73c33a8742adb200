"""Whether an instance's room is shrinking: its running sequences growing faster than finished
requests free blocks.

The scheduler keeps the first held request the instance where it comes closest to fitting only
while that room is not shrinking (`GlobalScheduler._reserved_for`). A fall of free blocks is not
always a loss of that room: the prompts the scheduler placed there take blocks too, and counting
them would make every placement a reason to keep nothing. So the blocks of a prompt the instance
has received are credited, but only as free blocks actually fall: a prompt queued behind a full
batch, or prefilled in chunks, takes its blocks over several reports, and one whose prefix was
cached takes fewer than its length; crediting at receipt would read as the room growing, then
shrinking. The credit is rough where a finish frees blocks in the report that shows a queued
prompt admitted: the gain hides the blocks taken, so the prompt's credit stays until it expires
and hides as much of the running sequences' growth meanwhile.
"""

from __future__ import annotations

import math
from collections import deque

# How long a change of free blocks counts, seconds: its weight decays as exp(-age / this). Many
# decode steps, so the room a finished request frees weighs against the growth until the next
# one finishes, not against the last few steps' only.
ROOM_TREND_SECONDS = 1.0
# A received prompt's blocks are taken within this long: at once, chunk by chunk, or once a place
# in the batch opens. Credit not used by then is dropped (its prefix was cached, it ended first, it
# still queues): left, it would hide the growth of the sequences running there.
ARRIVAL_CREDIT_SECONDS = 10.0
# Less than half a block (what is left of an old loss, decayed) is no loss.
SHRINKING_BELOW = -0.5


class RoomTrend:
    """Free blocks an instance gained lately, its received prompts' blocks not counted as lost:
    the sum of each report's change weighed exp(-age / ROOM_TREND_SECONDS), O(1) per report."""

    __slots__ = ("_trend", "_at", "_free", "_arrived")

    def __init__(self) -> None:
        self._trend = 0.0
        self._at: float | None = None  # the last report's time; None before the first
        self._free = 0  # the last report's free blocks
        # (received at, blocks not yet taken) per received prompt, oldest first.
        self._arrived: deque[tuple[float, int]] = deque()

    def received(self, blocks: int, now: float) -> None:
        """The instance showed a prompt of `blocks` blocks received (placed by the scheduler)."""
        if blocks > 0:
            self._arrived.append((now, blocks))

    def observe(self, free_blocks: int, now: float) -> None:
        """A report at `now` showing `free_blocks`. The first is the baseline: the prompts it shows
        received are in it already (an instance placed on before it first reported)."""
        previous, self._free = self._free, free_blocks
        if self._at is None:
            self._arrived.clear()
            self._at = now
            return
        now = max(now, self._at)  # a clock stepped back: no report is older than the last
        self._expire(now)
        change = free_blocks - previous
        if change < 0:
            change += self._credit(-change)
        self._trend = self._decayed(now) + change
        self._at = now

    def shrinking(self, now: float) -> bool:
        """Whether it lost room lately, as read at `now` (reports that change nothing may not be
        sent, so the last one's reading is decayed to now)."""
        return self._at is not None and self._decayed(now) < SHRINKING_BELOW

    def _decayed(self, now: float) -> float:
        """The trend as weighed at `now` (after the last report; never weighed up)."""
        assert self._at is not None
        return self._trend * math.exp(min(0.0, self._at - now) / ROOM_TREND_SECONDS)

    def _credit(self, lost: int) -> int:
        """Take up to `lost` blocks of the received prompts' credit, oldest first; what was taken."""
        taken = 0
        arrived = self._arrived
        while arrived and taken < lost:
            at, blocks = arrived[0]
            use = min(blocks, lost - taken)
            taken += use
            if use == blocks:
                arrived.popleft()
            else:
                arrived[0] = (at, blocks - use)
        return taken

    def _expire(self, now: float) -> None:
        arrived = self._arrived
        while arrived and arrived[0][0] < now - ARRIVAL_CREDIT_SECONDS:
            arrived.popleft()
