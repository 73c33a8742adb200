"""End-to-end tokens/s through the token-stream path: 4 sim instances, many concurrent streams.

A separate scheduler process and 4 sim-engine worker processes (real time: each engine step
takes its modelled duration), the default llumnix policy with migration on; this process is the
notebook client (`LlumdaskClient` over an asynchronous Dask client) running a closed loop of
`concurrency` users, each streaming requests one after another. Tokens travel from the owning
worker straight to this process's listener.

The same workload is also run on 4 in-process sim engines on a virtual clock (no Dask, no
sleeping, the users split evenly over the engines): the tokens/s the engines' latency model
allows. measured/modelled says how much of that the real processes and comms deliver.

    python -m llumdask.benchmarks.stream --out DIR [--concurrency 16,64,256] [--prompt 64] [--max-tokens 128]
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator

from distributed import Client

from llumdask.benchmarks.common import int_list, parser, ratio, report, summarize
from llumdask.benchmarks.deploy import process_cluster
from llumdask.api.client import LlumdaskClient
from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.sim import SimEngine
from llumdask.request import Request, SamplingParams

COLUMNS = (
    ("concurrency", "streams", "{}"),
    ("requests", "requests", "{}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("modelled_tokens_per_s", "modelled tok/s", "{:.0f}"),
    ("measured_over_modelled", "meas/model", "{:.2f}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_mean_ms", "TPOT mean ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("migrations", "migrations", "{}"),
)


@dataclass(frozen=True)
class Workload:
    concurrency: int
    requests: int
    prompt_len: int
    max_tokens: int

    def prompt(self, i: int) -> list[int]:
        return [(i * 7919 + k * 104729) % 30000 + 1 for k in range(self.prompt_len)]


@dataclass(frozen=True)
class Timing:
    submitted: float
    first: float
    last: float
    tokens: int


async def run_streams(llum: LlumdaskClient, work: Workload) -> tuple[list[Timing], float]:
    """The closed loop; returns each request's timing and the wall time of the whole level."""
    numbers = iter(range(work.requests))
    timings: list[Timing] = []

    async def user() -> None:
        for i in numbers:
            submitted = time.perf_counter()
            first = None
            count = 0
            async for _ in llum.stream(work.prompt(i), max_tokens=work.max_tokens):
                count += 1
                if first is None:
                    first = time.perf_counter()
            if count != work.max_tokens or first is None:
                raise RuntimeError(f"request {i} streamed {count} of {work.max_tokens} tokens")
            timings.append(Timing(submitted, first, time.perf_counter(), count))

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(work.concurrency)))
    return timings, time.perf_counter() - start


def modelled_tokens_per_s(config: LlumdaskConfig, work: Workload, instances: int) -> float:
    """Tokens/s of the same closed loop on `instances` engines with a virtual clock."""
    makespans = []
    for k in range(instances):
        users = len(range(k, work.concurrency, instances))
        share = len(range(k, work.requests, instances))
        now = [0.0]
        engine = SimEngine.from_config(config, clock=lambda now=now: now[0], instance_id=f"model-{k}")
        numbers = itertools.count()

        def add(engine: SimEngine = engine, numbers: Iterator[int] = numbers) -> None:
            i = next(numbers)
            engine.add_request(Request(f"r{i}", work.prompt(i), SamplingParams(max_tokens=work.max_tokens)))

        for _ in range(min(users, share)):
            add()
        issued = min(users, share)
        while engine.has_work():
            result = engine.step()
            now[0] += result.duration
            for _ in result.finished:
                if issued < share:
                    add()
                    issued += 1
        makespans.append(now[0])
    return work.requests * work.max_tokens / max(makespans)


async def measure(address: str, config: LlumdaskConfig, levels: list[Workload], instances: int) -> list[dict]:
    rows = []
    async with Client(address, asynchronous=True) as dask_client:
        llum = LlumdaskClient(dask_client)
        try:
            await run_streams(llum, Workload(4, 4, levels[0].prompt_len, 8))  # warm-up
            for work in levels:
                before = (await llum.instances()).migrations.get("committed", 0)
                timings, wall = await run_streams(llum, work)
                migrations = (await llum.instances()).migrations.get("committed", 0) - before
                rows.append(_row(work, timings, wall, modelled_tokens_per_s(config, work, instances), migrations))
                print(f"  {work.concurrency} streams: {rows[-1]['tokens_per_s']:.0f} tokens/s "
                      f"(modelled {rows[-1]['modelled_tokens_per_s']:.0f})", flush=True)
        finally:
            await llum.close()
    return rows


def _row(work: Workload, timings: list[Timing], wall: float, modelled: float, migrations: int) -> dict[str, Any]:
    ttft = summarize((t.first - t.submitted for t in timings), 1e3)
    tpot = summarize(((t.last - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1), 1e3)
    tokens_per_s = sum(t.tokens for t in timings) / wall
    return {"concurrency": work.concurrency, "requests": work.requests, "prompt_len": work.prompt_len,
            "max_tokens": work.max_tokens, "wall_s": wall, "tokens_per_s": tokens_per_s,
            "modelled_tokens_per_s": modelled, "measured_over_modelled": ratio(tokens_per_s, modelled),
            "ttft_mean_ms": ttft["mean"], "ttft_p99_ms": ttft["p99"], "tpot_mean_ms": tpot["mean"],
            "tpot_p99_ms": tpot["p99"], "ttft_ms": ttft, "tpot_ms": tpot, "migrations": migrations}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int_list, default=int_list("16,64,256"))
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    args = p.parse_args(argv)
    concurrency = [8] if args.quick else args.concurrency
    max_tokens = 32 if args.quick else args.max_tokens
    levels = [Workload(c, max(2 * c, 32), args.prompt, max_tokens) for c in concurrency]
    overrides: dict[str, Any] = {}
    config = load_config(overrides)
    with process_cluster(args.instances, overrides) as address:
        rows = asyncio.run(measure(address, config, levels, args.instances))
    facts = {"instances": args.instances, "prompt_len": args.prompt, "max_tokens": max_tokens,
             "profile": config.sim_engine.profile, "policy": config.dispatch.policy}
    notes = ["closed loop: each stream submits its next request when the last one finished; "
             "TPOT = (last token - first token) / (tokens - 1) per request, at the client",
             "modelled: the same loop on in-process engines with a virtual clock (the latency model's bound)"]
    report("stream", args.out, rows, COLUMNS, facts, notes)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
