"""Dispatch round-trip overhead: the scheduler's `llumnix_dispatch` RPC vs a bare Dask RPC.

A separate scheduler process with the llumdask plugin and two sim instances; this process is the
client (as the gateway is). Both calls go through the same pooled scheduler comm with the same
argument dict: `llumnix_dispatch` (the global scheduler's decision: freeness over the instances
with pending demand) and Dask's built-in `echo` handler, which returns its argument and does
nothing else. Sequential calls (latency) alternate in chunks; then `--concurrency` callers at
once (throughput). The dispatched requests are never submitted: the scheduler counts each as
pending demand on its instance, as it would for a burst that no load report has absorbed yet.

    python -m llumdask.benchmarks.dispatch --out DIR [--calls 2000] [--concurrency 32]
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Awaitable, Callable

from distributed import Client

from llumdask.benchmarks.common import parser, ratio, report, summarize, times
from llumdask.benchmarks.deploy import process_cluster

COLUMNS = (
    ("call", "call", "{}"),
    ("p50_us", "p50 us", "{:.0f}"),
    ("p99_us", "p99 us", "{:.0f}"),
    ("mean_us", "mean us", "{:.0f}"),
    ("p50_over_echo", "p50/echo", "{:.2f}"),
    ("calls_per_s", "calls/s at C", "{:.0f}"),
    ("throughput_over_echo", "thr/echo", "{:.2f}"),
)

CHUNK = 50


def _callers(client: Client) -> dict[str, Callable[[int], Awaitable[Any]]]:
    def args(i: int) -> dict[str, Any]:
        return {"request_id": f"bench-{i}", "num_prompt_tokens": 128, "max_tokens": 128, "execution_priority": 0}

    async def dispatch(i: int) -> Any:
        reply = await client.scheduler.llumnix_dispatch(**args(i))
        if reply is None or "instance" not in reply:  # no plugin, or a refusal
            raise RuntimeError(f"dispatch failed: {reply}")
        return reply

    async def echo(i: int) -> Any:
        return await client.scheduler.echo(data=args(i))

    return {"llumnix_dispatch": dispatch, "echo": echo}


async def measure(address: str, calls: int, concurrency: int) -> list[dict[str, Any]]:
    async with Client(address, asynchronous=True) as client:
        callers = _callers(client)
        numbers = itertools.count()
        for call in callers.values():  # warm the comm pool and both code paths
            await asyncio.gather(*(call(next(numbers)) for _ in range(concurrency)))
        latencies: dict[str, list[float]] = {name: [] for name in callers}
        for _ in range(max(calls // CHUNK, 1)):
            for name, call in callers.items():
                for _ in range(CHUNK):
                    start = time.perf_counter()
                    await call(next(numbers))
                    latencies[name].append(time.perf_counter() - start)
        throughput: dict[str, list[float]] = {name: [] for name in callers}
        per_caller = max(calls // concurrency, 1)
        for _ in range(3):
            for name, call in callers.items():
                async def caller(call: Callable[[int], Awaitable[Any]] = call) -> None:
                    for _ in range(per_caller):
                        await call(next(numbers))

                start = time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(concurrency)))
                throughput[name].append(per_caller * concurrency / (time.perf_counter() - start))
    rows = []
    for name in callers:
        lat = summarize(latencies[name], 1e6)
        rows.append({"call": name, "p50_us": lat["p50"], "p99_us": lat["p99"], "mean_us": lat["mean"],
                     "latency_us": lat, "calls_per_s": summarize(throughput[name])["p50"],
                     "throughput_runs": throughput[name]})
    echo = rows[-1]
    for row in rows:
        row["p50_over_echo"] = ratio(row["p50_us"], echo["p50_us"])
        row["throughput_over_echo"] = ratio(row["calls_per_s"], echo["calls_per_s"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="sequential calls of each kind")
    p.add_argument("--concurrency", type=int, default=32, help="callers at once for the throughput part")
    p.add_argument("--instances", type=int, default=2)
    args = p.parse_args(argv)
    calls = 200 if args.quick else args.calls
    with process_cluster(args.instances, {"migration": {"enabled": False}}) as address:
        rows = asyncio.run(measure(address, calls, args.concurrency))
    dispatch, echo = rows
    facts = {"calls": calls, "concurrency": args.concurrency, "instances": args.instances,
             "dispatch_minus_echo_p50_us": dispatch["p50_us"] - echo["p50_us"]}
    notes = [f"dispatch adds {facts['dispatch_minus_echo_p50_us']:.0f} us at p50 over a bare scheduler RPC "
             f"({times(dispatch['p50_over_echo'])}); throughput with {args.concurrency} callers "
             f"{times(dispatch['throughput_over_echo'])} of echo's"]
    report("dispatch", args.out, rows, COLUMNS, facts, notes)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
