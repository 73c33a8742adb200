"""Block-level reads and writes of vLLM's paged KV cache.

A fused buffer is a uint8 numpy array of shape (blocks, ranks, layers, bytes per block): each
rank's share in the layout of `llumdask.engine.fused`. On a CUDA device stages move on a side
stream through page-locked memory (`llumdask.engine.cuda_staging`); on a CPU device straight
between the KV tensors and the buffer.

The layer tensors are the attention layers' `kv_cache` in vLLM's static forward context (the
same objects a step's `ForwardContext.no_compile_layers` holds), ordered by layer name so that
every engine of one model agrees on the order; block dimension first (vLLM's standardized
[blocks, heads, tokens, channels] layout). gather_blocks / scatter_blocks run on each worker
through `LLMEngine.collective_rpc`. tests/vllm/test_contract.py pins the attributes used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from llumdask.engine.cuda_staging import stage_in, stage_out, warm_up
from llumdask.engine.fused import blocks_view, bytes_per_block


def kv_tensors(layers: Mapping[str, Any]) -> list[torch.Tensor]:
    """The KV tensor of every attention layer, by layer name."""
    tensors = [getattr(layers[name], "kv_cache", None) for name in sorted(layers)]
    tensors = [kv for kv in tensors if isinstance(kv, torch.Tensor)]
    if not tensors:
        raise NotImplementedError("llumdask migration needs one KV tensor per attention layer")
    return tensors


def tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def write_blocks(layers: list[torch.Tensor], block_ids: list[int], buffer: np.ndarray) -> None:
    """Write (blocks, layers, bytes) of one rank into the given blocks of every layer: on a CPU
    device one copy straight from the buffer's memory (a strided view, never a contiguous copy
    first); on a CUDA device on the side stream, the engine's next step ordered after it."""
    if layers[0].is_cuda:
        stage_in(layers, block_ids, buffer)
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    data = torch.from_numpy(buffer)
    for layer, kv in enumerate(layers):
        kv.index_copy_(0, index, blocks_view(data[:, layer], kv))


def copy_blocks(layers: list[torch.Tensor], source: list[int], target: list[int]) -> None:
    """Device-local block copies, every layer."""
    src = torch.tensor(source, dtype=torch.long, device=layers[0].device)
    dst = torch.tensor(target, dtype=torch.long, device=layers[0].device)
    for kv in layers:
        kv.index_copy_(0, dst, kv.index_select(0, src))


def _worker_layers(worker: Any) -> list[torch.Tensor]:
    return kv_tensors(worker.model_runner.compilation_config.static_forward_context)


def gather_blocks(worker: Any, block_ids: list[int], num_blocks: int) -> np.ndarray:
    """This rank's share of a fused buffer: (num_blocks, layers, bytes per block), uint8; the
    given blocks first, zeros after them. On a CPU device each layer's blocks are selected
    straight into the buffer (one copy of the KV, whatever the stage's size); on a CUDA device
    the stage moves on the side stream and only this thread waits for it."""
    layers = _worker_layers(worker)
    if layers[0].is_cuda:
        return stage_out(layers, block_ids, num_blocks).wait()
    buffer = np.empty((num_blocks, len(layers), bytes_per_block(layers)), dtype=np.uint8)
    buffer[len(block_ids) :] = 0
    if not block_ids:
        return buffer
    data = torch.from_numpy(buffer[: len(block_ids)])
    index = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for layer, kv in enumerate(layers):
        torch.index_select(kv, 0, index, out=blocks_view(data[:, layer], kv))
    return buffer


def scatter_blocks(worker: Any, block_ids: list[int], buffer: np.ndarray) -> None:
    """Write this rank's slice of a fused buffer into the given blocks."""
    write_blocks(_worker_layers(worker), block_ids, buffer[:, tensor_parallel_rank()])


def prepare_stages(worker: Any) -> tuple[int, int]:
    """(layers, bytes per block) of this rank's KV cache: the shape a fused buffer must have.
    Asked once as the engine starts, when a CUDA rank also warms its stages up (`warm_up`)."""
    layers = _worker_layers(worker)
    if layers[0].is_cuda:
        warm_up(layers)
    return len(layers), bytes_per_block(layers)

