"""Prefix identity of KV blocks: one chained hash per full block of a token sequence.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so
two sequences share a block hash exactly when they share every token up to the end of that block
(vLLM's prefix-caching rule). The sim engine keys its prefix cache with these hashes and derives
KV content from them, so a cached block holds the bytes any request with that prefix would write.
Deterministic across processes, so a requester and an engine in different processes agree.
"""

from __future__ import annotations

from typing import Sequence

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
