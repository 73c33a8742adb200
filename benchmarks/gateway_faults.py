"""Faults through the gateway under load: an instance killed, the scheduler stopped or restarted,
one of two gateways killed.

A scheduler and `--instances` sim-engine workers (real time) as `dask` processes, two
`llumdask serve --scheduler` gateways in front, and this process as their clients: `--streams`
closed-loop streams per gateway (the official `openai` client, greedy), each completion's text
compared with the text its prompt got before the fault. `--warmup` seconds into the load the
fault fires; the load goes on for `--after` seconds more, then every stream finishes.

- `kill_instance`: SIGKILL a worker process (its nanny starts a fresh one); its requests go on
  elsewhere from the tokens they have.
- `stop_scheduler`: SIGSTOP the scheduler for `--outage` seconds, then SIGCONT: requesters
  bypass it meanwhile and return to it after.
- `restart_scheduler`: SIGKILL the scheduler and start a new one at its address; the workers exit
  with it and fresh ones start (a supervisor's job): requests in flight are resubmitted there.
- `kill_gateway`: SIGKILL the second gateway. Its clients lose their streams (not counted as
  failures); the first gateway's clients must not notice, and the instances end the dead
  gateway's requests (nobody reads them) and free their blocks.

Figures per fault, summed over `--runs` runs (each on a fresh deployment): requests completed with the reference text, failed (the goal is 0 on every
gateway that lives), requests in flight at the fault and how many of them completed exactly, the
longest wait for a token of a stream in flight at the fault or sent after it, and KV blocks not
free once the instances are idle (goal 0).

    python -m llumdask.benchmarks.gateway_faults [--faults ...] [--instances 3] [--streams 8]
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
from distributed import Client

from llumdask.benchmarks.common import parser, report, summarize
from llumdask.benchmarks.deploy import Deployment, deployment
from llumdask.benchmarks.servers import llumdask_serve, serve_process, serving
from llumdask.benchmarks.soak import MODEL, Stream, idle_accounts, request_for, stream_one
from llumdask.clusters.instances import wait_for_instances

FAULTS = ("kill_instance", "stop_scheduler", "restart_scheduler", "kill_gateway")
# Each instance's KV cache: small enough that load moves requests between instances.
TOTAL_BLOCKS = 512
PROMPTS = 32


@dataclass
class Served:
    """One completion as its client saw it, and which gateway served it."""

    gateway: int
    prompt: int
    stream: Stream


async def reference(client: openai.AsyncOpenAI, prompts: list[tuple[list[int], int]]) -> list[str]:
    """Each prompt's text before any fault (greedy and exact: placement and migration do not change it)."""
    seen = await asyncio.gather(*(stream_one(client, prompt, max_tokens) for prompt, max_tokens in prompts))
    failed = [s.error for s in seen if s.error]
    if failed:
        raise RuntimeError(f"the reference run failed: {failed[0]}")
    return [s.text for s in seen]


async def load(clients: list[openai.AsyncOpenAI], prompts: list[tuple[list[int], int]], streams: int,
               until: float, cut: Callable[[int], bool], seed: int) -> list[Served]:
    """`streams` closed-loop streams per gateway until `until`; a gateway's streams stop once `cut`
    says it is gone."""
    served: list[Served] = []

    async def user(gateway: int, rng: np.random.Generator) -> None:
        while time.perf_counter() < until and not cut(gateway):
            number = int(rng.integers(len(prompts)))
            seen = await stream_one(clients[gateway], *prompts[number])
            served.append(Served(gateway, number, seen))

    rngs = np.random.default_rng(seed).spawn(streams * len(clients))
    await asyncio.gather(*(user(k % len(clients), rng) for k, rng in enumerate(rngs)))
    return served


@dataclass
class Fault:
    """Fires one fault on a running deployment; `fired_at` is when (perf_counter)."""

    kind: str
    running: Deployment
    dask: Client
    gateway_pid: int
    instances: int
    outage: float
    fired_at: float | None = None
    # restart_scheduler: seconds from the fault until every instance serves again.
    back_s: float | None = None

    def gone(self, gateway: int) -> bool:
        return self.kind == "kill_gateway" and gateway == 1 and self.fired_at is not None

    async def fire(self) -> None:
        if self.kind == "kill_instance":
            workers = sorted((await self.dask.scheduler.identity())["workers"])
            pids = await self.dask.run(os.getpid, workers=workers[:1])
            self.fired_at = time.perf_counter()
            os.kill(pids[workers[0]], signal.SIGKILL)
        elif self.kind == "stop_scheduler":
            scheduler = self.running.procs[0]
            self.fired_at = time.perf_counter()
            os.kill(scheduler.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(self.outage)
            finally:
                os.kill(scheduler.pid, signal.SIGCONT)
        elif self.kind == "restart_scheduler":
            self.fired_at = time.perf_counter()
            self.running.restart_scheduler()
            for _ in range(self.instances):
                self.running.add_worker()
            await asyncio.to_thread(_wait_ready, self.running.address, self.instances)
            self.back_s = time.perf_counter() - self.fired_at
        else:
            self.fired_at = time.perf_counter()
            os.kill(self.gateway_pid, signal.SIGKILL)


def _wait_ready(address: str, n: int) -> None:
    with Client(address, timeout=60) as dask:
        wait_for_instances(dask, n, timeout=120)


async def run_fault(kind: str, urls: list[str], running: Deployment, args: Any, seed: int) -> dict[str, Any]:
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) for url in urls]
    rng = np.random.default_rng(seed)
    prompts = [request_for(rng) for _ in range(PROMPTS)]
    try:
        expected = await reference(clients[0], prompts)
        async with Client(running.address, asynchronous=True) as dask:
            fault = Fault(kind, running, dask, serve_process(int(urls[1].rsplit(":", 1)[1])).pid, args.instances, args.outage)
            start = time.perf_counter()

            async def fire_later() -> None:
                await asyncio.sleep(args.warmup)
                await fault.fire()

            served, _ = await asyncio.gather(
                load(clients, prompts, args.streams, start + args.warmup + args.after, fault.gone, seed + 1),
                fire_later())
        # A fresh client: the one above may have outlived its scheduler.
        async with Client(running.address, asynchronous=True) as dask:
            statuses = await idle_accounts(dask, timeout=120)
    finally:
        for client in clients:
            await client.close()
    return summarize_fault(kind, served, expected, fault.fired_at, statuses) | {"instances_back_s": fault.back_s}


def summarize_fault(kind: str, served: list[Served], expected: list[str], fired_at: float | None,
                    statuses: list[dict]) -> dict[str, Any]:
    assert fired_at is not None
    # The killed gateway's clients lose what was in flight there: counted apart, not as failures.
    def was_cut(s: Served) -> bool:
        return kind == "kill_gateway" and s.gateway == 1 and s.stream.ended >= fired_at

    cut = [s for s in served if was_cut(s)]
    counted = [s for s in served if not was_cut(s)]
    exact = [s for s in counted if not s.stream.error and s.stream.text == expected[s.prompt]]
    failed = [s for s in counted if s.stream.error]
    wrong = [s for s in counted if not s.stream.error and s.stream.text != expected[s.prompt]]
    in_flight = [s for s in counted if s.stream.sent < fired_at < s.stream.ended]
    touched = [s for s in counted if s.stream.ended > fired_at]
    waits = summarize((s.stream.longest_wait for s in touched), 1e3)
    leaked = sum(s["total_blocks"] - s["free_blocks"] + s["reserved_blocks"] for s in statuses)
    return {"fault": kind, "requests": len(counted), "exact": len(exact), "failed": len(failed), "wrong_text": len(wrong),
            "in_flight_at_fault": len(in_flight),
            "in_flight_exact": sum(1 for s in in_flight if s in exact),
            "cut_with_gateway": len(cut), "longest_wait_p50_ms": waits["p50"], "longest_wait_max_ms": waits["max"],
            "leaked_blocks": leaked, "instances_after": len(statuses),
            "errors": sorted({f"gateway {s.gateway}: {s.stream.error}" for s in failed})[:5]}


def one_fault(kind: str, run: int, args: Any) -> dict[str, Any]:
    """A fresh deployment and two gateways for one run of one fault."""
    overrides = {"engine": "sim", "sim-engine": {"total-blocks": TOTAL_BLOCKS}}
    logs = args.logs / "gateway_faults" / f"{kind}-{run}"
    with deployment(args.instances, overrides, timeout=300) as running, ExitStack() as gateways:
        urls = [gateways.enter_context(serving(llumdask_serve("--scheduler", running.address, "--served-model-name",
                                                              MODEL), logs / f"gateway-{k}.log", env=running.env))
                for k in range(2)]
        return asyncio.run(run_fault(kind, urls, running, args, args.seed + run))


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One fault's runs as one row: counts summed, the worst wait and recovery, the median p50."""
    row = {key: sum(r[key] for r in runs) for key in SUMMED}
    waits = [r["longest_wait_p50_ms"] for r in runs if r["longest_wait_p50_ms"] is not None]
    backs = [r["instances_back_s"] for r in runs if r["instances_back_s"] is not None]
    return {"fault": runs[0]["fault"], "runs": len(runs), **row,
            "longest_wait_p50_ms": float(np.median(waits)) if waits else None,
            "longest_wait_max_ms": max((r["longest_wait_max_ms"] or 0.0) for r in runs),
            "instances_after_min": min(r["instances_after"] for r in runs),
            "instances_back_max_s": max(backs, default=None),
            "errors": sorted({e for r in runs for e in r["errors"]})[:5]}


SUMMED = ("requests", "exact", "failed", "wrong_text", "in_flight_at_fault", "in_flight_exact", "cut_with_gateway",
          "leaked_blocks")


COLUMNS = (("fault", "fault", "{}"), ("runs", "runs", "{}"), ("requests", "requests", "{}"), ("exact", "exact", "{}"),
           ("failed", "failed", "{}"), ("in_flight_at_fault", "in flight at fault", "{}"),
           ("in_flight_exact", "of them exact", "{}"), ("cut_with_gateway", "cut with the gateway", "{}"),
           ("longest_wait_p50_ms", "longest wait p50 ms", "{:.0f}"),
           ("longest_wait_max_ms", "longest wait max ms", "{:.0f}"), ("leaked_blocks", "leaked blocks", "{}"),
           ("instances_after_min", "instances after", "{}"), ("instances_back_max_s", "instances back s", "{:.1f}"))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--streams", type=int, default=8, help="closed-loop streams per gateway")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the fault")
    p.add_argument("--after", type=float, default=15.0, help="seconds of load after the fault")
    p.add_argument("--outage", type=float, default=4.0, help="seconds the scheduler stays stopped")
    p.add_argument("--runs", type=int, default=3, help="runs per fault, each on a fresh deployment")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.warmup, args.after, args.runs = 4, 3.0, 6.0, 1
    started = time.perf_counter()
    rows = []
    for kind in args.faults:
        rows.append(combine([one_fault(kind, run, args) for run in range(args.runs)]))
        print(f"  {kind}: {rows[-1]['exact']}/{rows[-1]['requests']} exact, {rows[-1]['failed']} failed", flush=True)
    goals = all(r["exact"] == r["requests"] and r["in_flight_exact"] == r["in_flight_at_fault"] > 0
                and not r["leaked_blocks"] and r["instances_after_min"] == args.instances for r in rows)
    facts = {"instances": args.instances, "gateways": 2, "streams_per_gateway": args.streams, "runs_per_fault": args.runs,
             "engine": "sim (real time)",
             "warmup_s": args.warmup, "after_s": args.after, "outage_s": args.outage,
             "wall_s": round(time.perf_counter() - started), "goals_met": goals}
    notes = [f"{r['fault']}: {e}" for r in rows for e in r["errors"]]
    report("gateway_faults" + ("_quick" if args.quick else ""), args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
