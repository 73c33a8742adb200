"""KV stages between a CUDA device and host memory: the side-stream pinned path against a plain copy.

The KV pool mimics vLLM's: `--layers` bf16 layers, block dimension first, (2, 8 heads, 16 tokens,
128 channels) per block (64 KiB per block and layer); a stage is a random set of blocks of every
layer. Per stage size, medians over `--repeats`:

- export: `cuda_staging.stage_out(...).wait()` (gather on the side stream, one transfer into
  page-locked memory) against the plain path (each layer's blocks selected and copied into a
  pageable numpy buffer on the engine's stream, as the CPU path does) and against a plain
  `tensor.to("cpu")` of the already gathered stage; the link's limit is a `copy_` of a contiguous
  device tensor of the same size into page-locked memory;
- import: `stage_in` then a wait on the engine's stream, against the plain path (pageable bytes
  to the device, then into the blocks) and the pinned host->device `copy_`;
- overlap: a loop of bf16 matrix products on the engine's stream, alone and with exports of the
  largest stage running beside it (queued on the side stream, the bytes waited for on a copy
  thread as the transport does; and the plain path for contrast): the loop's slowdown.

    python -m llumdask.benchmarks.cuda_staging --out DIR [--sizes-mib 16,64,256,1024] [--repeats 5]
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from llumdask.benchmarks.common import int_list, parser, ratio, report
from llumdask.engine.cuda_staging import stage_in, stage_out
from llumdask.engine.fused import blocks_view, bytes_per_block

BLOCK_SHAPE = (2, 8, 16, 128)

COLUMNS = (
    ("mib", "stage MiB", "{:.0f}"),
    ("out_staged_gbs", "D2H staged GB/s", "{:.1f}"),
    ("out_plain_gbs", "D2H plain GB/s", "{:.1f}"),
    ("out_to_cpu_gbs", "D2H .to(cpu) GB/s", "{:.1f}"),
    ("out_pinned_gbs", "D2H pinned copy GB/s", "{:.1f}"),
    ("out_staged_over_pinned", "staged/pinned", "{:.2f}"),
    ("in_staged_gbs", "H2D staged GB/s", "{:.1f}"),
    ("in_plain_gbs", "H2D plain GB/s", "{:.1f}"),
    ("in_pinned_gbs", "H2D pinned copy GB/s", "{:.1f}"),
    ("in_staged_over_pinned", "staged/pinned", "{:.2f}"),
)


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn` with the device idle before each run (one warm-up first)."""
    fn()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return float(np.median(runs))


def plain_out(layers: list[torch.Tensor], block_ids: list[int]) -> np.ndarray:
    """The CPU path's gather run on a CUDA device: each layer's blocks into pageable memory."""
    buffer = np.empty((len(block_ids), len(layers), bytes_per_block(layers)), dtype=np.uint8)
    data = torch.from_numpy(buffer)
    index = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for layer, kv in enumerate(layers):
        blocks_view(data[:, layer], kv).copy_(kv.index_select(0, index))
    return buffer


def plain_in(layers: list[torch.Tensor], block_ids: list[int], buffer: np.ndarray) -> None:
    """The CPU path's scatter run on a CUDA device: pageable bytes to the device per layer."""
    data = torch.from_numpy(buffer)
    index = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for layer, kv in enumerate(layers):
        kv.index_copy_(0, index, blocks_view(data[:, layer], kv).to(kv.device))


def measure_size(layers: list[torch.Tensor], mib: int, repeats: int, rng: np.random.Generator) -> dict:
    per_block = len(layers) * bytes_per_block(layers)
    count = max(1, mib * (1 << 20) // per_block)
    block_ids = rng.permutation(len(layers[0]))[:count].tolist()
    nbytes = count * per_block
    gathered = torch.empty((count, len(layers), bytes_per_block(layers)), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
    buffer = stage_out(layers, block_ids, count).wait().copy()
    targets = rng.permutation(len(layers[0]))[:count].tolist()

    def staged_in() -> None:
        stage_in(layers, targets, buffer)
        torch.cuda.current_stream().synchronize()

    row = {"mib": nbytes / (1 << 20), "blocks": count, "bytes": nbytes}
    timed = {
        "out_staged": lambda: stage_out(layers, block_ids, count).wait(),
        "out_plain": lambda: plain_out(layers, block_ids),
        "out_to_cpu": lambda: gathered.to("cpu"),
        "out_pinned": lambda: pinned.copy_(gathered, non_blocking=True),
        "in_staged": staged_in,
        "in_plain": lambda: plain_in(layers, targets, buffer),
        "in_pinned": lambda: gathered.copy_(pinned, non_blocking=True),
    }
    for name, fn in timed.items():
        row[f"{name}_gbs"] = nbytes / seconds(fn, repeats) / 1e9
    row["out_staged_over_pinned"] = ratio(row["out_staged_gbs"], row["out_pinned_gbs"])
    row["in_staged_over_pinned"] = ratio(row["in_staged_gbs"], row["in_pinned_gbs"])
    return row


def matmul_loop(products: int, every: int, export: Callable[[], None] | None) -> float:
    """Seconds of `products` 8192^3 bf16 products on the engine's stream (device events), with
    `export` called before every `every`-th one."""
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(products):
        if export is not None and i % every == 0:
            export()
        torch.matmul(a, b, out=out)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_overlap(layers: list[torch.Tensor], block_ids: list[int], products: int, every: int) -> dict:
    """The loop's slowdown with an export of `block_ids` queued every `every` products: on the
    side stream, its bytes waited for on a copy thread as the transport does; or the plain way."""
    with ThreadPoolExecutor(1) as copier:
        copies: list[Future] = []

        def staged() -> None:
            copies.append(copier.submit(stage_out(layers, block_ids, len(block_ids)).wait))

        def plain() -> None:
            plain_out(layers, block_ids)

        def loop(export: Callable[[], None] | None) -> float:
            seconds = matmul_loop(products, every, export)
            for copy in copies:
                copy.result()
            copies.clear()
            return seconds

        loop(None), loop(staged)  # warm-up: kernels, and the pool's page-locked blocks
        alone = float(np.median([loop(None) for _ in range(3)]))
        beside_staged = float(np.median([loop(staged) for _ in range(3)]))
        beside_plain = loop(plain)
    return {"products": products, "exports": -(-products // every), "alone_s": alone,
            "staged_s": beside_staged, "plain_s": beside_plain,
            "staged_slowdown": beside_staged / alone - 1, "plain_slowdown": beside_plain / alone - 1}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int_list, default=int_list("16,64,256,1024"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pool-blocks", type=int, default=1024, help="KV blocks per layer on the device")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    sizes, repeats = ([16, 64], 2) if args.quick else (args.sizes_mib, args.repeats)
    rng = np.random.default_rng(0)
    layers = [torch.randn((args.pool_blocks, *BLOCK_SHAPE), device="cuda").to(torch.bfloat16)
              for _ in range(args.layers)]
    rows = [measure_size(layers, mib, repeats, rng) for mib in sizes]
    largest = rows[-1]["blocks"]
    overlap = measure_overlap(layers, rng.permutation(args.pool_blocks)[:largest].tolist(), products=60, every=15)
    facts = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
             "block_bytes_per_layer": bytes_per_block(layers), "repeats": repeats,
             "export_over_pinned_min": min(r["out_staged_over_pinned"] for r in rows),
             "import_over_pinned_min": min(r["in_staged_over_pinned"] for r in rows), **overlap}
    notes = [f"matrix-product loop with a {rows[-1]['mib']:.0f} MiB export every 15 of {overlap['products']} "
             f"products: {overlap['staged_slowdown']:+.1%} on the side stream, {overlap['plain_slowdown']:+.1%} "
             "with the plain path on the engine's stream",
             "GB/s: stage bytes over the median wall time to bytes usable at the other end (1e9 bytes per GB)"]
    report("cuda_staging", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
