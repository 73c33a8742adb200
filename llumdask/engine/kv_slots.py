"""Where a sim engine keeps its KV bytes: a numpy array, or a tensor on a CUDA device.

Both hold (blocks, block size, bytes per token) uint8 and answer the four things the sim engine
does with them: write the slots a step computes, read the slots a step samples from, export
blocks as one fused buffer (copied when the transport asks), and import a fused buffer into
reserved blocks. On a CUDA device the stages move through `llumdask.engine.cuda_staging`, the
code vLLM's CUDA stages use, so the whole migration path runs on a GPU without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from llumdask.engine.pinned_memory import register_in_place

if TYPE_CHECKING:
    import torch


class HostSlots:
    """KV bytes in host memory."""

    def __init__(self, blocks: int, block_size: int, width: int) -> None:
        self._kv = np.zeros((blocks, block_size, width), dtype=np.uint8)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._kv.shape

    def write(self, blocks: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
        self._kv[blocks, slots] = values

    def read(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return self._kv[blocks, slots]

    def export(self, held: list[int], num_blocks: int) -> Callable[[], np.ndarray]:
        """A copy of `held` then zero blocks up to `num_blocks`, made when called."""

        def fuse() -> np.ndarray:
            if len(held) == num_blocks:
                return self._kv[held]
            buffer = np.zeros((num_blocks, *self._kv.shape[1:]), dtype=np.uint8)
            buffer[: len(held)] = self._kv[held]
            return buffer

        return fuse

    def load(self, blocks: list[int], buffer: np.ndarray) -> None:
        self._kv[blocks] = buffer


class CudaSlots:
    """KV bytes on a CUDA device. A step's writes and reads go through the device's current
    stream (the read waits for them: the next token depends on the bytes); stages move on the
    side stream, the export enqueued at once and ordered after the step that wrote its blocks."""

    def __init__(self, blocks: int, block_size: int, width: int, device: str) -> None:
        register_in_place()  # before this process first touches the device
        import torch

        self._torch = torch
        self._device = torch.device(device)
        self._kv = torch.zeros((blocks, block_size, width), dtype=torch.uint8, device=self._device)
        from llumdask.engine.cuda_staging import warm_up

        warm_up([self._kv])

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self._kv.shape)

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        return self._torch.from_numpy(np.ascontiguousarray(array)).to(self._device)

    def write(self, blocks: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
        self._kv[self._on_device(blocks), self._on_device(slots)] = self._on_device(values)

    def read(self, blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return self._kv[self._on_device(blocks), self._on_device(slots)].cpu().numpy()

    def export(self, held: list[int], num_blocks: int) -> Callable[[], np.ndarray]:
        from llumdask.engine.cuda_staging import stage_out

        staged = stage_out([self._kv], held, num_blocks)
        return lambda: staged.wait().reshape(num_blocks, *self._kv.shape[1:])

    def load(self, blocks: list[int], buffer: np.ndarray) -> None:
        from llumdask.engine.cuda_staging import stage_in

        if blocks:
            stage_in([self._kv], blocks, buffer.reshape(len(buffer), 1, self._kv[0].numel()))


def kv_slots(blocks: int, block_size: int, width: int, device: str) -> HostSlots | CudaSlots:
    """The slots on `device` ("cpu", "cuda" or "cuda:N"); a CUDA device must be present."""
    if device == "cpu":
        return HostSlots(blocks, block_size, width)
    try:
        import torch
    except ImportError:
        raise ValueError(f"KV on {device!r} needs torch with CUDA; torch is not installed") from None
    if not torch.cuda.is_available():
        raise ValueError(f"KV on {device!r}: no CUDA device is visible here (torch.cuda.is_available() is False)")
    if width == 0:
        raise ValueError(f"KV on {device!r} needs kv-bytes-per-token > 0 (0 keeps no KV to place)")
    return CudaSlots(blocks, block_size, width, device)
