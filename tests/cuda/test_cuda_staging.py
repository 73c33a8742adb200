"""KV stages on a CUDA device: bit-exact round trips in vLLM's layout, no wait on the engine's
stream, and sim engines with their KV on the GPU migrating to the tokens they would have made in
place, to and from CPU instances. Skipped where no CUDA device is visible (the GPU check,
`python -m llumdask.benchmarks.cuda_check`, runs them on one)."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from llumdask.config import SimEngineConfig  # noqa: E402
from llumdask.engine.cuda_staging import stage_in, stage_out, warm_up  # noqa: E402
from llumdask.engine.sim import SimEngine  # noqa: E402
from llumdask.request import Request, SamplingParams, blocks_for  # noqa: E402

# vLLM's standardized KV layout, block dimension first: (blocks, K and V, heads, tokens, channels).
BLOCK_SHAPE = (2, 8, 16, 128)


def kv_layers(n_layers: int, dtype: torch.dtype, blocks: int = 64, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn((blocks, *BLOCK_SHAPE), generator=generator, device="cuda").to(dtype) for _ in range(n_layers)]


def host_bytes(kv: torch.Tensor, block_ids: list[int]) -> np.ndarray:
    """The reference: the blocks' bytes, read the plain way."""
    return kv[block_ids].cpu().view(torch.uint8).reshape(len(block_ids), -1).numpy()


def busy(stream_ms_of_work: int = 40) -> None:
    """Queue tens of milliseconds of matrix products on the current stream."""
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    for _ in range(stream_ms_of_work):
        a = (a @ a).clamp_(-1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_stage_round_trips_bit_exactly(dtype):
    source, destination = kv_layers(4, dtype, seed=1), kv_layers(4, dtype, seed=2)
    block_ids = [17, 3, 40, 8, 9]
    buffer = stage_out(source, block_ids, num_blocks=7).wait()
    assert buffer.shape == (7, 4, source[0][0].numel() * source[0].element_size()) and buffer.dtype == np.uint8
    for layer, kv in enumerate(source):
        assert np.array_equal(buffer[:5, layer], host_bytes(kv, block_ids))
    assert not buffer[5:].any()  # blocks past the given ones travel as zeros
    targets = [60, 2, 33, 34, 11]
    untouched = [kv.clone() for kv in destination]
    stage_in(destination, targets, buffer[:5])
    for src, dst, before in zip(source, destination, untouched):
        assert torch.equal(dst[targets].view(torch.int16), src[block_ids].view(torch.int16))
        others = [b for b in range(64) if b not in targets]
        assert torch.equal(dst[others].view(torch.int16), before[others].view(torch.int16))


def test_vllms_gather_and_write_take_the_side_stream_on_cuda():
    """The vLLM engine's entry points (run on its worker) on CUDA layers: a worker stand-in
    holding the layers as vLLM's static forward context does."""
    from types import SimpleNamespace

    from llumdask.engine.vllm.kv_blocks import gather_blocks, write_blocks

    source, destination = kv_layers(3, torch.bfloat16, seed=3), kv_layers(3, torch.bfloat16, seed=4)
    context = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(kv_cache=kv) for i, kv in enumerate(source)}
    worker = SimpleNamespace(model_runner=SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=context)))
    buffer = gather_blocks(worker, [7, 8, 30], 4)
    write_blocks(destination, [1, 2, 3], buffer[:3])
    for src, dst in zip(source, destination):
        assert torch.equal(dst[1:4].view(torch.int16), src[[7, 8, 30]].view(torch.int16))
    assert not buffer[3].any()


def test_an_export_neither_waits_for_the_engines_stream_nor_runs_before_its_work():
    """As an engine runs it: warmed up when it starts, the gather queued on its thread, the
    bytes waited for on another (the transport's copy thread)."""
    layers = kv_layers(2, torch.bfloat16)
    warm_up(layers)
    expected = host_bytes(layers[0], [1, 2])
    written = torch.randn_like(layers[0][1:3])
    engine = torch.cuda.current_stream()
    busy(), torch.cuda.synchronize()  # CUDA loads a kernel at its first use, waiting for the device
    busy()
    layers[0][1:3].copy_(written)  # queued behind the products: the export must see it
    staged = stage_out(layers, [1, 2], 2)
    assert not engine.query()  # returned without waiting for the engine's queued work
    with ThreadPoolExecutor(1) as copier:
        copied = copier.submit(staged.wait).result()
    after = host_bytes(layers[0], [1, 2])
    assert np.array_equal(copied[:, 0], after) and not np.array_equal(after, expected)


def test_an_import_is_ordered_before_the_engines_next_work_without_a_host_wait():
    layers = kv_layers(2, torch.float16)
    warm_up(layers)
    buffer = stage_out(kv_layers(2, torch.float16, seed=9), [4, 5, 6], 3).wait()
    busy(), torch.cuda.synchronize()
    busy()
    stage_in(layers, [10, 11, 12], buffer)
    assert not torch.cuda.current_stream().query()  # returned without a host wait
    read_next = layers[1][10:13].clone()  # the engine's next work on its own stream
    assert np.array_equal(read_next.cpu().view(torch.uint8).reshape(3, -1).numpy(), buffer[:, 1])


# ----------------------------------------------------------------------------- sim engines on the GPU
class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def sim_engine(device: str) -> SimEngine:
    return SimEngine(SimEngineConfig(total_blocks=96, kv_bytes_per_token=32, kv_device=device), block_size=4,
                     clock=Clock())


def request(rid: str, prompt_len: int, max_tokens: int = 40) -> Request:
    prompt = [zlib.crc32(f"{rid}:{i}".encode()) % 30000 + 10 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def tokens_of(engine: SimEngine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step().outputs:
            if out.request_id == rid:
                tokens.extend(out.token_ids)
    engine.check_integrity()
    return tokens


def migrate(source: SimEngine, destination: SimEngine, rid: str) -> list[int]:
    """A staged copy as the llumlet makes it; returns the tokens made on the source."""
    made: list[int] = []
    sent = 0
    for _ in range(3):
        for out in source.step().outputs:
            made.extend(out.token_ids if out.request_id == rid else ())
        done = source.completed_blocks(rid)
        if done > sent:
            assert destination.reserve_blocks("m", done - sent)
            destination.import_blocks("m", sent, source.export_later(rid, sent, done).copy())
            sent = done
    state = source.pause(rid)
    total = blocks_for(state.num_tokens, source.block_size)
    assert destination.reserve_blocks("m", total - sent)
    destination.import_blocks("m", sent, source.export_blocks(rid, sent, total))
    destination.resume("m", state)
    source.free_migrated(rid)
    source.check_integrity()
    return made


@pytest.mark.parametrize("source_device, destination_device", [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_sim_engines_with_kv_on_the_gpu_migrate_to_the_tokens_made_in_place(source_device, destination_device):
    in_place = sim_engine("cpu")
    in_place.add_request(request("r", 37))
    expected = tokens_of(in_place, "r")
    source, destination = sim_engine(source_device), sim_engine(destination_device)
    source.add_request(request("r", 37))
    source.add_request(request("other", 12))
    destination.add_request(request("resident", 20))
    made = migrate(source, destination, "r")
    assert made + tokens_of(destination, "r") == expected
