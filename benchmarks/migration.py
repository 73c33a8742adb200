"""Live-migration downtime vs sequence length, across two worker processes, against a blocking copy.

Two deployments run side by side, each a scheduler and two sim-engine worker processes whose KV
buffers hold real bytes (`sim-engine.kv-bytes-per-token`, 32 KiB by default, so 8192 tokens are
256 MiB): "staged" with llumdask's multi-stage migration (the defaults: copy while decoding,
pause only for the last blocks) and "blocking" with `migration.max-stages: 1` (pause, copy
everything, resume), which is the single-stage copy of the same bytes through the same code.
For each prompt length a request streams to this process; after a few tokens it is migrated to
the other instance (the operator `migrate` call), and a few tokens after the switch it is aborted.

Measured per migration: downtime (the source llumlet's pause-to-Committed time, from its
migration event) and its parts (at the source: pause to the last stage handed to the transport;
at the destination: that stage received to the request resumed; the rest: the transport),
stages, blocks and bytes sent, total migration time (started to committed on the source), and
the longest gap between two tokens arriving here after the migrate call (what a
user sees: it also counts decoding stalled on the source while it copies a stage out).

Each migrated request's tokens are checked against the same request left unmigrated ("exact").
With `--gpus` both deployments are `llumdask.clusters.cuda.cuda_cluster`s of sim engines whose KV
lives on the GPU, so stages leave and arrive through `llumdask.engine.cuda_staging`.

    python -m llumdask.benchmarks.migration --out DIR [--lengths 256,...,8192] [--repeats 3] [--gpus 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Client

from llumdask.benchmarks.common import int_list, parser, ratio, report, summarize, times
from llumdask.benchmarks.deploy import process_cluster
from llumdask.api.client import LlumdaskClient

MODES = {"staged": {}, "blocking": {"max-stages": 1}}
BLOCK_SIZE = 16

COLUMNS = (
    ("length", "tokens", "{}"),
    ("mib", "MiB", "{:.0f}"),
    ("staged_downtime_ms", "staged down ms", "{:.1f}"),
    ("blocking_downtime_ms", "blocking down ms", "{:.1f}"),
    ("blocking_over_staged", "block/staged", "{:.1f}"),
    ("staged_source_ms", "staged src ms", "{:.2f}"),
    ("staged_transport_ms", "staged transport ms", "{:.2f}"),
    ("staged_destination_ms", "staged dst ms", "{:.2f}"),
    ("staged_stages", "stages", "{:.0f}"),
    ("staged_total_ms", "staged total ms", "{:.0f}"),
    ("blocking_total_ms", "block total ms", "{:.0f}"),
    ("staged_gap_ms", "staged max gap ms", "{:.0f}"),
    ("blocking_gap_ms", "block max gap ms", "{:.0f}"),
    ("normal_gap_ms", "normal gap ms", "{:.0f}"),
)


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(length)]


async def migrate_once(llum: LlumdaskClient, instances: list[str], prompt: list[int], max_tokens: int,
                       before: int, after: int) -> dict[str, Any]:
    """Stream a request, migrate it after `before` tokens, abort it `after` tokens past the switch."""
    stream = llum.stream(prompt, max_tokens=max_tokens)
    arrivals: list[tuple[float, str | None]] = []
    tokens: list[int] = []
    migration_id = source = destination = None
    migrated_at = 0.0
    async for token in stream:
        tokens.append(token)
        arrivals.append((time.perf_counter(), stream.instance))
        if migration_id is None and len(arrivals) == before:
            source = stream.instance
            destination = next(i for i in instances if i != source)
            migrated_at = time.perf_counter()
            migration_id = await llum.migrate(stream.request_id, to=destination)
        elif migration_id is not None and sum(1 for _, i in arrivals if i == destination) >= after:
            break
    await llum.requester.abort(stream.request_id)
    if migration_id is None:
        raise RuntimeError(f"the request ended after {len(arrivals)} tokens, before it could be migrated")
    event = await _final_event(llum.dask_client, source, migration_id)
    times = np.array([t for t, _ in arrivals])
    gaps = np.diff(times)
    first_after = int(np.searchsorted(times, migrated_at))
    return {
        "kind": event["kind"], "reason": event["reason"], "downtime_ms": event["downtime"] * 1e3,
        "source_ms": event["downtime_source"] * 1e3, "destination_ms": event["downtime_destination"] * 1e3,
        "transport_ms": (event["downtime"] - event["downtime_source"] - event["downtime_destination"]) * 1e3,
        "stages": event["stages"], "blocks": event["blocks"], "bytes": event["bytes"],
        "total_ms": (event["time"] - event["started"]) * 1e3,
        "gap_ms": float(gaps[max(first_after - 1, 0):].max()) * 1e3,
        "normal_gap_ms": float(np.median(gaps[: max(first_after - 1, 1)])) * 1e3,
        "exact": tokens == await tokens_unmigrated(llum, prompt, max_tokens, len(tokens)),
    }


async def tokens_unmigrated(llum: LlumdaskClient, prompt: list[int], max_tokens: int, count: int) -> list[int]:
    """The first `count` tokens of the same request left where it is placed."""
    stream = llum.stream(prompt, max_tokens=max_tokens)
    tokens: list[int] = []
    async for token in stream:
        tokens.append(token)
        if len(tokens) == count:
            break
    await llum.requester.abort(stream.request_id)
    return tokens


async def _final_event(client: Client, source: str, migration_id: str, timeout: float = 60.0) -> dict:
    """The source's committed/aborted event of the migration, with its start time added."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = [e for e in (await client.rpc(source).llumnix_worker_status())["events"]
                  if e["migration_id"] == migration_id]
        final = [e for e in events if e["kind"] in ("committed", "aborted")]
        if final:
            started = next(e["time"] for e in events if e["kind"] == "started")
            return {**final[-1], "started": started}
        await asyncio.sleep(0.05)
    raise TimeoutError(f"migration {migration_id} did not end within {timeout} s")


async def measure(addresses: dict[str, str], lengths: list[int], repeats: int, kv_bytes: int) -> list[dict]:
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, LlumdaskClient] = {}
        instances: dict[str, list[str]] = {}
        for mode, address in addresses.items():
            dask_client = await Client(address, asynchronous=True)
            clients[mode] = LlumdaskClient(dask_client, owns_client=True)
            stack.push_async_callback(clients[mode].close)
            instances[mode] = [row["instance"] for row in await clients[mode].instances()]
        runs: dict[tuple[int, str], list[dict]] = {}
        for length in lengths:
            for rep in range(repeats):
                for mode in MODES:
                    run = await migrate_once(clients[mode], instances[mode], prompt_of(length, rep),
                                             max_tokens=256, before=8, after=8)
                    runs.setdefault((length, mode), []).append(run)
                    print(f"  {length} tokens {mode}: {run['kind']} downtime {run['downtime_ms']:.1f} ms, "
                          f"{run['stages']} stages, max gap {run['gap_ms']:.0f} ms, "
                          f"{'exact' if run['exact'] else 'TOKENS DIFFER'}", flush=True)
    return [_row(length, kv_bytes, {mode: runs[(length, mode)] for mode in MODES}) for length in lengths]


def _row(length: int, kv_bytes: int, by_mode: dict[str, list[dict]]) -> dict[str, Any]:
    row: dict[str, Any] = {"length": length, "mib": length * kv_bytes / (1 << 20)}
    for mode, runs in by_mode.items():
        committed = [r for r in runs if r["kind"] == "committed"]
        for key in ("downtime_ms", "source_ms", "transport_ms", "destination_ms", "total_ms", "gap_ms", "stages"):
            row[f"{mode}_{key}"] = summarize(r[key] for r in committed)["p50"]
        row[f"{mode}_bytes"] = max((r["bytes"] for r in committed), default=None)
        row[f"{mode}_aborted"] = [r["reason"] for r in runs if r["kind"] != "committed"]
        row[f"{mode}_exact"] = all(r["exact"] for r in runs)
        row[f"{mode}_runs"] = runs
    row["normal_gap_ms"] = summarize(r["normal_gap_ms"] for runs in by_mode.values() for r in runs)["p50"]
    row["blocking_over_staged"] = ratio(row["blocking_downtime_ms"], row["staged_downtime_ms"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int_list, default=int_list("256,512,1024,2048,4096,8192"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-bytes-per-token", type=int, default=32 * 1024)
    p.add_argument("--gpus", type=lambda text: [int(g) for g in text.split(",")], default=None,
                   help="run each deployment on these GPUs (dask-cuda), KV on the device, e.g. 0")
    p.add_argument("--instances-per-gpu", type=int, default=None,
                   help="with --gpus: instances on each GPU (default: two instances in all)")
    args = p.parse_args(argv)
    lengths, repeats = ([256, 2048], 1) if args.quick else (sorted(args.lengths), args.repeats)
    total_blocks = -(-(max(lengths) + 256) // BLOCK_SIZE) + 8
    base = {"migration": {"enabled": False},
            "sim-engine": {"kv-bytes-per-token": args.kv_bytes_per_token, "total-blocks": total_blocks}}
    with contextlib.ExitStack() as stack:
        addresses = {
            mode: stack.enter_context(deployment(args, {**base, "migration": {"enabled": False, **extra}}))
            for mode, extra in MODES.items()
        }
        rows = asyncio.run(measure(addresses, lengths, repeats, args.kv_bytes_per_token))
    flat = {mode: ratio(rows[-1][f"{mode}_downtime_ms"], rows[0][f"{mode}_downtime_ms"]) for mode in MODES}
    facts = {"kv_bytes_per_token": args.kv_bytes_per_token, "repeats": repeats,
             "kv_device": "cuda" if args.gpus else "cpu",
             "exact": all(row[f"{mode}_exact"] for row in rows for mode in MODES),
             "length_ratio": lengths[-1] / lengths[0],
             "staged_downtime_longest_over_shortest": flat["staged"],
             "blocking_downtime_longest_over_shortest": flat["blocking"]}
    notes = [f"downtime longest/shortest length ({lengths[-1]}/{lengths[0]} tokens): "
             f"staged {times(flat['staged'])}, blocking {times(flat['blocking'])}",
             "values are medians over repeats of committed migrations; 'max gap' is the longest wait "
             "between two tokens at the client after the migrate call ('normal gap': before it)"]
    report("migration", args.out, rows, COLUMNS, facts, notes)
    return 0


@contextlib.contextmanager
def deployment(args: argparse.Namespace, overrides: dict[str, Any]) -> Iterator[str]:
    """Two instances, each in its worker process: on this machine's CPU, or with `--gpus` a
    `cuda_cluster` of sim engines keeping their KV on the GPU; yields the scheduler address."""
    if not args.gpus:
        with process_cluster(2, overrides) as address:
            yield address
        return
    from llumdask.clusters.cuda import cuda_cluster

    per_gpu = args.instances_per_gpu or max(1, -(-2 // len(args.gpus)))
    cluster = cuda_cluster(args.gpus, {**overrides, "engine": "sim"}, instances_per_gpu=per_gpu,
                           adaptive=False, timeout=300.0, dashboard_address=":0")
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


if __name__ == "__main__":
    raise SystemExit(main())
