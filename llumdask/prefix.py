"""Prefix identity of KV blocks: one chained hash per full block of a token sequence.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so
two sequences share a block hash exactly when they share every token up to the end of that block
(vLLM's prefix-caching rule). The sim engine keys its prefix cache with these hashes and derives
KV content from them, so a cached block holds the bytes any request with that prefix would write.
Deterministic across processes, so a requester and an engine in different processes agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

# The parent of a sequence's first block.
ROOT_HASH = 0x6A09E667F3BCC908
_MASK64 = (1 << 64) - 1
_U64 = np.uint64


_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array: a bijection that spreads every input bit."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(_MIX1)
    x = x ^ (x >> _U64(27))
    x = x * _U64(_MIX2)
    return x ^ (x >> _U64(31))


def mix_int(x: int) -> int:
    """`mix` of one value in Python integers (uint64 wrap-around by masking)."""
    x ^= x >> 30
    x = (x * _MIX1) & _MASK64
    x ^= x >> 27
    x = (x * _MIX2) & _MASK64
    return x ^ (x >> 31)


def block_hashes(tokens: Sequence[int], block_size: int, *, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of `tokens`, chained from `parent` (the hash of the block before
    `tokens[0]`, ROOT_HASH at a sequence's start). A partial last block has none.

    Python's tuple hash over integers is deterministic (only str and bytes hashing is salted per
    process) and runs in C: a block costs about a microsecond."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = mix_int(hash((h, *tokens[start : start + block_size])) & _MASK64)
        hashes.append(h)
    return hashes


@dataclass(frozen=True)
class PrefixEvents:
    """What changed in an instance's prefix cache since its last report: block hashes cached
    (`stored`) and evicted (`removed`), or, with `reset`, its whole cache in `stored` (the
    change log outgrew the cache, so the full list is the shorter message)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    reset: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.reset)

    def to_dict(self) -> dict:
        return {"stored": list(self.stored), "removed": list(self.removed), "reset": self.reset}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PrefixEvents":
        return cls(tuple(int(h) for h in d.get("stored", ())), tuple(int(h) for h in d.get("removed", ())),
                   bool(d.get("reset", False)))


class PrefixIndex:
    """The global scheduler's view of every instance's prefix cache, fed by their `PrefixEvents`.

    Bounded by what the instances cache (each evicts to fit its blocks). Tolerant of staleness: an
    entry the instance has evicted since makes dispatch expect a hit it will not get, a missed
    event one it does; neither breaks anything, the request is just placed less well. An instance
    registered late starts empty here and fills as it caches.
    """

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}

    def __len__(self) -> int:
        """Entries (hash, instance) held."""
        return sum(len(h) for h in self._held.values())

    def apply(self, instance_id: str, events: PrefixEvents) -> None:
        held = self._held.setdefault(instance_id, set())
        if events.reset:
            self._forget(instance_id, held)
            held.clear()
        holders = self._holders
        for h in events.stored:
            if h not in held:
                held.add(h)
                holders.setdefault(h, set()).add(instance_id)
        for h in events.removed:
            if h in held:
                held.discard(h)
                owners = holders[h]
                owners.discard(instance_id)
                if not owners:
                    del holders[h]

    def drop(self, instance_id: str) -> None:
        """Forget an instance (removed from the cluster)."""
        held = self._held.pop(instance_id, None)
        if held:
            self._forget(instance_id, held)

    def cached_blocks(self, instance_id: str) -> int:
        """How many block hashes the instance holds, as far as the index knows."""
        return len(self._held.get(instance_id, ()))

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each instance holding the first block, the length (in blocks) of the longest
        prefix of `hashes` it holds. O(instances holding each block walked)."""
        if not hashes:
            return {}
        alive = set(self._holders.get(hashes[0], ()))
        lengths: dict[str, int] = {}
        for index, h in enumerate(hashes[1:], start=1):
            if not alive:
                break
            holders = self._holders.get(h)
            ended = alive - holders if holders else alive
            for instance_id in ended:
                lengths[instance_id] = index
            alive = alive - ended if holders else set()
        for instance_id in alive:
            lengths[instance_id] = len(hashes)
        return lengths

    def _forget(self, instance_id: str, held: set[int]) -> None:
        holders = self._holders
        for h in held:
            owners = holders.get(h)
            if owners is not None:
                owners.discard(instance_id)
                if not owners:
                    del holders[h]
