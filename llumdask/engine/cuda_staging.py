"""Stages of KV blocks between a CUDA device and host memory, off the engine's stream.

A plain `tensor.to("cpu")` copies on the engine's own stream into pageable memory: the engine's
next kernels queue behind it, the calling thread waits for everything queued before it, and the
driver bounces the bytes through a small pinned buffer of its own at a fraction of the link's
bandwidth. Here the engine's thread only queues a stage's gather on a side stream of its device
(one per device), ordered after the work the engine had queued by an event recorded on the
engine's stream (never a device-wide sync); the thread that needs the bytes (the transport's
copy thread) copies them in one transfer into page-locked host memory on the same stream and
waits on that copy's event alone. Page-locked memory comes from PyTorch's caching host
allocator, which is the reusable pool: a block goes back to it once the array handed out is
collected, and is not handed out again before the copies that used it have finished (the
allocator tracks them by events).

Import is the mirror: the received bytes go into page-locked memory, then to the device and
into their blocks on the side stream, and the engine's stream waits on the completion event, so
the next step that reads those blocks runs after them with no host-side wait.

Both sides use the fused layout of `llumdask.engine.fused`, as the CPU path does, so CPU and
CUDA instances exchange stages.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from llumdask.engine.fused import blocks_view, bytes_per_block

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that moves stages for `device`, one per device per process."""
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


class StagedBlocks:
    """A stage gathered on the device; `wait()` brings it to host memory, blocking the calling
    thread alone (the transport's copy thread, not the engine's)."""

    def __init__(self, staged: torch.Tensor, stream: torch.cuda.Stream) -> None:
        self._staged = staged
        self._stream = stream

    def wait(self) -> np.ndarray:
        """The fused bytes, (blocks, layers, bytes per block), in page-locked memory. The
        page-locked block is taken here, so a first allocation of its size (slow, and it may wait
        for the device) never holds up the engine's thread."""
        host = torch.empty(self._staged.shape, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self._stream):
            host.copy_(self._staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return host.numpy()


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device, copied from page-locked memory without waiting (a plain
    `torch.tensor(..., device=...)` would wait for the current stream)."""
    return torch.tensor(block_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def stage_out(layers: list[torch.Tensor], block_ids: list[int], num_blocks: int) -> StagedBlocks:
    """Gather `block_ids` of every layer (then zero blocks up to `num_blocks`) into one device
    buffer on the side stream, ordered after the work queued on the device's current stream;
    returns at once. One kernel per layer selects its blocks straight into the buffer."""
    device = layers[0].device
    stream = side_stream(device)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        staged = torch.empty((num_blocks, len(layers), bytes_per_block(layers)), dtype=torch.uint8, device=device)
        if len(block_ids) < num_blocks:
            staged[len(block_ids) :].zero_()
        if block_ids:
            index = _index(block_ids, device)
            for layer, kv in enumerate(layers):
                torch.index_select(kv, 0, index, out=blocks_view(staged[: len(block_ids), layer], kv))
    return StagedBlocks(staged, stream)


def stage_in(layers: list[torch.Tensor], block_ids: list[int], buffer: np.ndarray) -> None:
    """Write a fused buffer (blocks, layers, bytes per block) into `block_ids` of every layer on
    the side stream; work queued on the device's current stream afterwards runs after it."""
    device = layers[0].device
    stream = side_stream(device)
    host = torch.empty(buffer.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.from_numpy(buffer))  # PyTorch's copy runs on several threads, numpy's on one
    engine = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(engine)  # blocks just freed may still be read by queued kernels
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        staged = host.to(device, non_blocking=True)
        index = _index(block_ids, device)
        for layer, kv in enumerate(layers):
            kv.index_copy_(0, index, blocks_view(staged[:, layer], kv))
        done = torch.cuda.Event()
        done.record(stream)
    engine.wait_event(done)


def warm_up(layers: list[torch.Tensor]) -> None:
    """One stage of block 0 out and back in, waited for: CUDA loads kernels on their first use
    and a load waits for the whole device, so an engine warms its stages up when it starts
    (block 0 holds nothing yet) rather than in its first migration."""
    stage_in(layers, [0], stage_out(layers, [0], 1).wait())
    torch.cuda.synchronize(layers[0].device)
