"""Paged KV block accounting: who holds which physical block, and which are set aside for migrations.

Mirrors vLLM's block manager at the level the scheduler and the migration protocol see: a fixed
pool of blocks, a free list, one block table per sequence (logical index -> physical block) and,
for migrations coming in, reservations that hold blocks before any request owns them. Block ids
are plain ints indexing the engine's KV buffer. Every operation is O(blocks it moves).
"""

from __future__ import annotations


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
        # Popped from the end: recently freed blocks are reused first, as in vLLM.
        self._free: list[int] = list(range(total_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._reservations: dict[str, list[int]] = {}
        self._used = 0
        self._reserved = 0

    # ------------------------------------------------------------------ counts
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks in some sequence's block table."""
        return self._used

    @property
    def reserved_blocks(self) -> int:
        """Blocks set aside for incoming migrations, not yet owned by a sequence."""
        return self._reserved

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

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
        self._used += num_blocks
        return table

    def free(self, owner: str) -> None:
        """Return every block of the owner to the free list; an owner without blocks is a no-op."""
        table = self._tables.pop(owner, None)
        if table:
            self._used -= len(table)
            self._free.extend(reversed(table))

    # ------------------------------------------------------------------ reservations
    def reservation(self, migration_id: str) -> list[int]:
        """Blocks held for a migration, in the order the migrated blocks go into them."""
        return self._reservations.get(migration_id, [])

    def migrations(self) -> set[str]:
        return set(self._reservations)

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

    def adopt(self, migration_id: str, owner: str, keep: int) -> list[int]:
        """Turn a reservation into the owner's block table: its first `keep` blocks, the rest freed."""
        if owner in self._tables:
            raise ValueError(f"sequence {owner!r} already holds blocks")
        blocks = self._reservations.pop(migration_id, [])
        self._reserved -= len(blocks)
        table, spare = blocks[:keep], blocks[keep:]
        self._free.extend(reversed(spare))
        if table:
            self._tables[owner] = table
            self._used += len(table)
        return table

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """free + used + reserved == total, and every block has exactly one place."""
        held = [b for t in self._tables.values() for b in t]
        reserved = [b for r in self._reservations.values() for b in r]
        assert len(held) == self._used, f"used count {self._used} != {len(held)} blocks in tables"
        assert len(reserved) == self._reserved, f"reserved count {self._reserved} != {len(reserved)} reserved"
        everything = self._free + held + reserved
        assert len(everything) == self.total_blocks, (
            f"free {len(self._free)} + used {len(held)} + reserved {len(reserved)} != total {self.total_blocks}"
        )
        assert sorted(everything) == list(range(self.total_blocks)), "a block is owned twice or lost"

    def _take(self, num_blocks: int, what: str) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocks(f"{what}: {num_blocks} blocks requested, {len(self._free)} free")
        taken = self._free[len(self._free) - num_blocks :]
        del self._free[len(self._free) - num_blocks :]
        taken.reverse()
        return taken
