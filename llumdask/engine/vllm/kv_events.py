"""vLLM's KV-cache events in the scheduler's prefix hashes.

vLLM names a cached block by its own hash, seeded per process (two instances name the same
prefix differently) and never seen by the requester, which hashes prompts with
`llumdask.prefix.block_hashes`. Its KV-cache events carry what it takes to translate:
a stored run of blocks comes with its tokens and its parent block's vLLM hash, so the tracker
keeps, per cached vLLM hash, our hash and the block's position, and chains our hashes on from
the parent's. Work is per block stored or removed, never per block cached; memory is one entry
per cached block (bounded by the pool).

A cache salt enters vLLM's hash of a sequence's first block (the event's extra keys) and so
every block after it: the tracker reports such blocks under their salted keys
(`llumdask.prefix.salted`), as the requester hashes a salted prompt. Blocks whose identity holds
other things (a LoRA adapter, multimodal inputs) have no hash of ours and are left out, as are
partial blocks: a prompt with plain tokens would not hit them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llumdask.prefix import ROOT_HASH, PrefixChangeLog, PrefixEvents, block_hashes, is_anchor, salted


@dataclass
class _Cached:
    """One vLLM hash's block(s): our hash, position in its sequence, the sequence's cache salt,
    the key the block is reported under, blocks cached under it."""

    our_hash: int
    position: int
    cache_salt: str | None
    key: int
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
        return self._changes.drain(lambda: (c.key for c in self._cached.values() if is_anchor(c.position, self.block_size)))

    def _stored(self, event: Any) -> None:
        # A LoRA adapter's name comes as a first block's lone extra key, as a salt does: this test,
        # not `_is_salt`, keeps adapters' blocks out.
        if event.block_size != self.block_size or event.lora_name is not None or event.lora_id is not None:
            return
        parent, position, cache_salt = ROOT_HASH, 0, None
        if event.parent_block_hash is not None:
            known = self._cached.get(event.parent_block_hash)
            if known is None:
                return  # its parent was never followed (left out below): neither are its children
            parent, position, cache_salt = known.our_hash, known.position + 1, known.cache_salt
        extra = list(event.extra_keys or ())
        if position == 0 and extra and _is_salt(extra[0]):
            cache_salt, extra = extra[0][0], extra[1:]
        if any(keys for keys in extra):
            return
        ours = block_hashes(event.token_ids, self.block_size, parent=parent)
        keys = salted(ours, cache_salt)
        for offset, (theirs, our_hash, key) in enumerate(zip(event.block_hashes, ours, keys)):
            known = self._cached.get(theirs)
            if known is not None:
                known.copies += 1  # a second block with the same prefix (two requests computed it at once)
                continue
            self._cached[theirs] = _Cached(our_hash, position + offset, cache_salt, key)
            if is_anchor(position + offset, self.block_size):
                self._changes.record(key, True)

    def _removed(self, hashes: Iterable[Any]) -> None:
        for theirs in hashes:
            known = self._cached.get(theirs)
            if known is None:
                continue
            known.copies -= 1
            if known.copies == 0:
                del self._cached[theirs]
                if is_anchor(known.position, self.block_size):
                    self._changes.record(known.key, False)


def _is_salt(keys: Any) -> bool:
    """A first block's extra keys that are a cache salt alone (vLLM publishes it untagged; an
    engine serving text without LoRA adds nothing else there)."""
    return isinstance(keys, tuple) and len(keys) == 1 and isinstance(keys[0], str)
