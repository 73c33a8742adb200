"""The instances a request may be dispatched to, with the dispatch load's terms as columns.

Dispatch evaluates every candidate for every request: at 1,024 instances a Python loop over
them costs more than the whole dispatch budget (200 us). The scheduler therefore keeps each
candidate's share of the dispatch load (`llumdask.load`) in numpy columns, updated in O(1)
whenever that instance's report, its pending requests or its state change, and a dispatch
reads them in one vectorized pass. The columns hold exactly what `dispatch_freeness` computes
one instance at a time (a test keeps the two equal).
"""

from __future__ import annotations

import math
from typing import Iterator, Protocol, Sequence, overload

import numpy as np

from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixIndex, anchor_stride
from llumdask.request import Priority


class Candidate(Protocol):
    """The view of one dispatchable instance that policies read."""

    instance_id: str
    # The id's place in the natural order of ids: every policy's tie-break.
    order: tuple
    block_size: int
    load: InstanceLoad
    # Requests dispatched to it but not yet in `load`: how many, their prompt blocks and tokens.
    num_pending: int
    pending_blocks: int
    pending_prompt_tokens: int
    # The dispatch load's terms (pending included): free blocks after every queued demand and the
    # headroom of the classes present, the requests they are shared by, and F = their ratio.
    dispatch_surplus: float
    dispatch_requests: int
    dispatch_freeness: float

    def absent_charge(self, priority: Priority) -> int:
        """Blocks of headroom an arriving request of this execution priority adds here: its class's
        headroom if none of its class runs (or is on its way) here, else 0."""


class _Answer:
    """One question to `dispatch_freeness` (a prompt, its class, its cached blocks, its copies), its
    answer and the answer's freest slot (None until asked)."""

    __slots__ = ("prompt_tokens", "priority", "cached", "copies", "freeness", "best")

    def __init__(self, prompt_tokens: int, priority: Priority, cached: np.ndarray | None, copies: int,
                 freeness: np.ndarray) -> None:
        self.prompt_tokens = prompt_tokens
        self.priority = priority
        self.cached = cached
        self.copies = copies
        self.freeness = freeness
        self.best: int | None = None


class CandidateTable(Sequence[Candidate]):
    """Candidates in natural id order, and their dispatch-load columns."""

    def __init__(self, candidates: Sequence[Candidate], prefix: PrefixIndex | None = None) -> None:
        self._candidates = sorted(candidates, key=lambda c: c.order)
        self._prefix = prefix
        self._last_hits: tuple[tuple[int, ...], np.ndarray | None] | None = None
        # Each candidate's bit in the index (its slot).
        self._prefix_slots = np.array([prefix.add(c.instance_id) for c in self._candidates] if prefix is not None else [],
                                      dtype=np.int64)
        n = len(self._candidates)
        self._surplus = np.empty(n)
        # The requests the surplus is shared by once this one is added (dispatch_requests + 1).
        self._shared_by = np.empty(n)
        # Prefill tokens queued there (reported waiting + dispatched since) and the decodes a prefill
        # there stalls (running + pending + itself).
        self._prefill_tokens = np.empty(n)
        self._stalled = np.empty(n)
        self._block_size = np.fromiter((c.block_size for c in self._candidates), dtype=np.int64, count=n)
        self._total_blocks = np.fromiter((c.load.total_blocks for c in self._candidates), dtype=np.int64, count=n)
        # One block size for all (the usual case): block arithmetic on a scalar, not a column.
        sizes = set(self._block_size.tolist())
        self._uniform_block_size: int | None = sizes.pop() if len(sizes) == 1 else None
        # The largest memory of any candidate, for a uniform block size (fixed with the membership).
        self._most_blocks = int(self._total_blocks.max()) if self._uniform_block_size else 0
        # Blocks an anchor of the prefix index stands for.
        self._stride: float | np.ndarray = (float(anchor_stride(self._uniform_block_size)) if self._uniform_block_size
                                          else np.array([anchor_stride(int(b)) for b in self._block_size], dtype=float))
        self._most_stride = float(np.max(self._stride, initial=0.0))
        self._most_anchor_tokens = int(np.max(self._stride * self._block_size, initial=0))
        self._charge = {p: np.zeros(n) for p in Priority}
        # Candidates charged each class's headroom: a column of zeros is not worth a pass.
        self._charged = dict.fromkeys(Priority, 0)
        self._slots = {c.instance_id: k for k, c in enumerate(self._candidates)}
        # The last `dispatch_freeness` answer, until a candidate changes: admission and the policy
        # of one dispatch ask the same.
        self._last: _Answer | None = None
        # The last spare room asked for ((priority, freeness), most blocks, most tokens), until a
        # candidate changes (`_spare_of`).
        self._spare: tuple[tuple[Priority, float], float, float] | None = None
        # A slot kept for a held request (`llumdask.holding`): no other request may go there.
        self._reserved: int | None = None
        for candidate in self._candidates:
            self.update(candidate)

    def update(self, candidate: Candidate) -> None:
        """Take a candidate's current terms (no-op for an instance not in the table)."""
        slot = self._slots.get(candidate.instance_id)
        if slot is not None:
            self._last = self._last_hits = self._spare = None
            self._surplus[slot] = candidate.dispatch_surplus
            self._shared_by[slot] = candidate.dispatch_requests + 1
            self._prefill_tokens[slot] = candidate.load.pending_prefill_tokens + candidate.pending_prompt_tokens
            self._stalled[slot] = candidate.load.num_running + candidate.num_pending + 1
            for priority, column in self._charge.items():
                charge = candidate.absent_charge(priority)
                self._charged[priority] += bool(charge) - bool(column[slot])
                column[slot] = charge

    def slot(self, instance_id: str) -> int | None:
        """The candidate's position in the table (None if it is not one)."""
        return self._slots.get(instance_id)

    def could_ever_keep(self, freeness: float, prompt_tokens: int, copies: int = 1) -> bool:
        """Whether some candidate, empty, would keep `freeness` with this request's `copies` alone
        on it (its whole memory less their blocks, shared by them): what it could ever offer."""
        if self._uniform_block_size:
            room = self._most_blocks - copies * -(-prompt_tokens // self._uniform_block_size)
        else:
            room = int((self._total_blocks - copies * -(-prompt_tokens // self._block_size)).max())
        return room >= freeness * copies

    def reserve(self, slot: int | None) -> None:
        """Keep the candidate at `slot` for a held request (None: for none): its dispatch freeness
        reads -inf for every other request until then."""
        if slot != self._reserved:
            self._reserved = slot
            self._last = self._spare = None

    def reserved(self, slot: int | None) -> "Reservation":
        """`reserve(slot)` for the length of a with block."""
        return Reservation(self, slot)

    def dispatch_freeness(self, prompt_tokens: int, priority: Priority, cached: np.ndarray | None = None,
                          copies: int = 1) -> np.ndarray:
        """Each candidate's dispatch freeness with this request's `copies` added (each its prompt
        blocks as demand, less the `cached` blocks each candidate holds already, and one more
        request; its class's headroom where absent; -inf where reserved), aligned with the table's
        order. Callers must not change the array (the next identical question gets it again)."""
        return self._answer(prompt_tokens, priority, cached, copies).freeness

    def freest(self, prompt_tokens: int, priority: Priority, cached: np.ndarray | None = None, copies: int = 1) -> int:
        """The slot of the highest `dispatch_freeness` with this request (the first of equals)."""
        answer = self._answer(prompt_tokens, priority, cached, copies)
        if answer.best is None:
            answer.best = int(np.argmax(answer.freeness))
        return answer.best

    def could_keep(self, freeness: float, prompt_tokens: int, priority: Priority, cached: float = 0,
                   copies: int = 1) -> bool:
        """Whether some candidate not reserved might keep `freeness` with this request's `copies`,
        were `cached` blocks of it (`most_cached_bound`) cached everywhere: False only where
        `dispatch_freeness` is below it everywhere (mixed block sizes: always True)."""
        size = self._uniform_block_size
        if size is None:
            return True
        # Each copy past the first is one more request the room is shared by (widened as `_spare_of`).
        need = copies * (-(-prompt_tokens // size) - cached) + max(freeness, 0) * (copies - 1) * (1 - 1e-9)
        return need <= self._spare_of(freeness, priority)[0]

    def spare_tokens(self, freeness: float, priority: Priority) -> float:
        """The most prompt tokens, none of them cached, that a request of `priority` could bring to
        a candidate not reserved and still keep `freeness` there (each candidate's spare blocks at
        its own block size)."""
        return self._spare_of(freeness, priority)[1]

    def _spare_of(self, freeness: float, priority: Priority) -> tuple[float, float]:
        """(most blocks, most tokens) a request could take and keep `freeness` (inf below 0). One
        pass per priority between changes, then O(1): held requests ask after every report."""
        if freeness < 0:
            return math.inf, math.inf
        spare = self._spare
        if spare is None or spare[0] != (priority, freeness):
            # The blocks each could give a request and still keep `freeness` (a request's F is its
            # surplus over the requests sharing it), widened so that rounding never turns one away.
            room = self._surplus - freeness * self._shared_by * (1 - 1e-9) + 1e-6
            if self._charged[priority]:
                room -= self._charge[priority]
            if self._reserved is not None:
                room[self._reserved] = -np.inf
            spare = self._spare = ((priority, freeness), float(room.max()), float((room * self._block_size).max()))
        return spare[1], spare[2]

    @property
    def most_anchor_tokens(self) -> int:
        """The most prompt tokens an anchor of the prefix index stands for on any candidate (0: none)."""
        return self._most_anchor_tokens

    def _answer(self, prompt_tokens: int, priority: Priority, cached: np.ndarray | None, copies: int) -> _Answer:
        last = self._last
        if (last is not None and last.prompt_tokens == prompt_tokens and last.priority is priority
                and last.cached is cached and last.copies == copies):
            return last
        # As few passes over the columns as the request needs: right after a burst of reports they
        # are out of the CPU's caches, and each pass costs several times what it does warm.
        size = self._uniform_block_size
        surplus = self._surplus - copies * -(-prompt_tokens // (size or self._block_size))
        if self._charged[priority]:
            surplus -= self._charge[priority]
        if cached is not None:
            surplus += cached if copies == 1 else copies * cached
        shared_by = self._shared_by if copies == 1 else self._shared_by + (copies - 1)
        freeness = surplus / shared_by
        # A deficit is multiplied by the requests instead (`load.per_request`).
        np.multiply(surplus, shared_by, out=freeness, where=surplus < 0)
        if self._reserved is not None:
            freeness[self._reserved] = -np.inf
        self._last = _Answer(prompt_tokens, priority, cached, copies, freeness)
        return self._last

    def interference(self, prompt_tokens: int, cached: np.ndarray | None = None, copies: int = 1) -> np.ndarray:
        """How much this request would interfere with each candidate's work, LMetric's measure:
        (prefill tokens it waits behind + its own not `cached` there) x (the decodes its prefill
        stalls + itself), each of its `copies` a request with its own prefill."""
        if cached is None:
            own = prompt_tokens
        else:
            own = np.maximum(prompt_tokens - cached * (self._uniform_block_size or self._block_size), 1)
        if copies == 1:
            return (self._prefill_tokens + own) * self._stalled
        return (self._prefill_tokens + copies * own) * (self._stalled + (copies - 1))

    def cached_blocks(self, hashes: tuple[int, ...]) -> np.ndarray | None:
        """Blocks of the longest prefix each candidate holds in its prefix cache, as its reports
        tell, from the prompt's anchor `hashes` (to within an anchor stride); None when no
        candidate holds the first (nothing to tell them apart)."""
        if not hashes or self._prefix is None:
            return None
        last = self._last_hits
        if last is not None and last[0] is hashes:
            return last[1]
        lengths = self._prefix.lengths(hashes)
        # Every candidate has its slot (given when the table was built), below the index's width.
        hits = None if lengths is None else lengths[self._prefix_slots] * self._stride
        self._last_hits = (hashes, hits)
        return hits

    def most_cached_bound(self, hashes: tuple[int, ...]) -> float:
        """At least `cached_blocks`' largest, without a pass over the instances (the index answers
        for every instance it knows, candidates or not)."""
        if not hashes or self._prefix is None:
            return 0.0
        return self._prefix.longest_bound(hashes) * self._most_stride

    def held_blocks(self) -> np.ndarray:
        """Block hashes each candidate caches, as far as the index knows (its cache's size)."""
        prefix = self._prefix
        held = np.array([prefix.held_anchors(c.instance_id) if prefix is not None else 0 for c in self._candidates], dtype=float)
        return held * self._stride

    def __len__(self) -> int:
        return len(self._candidates)

    @overload
    def __getitem__(self, index: int) -> Candidate: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Candidate]: ...

    def __getitem__(self, index):
        return self._candidates[index]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._candidates)


class Reservation:
    """A candidate reserved for a held request while a with block runs (cheaper than a generator's
    context: it runs after every report while requests are held)."""

    __slots__ = ("_table", "_slot")

    def __init__(self, table: CandidateTable, slot: int | None) -> None:
        self._table = table
        self._slot = slot

    def __enter__(self) -> None:
        self._table.reserve(self._slot)

    def __exit__(self, *_: object) -> None:
        self._table.reserve(None)
