"""Prefix identity of KV blocks: one chained hash per full block of a token sequence.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so
two sequences share a block hash exactly when they share every token up to the end of that block
(vLLM's prefix-caching rule). The sim engine keys its prefix cache with these hashes and derives
KV content from them, so a cached block holds the bytes any request with that prefix would write.
Deterministic across processes, so a requester and an engine in different processes agree.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

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


@functools.lru_cache(maxsize=1024)
def salt_key(cache_salt: str) -> int:
    """A cache salt as 64 bits, the same in every process (a str's own hash is salted per process)."""
    digest = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8, person=b"llumdask.salt").digest()
    return int.from_bytes(digest, "little")


def salted(hashes: Sequence[int], cache_salt: str | None) -> Sequence[int]:
    """The cache keys of a request's blocks: their hashes, or with a cache salt (vLLM's
    `cache_salt`: tenants who do not share one never share a cached block) each hash mixed with the
    salt's key. The hashes themselves stay the KV's identity (the sim engine derives the bytes from
    them): a salt changes where a block may be found, never what it holds."""
    if cache_salt is None:
        return hashes
    key = salt_key(cache_salt)
    return [mix_int(h ^ key) for h in hashes]


# The scheduler indexes one block in a stride (the last of each run of that many): a block's
# hash names its whole prefix, so an anchor stands for the blocks before it, and a dispatch walks
# a prompt in strides (prefix matches are found to within a stride). The stride is a number of
# tokens, so that the index costs the same per cached token whatever the block size, and a
# prefix shorter than a stride is as invisible on GPUs (16-token blocks) as on CPUs (128).
ANCHOR_TOKENS = 128


def anchor_stride(block_size: int) -> int:
    """Blocks per anchor at this block size (at least 1)."""
    return max(1, ANCHOR_TOKENS // block_size)


def is_anchor(block_index: int, block_size: int) -> bool:
    """Whether the block at this position of a sequence is one the scheduler indexes."""
    stride = anchor_stride(block_size)
    return block_index % stride == stride - 1


def anchors(hashes: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The anchor blocks' hashes of a sequence's block hashes."""
    stride = anchor_stride(block_size)
    return tuple(hashes[stride - 1 :: stride])


def dispatch_keys(tokens: Sequence[int], block_size: int, cache_salt: str | None) -> tuple[int, ...]:
    """What a dispatch carries of a request's tokens: its anchor blocks' cache keys."""
    return tuple(salted(anchors(block_hashes(tokens, block_size), block_size), cache_salt))


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


NO_PREFIX_EVENTS = PrefixEvents()


class PrefixChangeLog:
    """An engine's side of `PrefixEvents`: the last state of each hash cached or evicted since
    the last drain. Past twice the pool the log is longer than the cache it describes, so it
    stops recording and the next drain sends the whole cache instead (`reset`)."""

    def __init__(self, pool_blocks: int) -> None:
        self._limit = 2 * pool_blocks
        self._changes: dict[int, bool] = {}
        self._overflowed = False

    def record(self, block_hash: int, cached: bool) -> None:
        if self._overflowed:
            return
        self._changes[block_hash] = cached
        if len(self._changes) > self._limit:
            self.overflow()

    def overflow(self) -> None:
        """Make the next drain send the whole cache (the log no longer describes it)."""
        self._changes.clear()
        self._overflowed = True

    def drain(self, whole: Callable[[], Iterable[int]]) -> PrefixEvents:
        """The changes since the last drain, or `whole()` (every reported hash cached now) after
        an overflow."""
        if not self._changes and not self._overflowed:
            return NO_PREFIX_EVENTS  # most reports: nothing changed
        if self._overflowed:
            events = PrefixEvents(stored=tuple(whole()), reset=True)
        else:
            changes = self._changes
            events = PrefixEvents(tuple(h for h, cached in changes.items() if cached),
                                  tuple(h for h, cached in changes.items() if not cached))
        self._changes = {}
        self._overflowed = False
        return events


class PrefixIndex:
    """The global scheduler's view of every instance's prefix cache, fed by their `PrefixEvents`.

    Each instance gets a bit (`add`); each cached block hash maps to the bitset of the instances
    holding it. A prompt's match is then a running AND down its hashes, kept only where it
    changes, so a dispatch costs one big-integer AND per prompt block plus one small numpy pass,
    not a set operation per (block, instance).

    Bounded by what the instances cache (each evicts to fit its blocks). Tolerant of staleness: an
    entry the instance has evicted since makes dispatch expect a hit it will not get, a missed
    event one it does; neither breaks anything, the request is just placed less well. An instance
    starts empty here and fills as it reports what it caches.
    """

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._held: dict[str, set[int]] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []

    def __len__(self) -> int:
        """Entries (hash, instance) held."""
        return sum(len(h) for h in self._held.values())

    @property
    def width(self) -> int:
        """Slots handed out so far (every slot is below it)."""
        return len(self._slots) + len(self._free_slots)

    def add(self, instance_id: str) -> int:
        """The instance's slot (its bit), given on first use."""
        slot = self._slots.get(instance_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else self.width
            self._slots[instance_id] = slot
            self._held[instance_id] = set()
        return slot

    def slot(self, instance_id: str) -> int | None:
        return self._slots.get(instance_id)

    def apply(self, instance_id: str, events: PrefixEvents) -> list[int]:
        """Take in an instance's cache changes; returns the hashes no instance held before."""
        bit = 1 << self.add(instance_id)
        held, masks = self._held[instance_id], self._masks
        if events.reset:
            self._clear(held, bit)
        first = []
        for h in events.stored:
            if h not in held:
                held.add(h)
                others = masks.get(h, 0)
                if not others:
                    first.append(h)
                masks[h] = others | bit
        for h in events.removed:
            if h in held:
                held.discard(h)
                left = masks[h] & ~bit
                if left:
                    masks[h] = left
                else:
                    del masks[h]
        return first

    def drop(self, instance_id: str) -> None:
        """Forget an instance (removed from the cluster); its slot is given again later."""
        slot = self._slots.pop(instance_id, None)
        if slot is not None:
            self._clear(self._held.pop(instance_id), 1 << slot)
            self._free_slots.append(slot)

    def held_anchors(self, instance_id: str) -> int:
        """How many anchors the instance caches, as far as the index knows (each stands for a
        stride of blocks)."""
        return len(self._held.get(instance_id, ()))

    def memory_bytes(self) -> int:
        """What the index occupies: Python's own size of its containers and of every distinct
        object in them (a hash several instances hold is one object or several, as it came)."""
        seen: set[int] = set()
        total = 0

        def count(*objects: object) -> None:
            nonlocal total
            for o in objects:
                if id(o) not in seen:
                    seen.add(id(o))
                    total += sys.getsizeof(o)

        count(self._masks, self._held, self._slots, self._free_slots, *self._free_slots)
        for h, bits in self._masks.items():
            count(h, bits)
        for instance_id, held in self._held.items():
            count(instance_id, held, self._slots[instance_id], *held)
        return total

    def lengths(self, hashes: Sequence[int]) -> np.ndarray | None:
        """Per slot, the length (in anchors) of the longest prefix of anchor `hashes` the instance
        holds; None when nobody holds the first."""
        masks = self._masks
        alive = masks.get(hashes[0], 0) if hashes else 0
        if not alive:
            return None
        # Runs of equal running ANDs: (bitset, how many blocks it held for).
        runs: list[list[int]] = [[alive, 1]]
        for h in hashes[1:]:
            alive &= masks.get(h, 0)
            if not alive:
                break
            if alive == runs[-1][0]:
                runs[-1][1] += 1
            else:
                runs.append([alive, 1])
        width = self.width
        nbytes = (width + 7) // 8
        rows = np.frombuffer(b"".join(bits.to_bytes(nbytes, "little") for bits, _ in runs), dtype=np.uint8)
        held = np.unpackbits(rows.reshape(len(runs), nbytes), axis=1, count=width, bitorder="little")
        # In floating point the product is one BLAS call, exact for any count below 2**53; numpy's
        # integer product is a plain loop, several times slower at a few runs.
        return (np.array([n for _, n in runs], dtype=float) @ held.astype(float)).astype(np.int64)

    def longest_bound(self, hashes: Sequence[int]) -> int:
        """At least the most anchors of `hashes` one instance holds as a prefix (`lengths`' largest):
        the place of the last anchor any instance holds, found walking back from the prompt's end
        (as far as its tail is cached nowhere: for most prompts a few anchors)."""
        masks = self._masks
        for held in range(len(hashes), 0, -1):
            if masks.get(hashes[held - 1]):
                return held
        return 0

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """`lengths` by instance id, for the instances that hold a prefix (in anchors)."""
        lengths = self.lengths(hashes)
        if lengths is None:
            return {}
        return {i: int(lengths[s]) for i, s in self._slots.items() if lengths[s]}

    def _clear(self, held: set[int], bit: int) -> None:
        masks = self._masks
        for h in held:
            left = masks.get(h, 0) & ~bit
            if left:
                masks[h] = left
            else:
                masks.pop(h, None)
        held.clear()
