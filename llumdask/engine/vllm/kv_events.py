"""vLLM's KV-cache events in the scheduler's prefix hashes.

vLLM names a cached block by its own hash, seeded per process (two instances name the same
prefix differently) and never seen by the requester, which hashes prompts with
`llumdask.prefix.block_hashes`. Its KV-cache events carry what it takes to translate:
a stored run of blocks comes with its tokens and its parent block's vLLM hash, so the tracker
keeps, per cached vLLM hash, our hash and the block's position, and chains our hashes on from
the parent's. Work is per block stored or removed, never per block cached; memory is one entry
per cached block (bounded by the pool).

Blocks whose identity holds more than tokens (a LoRA adapter, a cache salt, multimodal
inputs) have no hash of ours and are left out, as are partial blocks: a prompt with plain tokens
would not hit them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llumdask.prefix import ROOT_HASH, PrefixChangeLog, PrefixEvents, block_hashes, is_anchor


@dataclass
class _Cached:
    """One vLLM hash's block(s): our hash, position in its sequence, blocks cached under it."""

    our_hash: int
    position: int
    copies: int = 1


class PrefixTracker:
    """Follows vLLM's events (`apply`) and reports the anchor blocks cached and evicted since
    the last `drain`, as the sim engine's block manager does."""

    def __init__(self, block_size: int, pool_blocks: int) -> None:
        self.block_size = block_size
        self._cached: dict[Any, _Cached] = {}
        self._changes = PrefixChangeLog(pool_blocks)

    def __len__(self) -> int:
        """vLLM hashes followed."""
        return len(self._cached)

    def apply(self, events: Iterable[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._cached.clear()
                self._changes.overflow()

    def drain(self) -> PrefixEvents:
        return self._changes.drain(lambda: (c.our_hash for c in self._cached.values() if is_anchor(c.position, self.block_size)))

    def _stored(self, event: Any) -> None:
        if event.block_size != self.block_size or event.lora_name is not None or event.lora_id is not None:
            return
        if event.extra_keys and any(keys for keys in event.extra_keys):
            return
        parent, position = ROOT_HASH, 0
        if event.parent_block_hash is not None:
            known = self._cached.get(event.parent_block_hash)
            if known is None:
                return  # its parent was never followed (left out above): neither are its children
            parent, position = known.our_hash, known.position + 1
        ours = block_hashes(event.token_ids, self.block_size, parent=parent)
        for offset, (theirs, our_hash) in enumerate(zip(event.block_hashes, ours)):
            known = self._cached.get(theirs)
            if known is not None:
                known.copies += 1  # a second block with the same prefix (two requests computed it at once)
                continue
            self._cached[theirs] = _Cached(our_hash, position + offset)
            if is_anchor(position + offset, self.block_size):
                self._changes.record(our_hash, True)

    def _removed(self, hashes: Iterable[Any]) -> None:
        for theirs in hashes:
            known = self._cached.get(theirs)
            if known is None:
                continue
            known.copies -= 1
            if known.copies == 0:
                del self._cached[theirs]
                if is_anchor(known.position, self.block_size):
                    self._changes.record(known.our_hash, False)
