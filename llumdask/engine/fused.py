"""The fused layout in which a stage of KV blocks travels, whatever the engine and device.

A fused buffer is uint8 of shape (blocks, layers, bytes per block): any set of blocks gathered
into one contiguous copy that any transport can ship, and the byte view makes bfloat16 (which
numpy lacks) travel like any other dtype. Each layer's tensor has the block dimension first, so
one block of one layer is one row of bytes.
"""

from __future__ import annotations

import torch


def bytes_per_block(layers: list[torch.Tensor]) -> int:
    """Bytes one block of one layer holds (every layer of a model has the same block shape)."""
    return layers[0][0].numel() * layers[0].element_size()


def blocks_view(rows: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """(blocks, bytes) uint8 rows seen as blocks of `kv` (its dtype and block shape), no copy."""
    return rows.view(kv.dtype).view(rows.shape[0], *kv.shape[1:])
