"""Paged KV block accounting: who holds which physical block, and which are set aside for migrations.

Mirrors vLLM's block manager at the level the scheduler and the migration protocol see: a fixed
pool of blocks, a free list, one block table per sequence (logical index -> physical block) and,
for migrations coming in, reservations that hold blocks before any request owns them. Block ids
are plain ints indexing the engine's KV buffer. Every operation is O(blocks it moves).

Prefix caching, as vLLM v1 does it: a full block can be registered under its prefix hash
(`llumdask.prefix`); a sequence whose prompt starts with cached blocks shares them (`share`), each
block counting its holders. A freed block keeps its hash and content while it waits in the free
pool, so a later request can still hit it; blocks are handed out least recently freed first, and
handing out a cached one evicts its hash. Free blocks that hold no hash go out first: they hold
nothing worth keeping. A sequence's blocks are freed tail first, so its prefix outlives its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from llumdask.prefix import PrefixChangeLog, PrefixEvents


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free (callers check `can_allocate` first)."""


class BlockManager:
    def __init__(self, total_blocks: int, block_size: int) -> None:
        if not isinstance(total_blocks, int) or total_blocks < 1:
            raise ValueError(f"total_blocks must be a positive integer, got {total_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.total_blocks = total_blocks
        self.block_size = block_size
        # Free blocks holding no hash, popped from the end.
        self._free: list[int] = list(range(total_blocks - 1, -1, -1))
        # Free blocks holding a hash, least recently freed first (evicted in that order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[str, list[int]] = {}
        self._reservations: dict[str, list[int]] = {}
        # Cached blocks a migration reuses instead of copying them (each held once by it).
        self._reused: dict[str, list[int]] = {}
        # Holders of every block in some table (a shared prefix block has several).
        self._refs: dict[int, int] = {}
        self._reserved = 0
        # The prefix cache: hash -> block and back, for full blocks whose content is final.
        self._by_hash: dict[int, int] = {}
        # Counts the changes of the hashes cached (`cached_prefix` answers alike while it stands).
        self.cache_version = 0
        self._hash_of: dict[int, int] = {}
        self._evictions = 0
        self._changes = PrefixChangeLog(total_blocks)
        # Cached blocks whose hash the change log reports.
        self._reported: set[int] = set()

    # ------------------------------------------------------------------ counts
    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation may take, cached-but-free ones included (as vLLM counts them)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix a request could hit."""
        return len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._by_hash)

    @property
    def used_blocks(self) -> int:
        """Blocks in some sequence's block table or reused by a migration (a shared block once)."""
        return len(self._refs)

    @property
    def reserved_blocks(self) -> int:
        """Blocks set aside for incoming migrations, not yet owned by a sequence: those reserved
        for copies, and the cached ones reused (the migrant's, whoever else holds them)."""
        return self._reserved + sum(map(len, self._reused.values()))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.free_blocks

    # ------------------------------------------------------------------ sequences
    def table(self, owner: str) -> list[int]:
        """The owner's block table (empty when it holds none). Callers must not mutate it."""
        return self._tables.get(owner, [])

    def owners(self) -> set[str]:
        return set(self._tables)

    def allocate(self, owner: str, num_blocks: int) -> list[int]:
        """Append `num_blocks` free blocks to the owner's table and return the table."""
        taken = self._take(num_blocks, f"sequence {owner!r}")
        table = self._tables.setdefault(owner, [])
        table.extend(taken)
        self._refs.update(dict.fromkeys(taken, 1))
        return table

    def free(self, owner: str) -> None:
        """Drop the owner's hold on each of its blocks, tail first; a block nobody holds returns to
        the free pool (keeping its hash). An owner without blocks is a no-op."""
        table = self._tables.pop(owner, None)
        if table:
            self._release_blocks(reversed(table))

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix(self, hashes: Sequence[int], limit: int) -> list[int]:
        """The blocks caching the longest prefix of `hashes[:limit]` (each a block's chained hash)."""
        blocks = []
        by_hash = self._by_hash
        for index in range(limit):
            block = by_hash.get(hashes[index])
            if block is None:
                break
            blocks.append(block)
        return blocks

    @property
    def evictions(self) -> int:
        """Cached blocks handed out to new holders so far (their prefixes evicted)."""
        return self._evictions

    def blocks_to_take(self, num_new: int, shared: Iterable[int]) -> int:
        """Free blocks an admission of `num_new` new blocks plus the cached `shared` ones uses up:
        a shared block nobody holds leaves the free pool too."""
        return num_new + sum(1 for block in shared if block not in self._refs)

    def share(self, owner: str, blocks: Sequence[int]) -> None:
        """Start an empty table with cached blocks (a prefix hit): each gains a holder."""
        if self._tables.get(owner):
            raise ValueError(f"sequence {owner!r} already holds blocks; a prefix is shared into an empty table")
        self._hold(blocks)
        if blocks:
            self._tables[owner] = list(blocks)

    def _hold(self, blocks: Sequence[int]) -> None:
        """One more holder for each cached block (out of the evictable pool if nobody held it)."""
        for block in blocks:
            if block not in self._hash_of:
                raise ValueError(f"block {block} holds no cached prefix")
            if block in self._refs:
                self._refs[block] += 1
            else:
                del self._evictable[block]
                self._refs[block] = 1

    def register(self, block: int, block_hash: int, *, reported: bool = True) -> None:
        """Record a held block, now full, under its prefix hash. A hash already cached keeps its
        first block (the copy stays private to its sequence, as in vLLM). `reported`: its caching
        and eviction go into the change log (the scheduler indexes anchor blocks only)."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not held; only a sequence's full block is cached")
        if block_hash in self._by_hash or block in self._hash_of:
            return
        self._by_hash[block_hash] = block
        self.cache_version += 1
        self._hash_of[block] = block_hash
        if reported:
            self._reported.add(block)
            self._changes.record(block_hash, True)

    def drain_changes(self) -> PrefixEvents:
        """What the reported part of the cache gained and lost since the last call (the
        scheduler's index follows it)."""
        return self._changes.drain(lambda: (self._hash_of[b] for b in self._reported))

    # ------------------------------------------------------------------ reservations
    def reservation(self, migration_id: str) -> list[int]:
        """Blocks held for a migration, in the order the migrated blocks go into them: the
        cached ones it reuses (`reserve_cached`), then those reserved for copies."""
        return self._reused.get(migration_id, []) + self._reservations.get(migration_id, [])

    def migrations(self) -> set[str]:
        return set(self._reservations) | set(self._reused)

    def reserve_cached(self, migration_id: str, hashes: Sequence[int]) -> list[int]:
        """Open a migration's reservation with the cached blocks of the longest prefix of the
        migrant's block `hashes`: the migration holds each (it is not evicted) and nothing is
        copied into it. Before any `reserve`."""
        if migration_id in self._reservations or migration_id in self._reused:
            raise ValueError(f"migration {migration_id!r} has a reservation already")
        blocks = self.cached_prefix(hashes, len(hashes))
        self._hold(blocks)
        if blocks:
            self._reused[migration_id] = blocks
        return blocks

    def reserve(self, migration_id: str, num_blocks: int) -> bool:
        """Add `num_blocks` to the migration's reservation (each stage reserves its own blocks);
        False, with nothing changed, when they are not free."""
        if num_blocks < 0:
            raise ValueError(f"migration {migration_id!r}: cannot reserve {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            return False
        self._reservations.setdefault(migration_id, []).extend(self._take(num_blocks, migration_id))
        self._reserved += num_blocks
        return True

    def release(self, migration_id: str) -> None:
        """Free a reservation; idempotent (the abort path may run more than once)."""
        blocks = self._reservations.pop(migration_id, None)
        if blocks:
            self._reserved -= len(blocks)
            self._free.extend(reversed(blocks))
        self._release_blocks(reversed(self._reused.pop(migration_id, [])))

    def _release_blocks(self, blocks: Iterable[int]) -> None:
        refs, cached, evictable, free = self._refs, self._hash_of, self._evictable, self._free
        for block in blocks:
            holders = refs.pop(block) - 1
            if holders:
                refs[block] = holders
            elif block in cached:
                evictable[block] = None
            else:
                free.append(block)

    def adopt(self, migration_id: str, owner: str, keep: int) -> list[int]:
        """Turn a reservation into the owner's block table: its first `keep` blocks, the rest freed
        (the reused cached blocks come first, and pass their hold from the migration to the owner)."""
        if owner in self._tables:
            raise ValueError(f"sequence {owner!r} already holds blocks")
        reused = self._reused.pop(migration_id, [])
        if keep < len(reused):
            raise ValueError(f"migration {migration_id!r} reuses {len(reused)} cached blocks, more than {keep}")
        blocks = self._reservations.pop(migration_id, [])
        self._reserved -= len(blocks)
        copied, spare = blocks[: keep - len(reused)], blocks[keep - len(reused) :]
        self._free.extend(reversed(spare))
        self._refs.update(dict.fromkeys(copied, 1))
        table = reused + copied
        if table:
            self._tables[owner] = table
        return table

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """free + used + reserved == total, every block in exactly one place, every held block's
        holder count equal to the tables naming it, and the cache's two maps mirror each other."""
        counts: dict[int, int] = {}
        for table in [*self._tables.values(), *self._reused.values()]:
            assert len(set(table)) == len(table), "a table names a block twice"
            for block in table:
                counts[block] = counts.get(block, 0) + 1
        assert counts == self._refs, "a block's holder count differs from the tables naming it"
        reserved = [b for r in self._reservations.values() for b in r]
        assert len(reserved) == self._reserved, f"reserved count {self._reserved} != {len(reserved)} reserved"
        everything = self._free + list(self._evictable) + list(counts) + reserved
        assert len(everything) == self.total_blocks, (
            f"free {self.free_blocks} + used {len(counts)} + reserved {len(reserved)} != total {self.total_blocks}"
        )
        assert sorted(everything) == list(range(self.total_blocks)), "a block is owned twice or lost"
        assert {b: h for h, b in self._by_hash.items()} == self._hash_of, "prefix cache maps disagree"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block holds no hash"
        assert not any(b in self._hash_of for b in self._free) and not any(b in self._hash_of for b in reserved), (
            "a block outside the tables and the evictable pool kept its hash"
        )

    def _take(self, num_blocks: int, what: str) -> list[int]:
        free = self._free
        if num_blocks <= len(free):
            taken = free[len(free) - num_blocks :]
            del free[len(free) - num_blocks :]
            taken.reverse()
            return taken
        if num_blocks > self.free_blocks:
            raise OutOfBlocks(f"{what}: {num_blocks} blocks requested, {self.free_blocks} free")
        # Every plain free block, then the least recently freed cached ones, evicted.
        taken = free[::-1]
        free.clear()
        self._evictions += num_blocks - len(taken)
        for _ in range(num_blocks - len(taken)):
            block, _ = self._evictable.popitem(last=False)
            evicted = self._hash_of.pop(block)
            del self._by_hash[evicted]
            self.cache_version += 1
            if block in self._reported:
                self._reported.discard(block)
                self._changes.record(evicted, False)
            taken.append(block)
        return taken
