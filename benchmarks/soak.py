"""Soak: the gateway over real Dask processes at about 80% of measured capacity for a long while.

A scheduler and `--instances` sim-engine workers (real time: each step takes the latency
profile's time) as `dask` processes, `llumdask serve --scheduler` in front, and this process as
the clients (the official `openai` client, streaming) and the operator:

1. Capacity. Closed loop, `--probe-streams` streams for `--probe-seconds`: the requests per
   second the cluster completes when saturated. They start together right after the gateway
   comes up, so their streams are checked as the soak's are (an early-start stall would show).
2. Soak. Poisson arrivals at `--load` x that rate for `--seconds`, prompts and outputs of varied
   lengths, every request streamed to the end. A third of the way in one worker joins (scale out);
   two thirds in the operator drains the oldest instance, whose requests migrate away, and
   retires its worker once empty (scale in). Migration stays on throughout, and every
   `--migrate-every` seconds the operator moves a request in flight to another instance.
3. Afterwards, once every instance is idle: each one's block accounting.

Figures, for the soak and the probe apart: requests failed (the goal is 0; a failure is an error
status, an exception, or a token count other than asked), streams that stalled (no token for
`--stall-bound` seconds, first token included; goal 0), KV blocks not free on idle instances
(goal 0), migrations committed, and the resident memory growth of the scheduler, the gateway and
the workers that ran throughout, from a quarter of the run to its end (goal < 10%: growth after
warm-up is a leak).

    python -m llumdask.benchmarks.soak [--seconds 600] [--instances 3] [--load 0.8] [--out DIR]
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai
import psutil
from distributed import Client

from llumdask.api.client import LlumdaskClient, MigrationNotStarted
from llumdask.benchmarks.common import parser, report, summarize
from llumdask.benchmarks.deploy import Deployment, deployment
from llumdask.benchmarks.servers import llumdask_serve, serve_process, serving
from llumdask.clusters.instances import worker_statuses

MODEL = "soak"
# Token ids from 3 up (the tiny tokenizer's 0-2 are special), within its vocabulary.
VOCAB = (3, 500)
PROMPT_TOKENS = (32, 768)
OUTPUT_TOKENS = (16, 256)
# Each instance's KV cache: small enough that load moves requests between instances.
TOTAL_BLOCKS = 512
RSS_GOAL = 0.10
SAMPLE_PERIOD = 1.0


@dataclass
class Stream:
    """One request as its client saw it."""

    sent: float
    error: str = ""
    longest_wait: float = 0.0  # the longest time without a token, the first one's wait included
    ended: float = 0.0
    text: str = ""


@dataclass
class Watch:
    """Resident memory samples (time, bytes) per process name."""

    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, processes: dict[str, psutil.Process], now: float) -> None:
        for name, process in processes.items():
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue  # it left (a retired worker), not yet reaped
                rss = process.memory_info().rss
            except psutil.Error:
                continue  # it left
            self.samples.setdefault(name, []).append((now, rss))

    def span(self, start: float, end: float) -> dict[str, tuple[int, int]]:
        """Per process present from `start` to `end`: its RSS then and at the end, bytes."""
        result = {}
        for name, series in self.samples.items():
            before = [rss for t, rss in series if t <= start]
            after = [rss for t, rss in series if t >= end]
            if before and after:
                result[name] = (before[-1], after[0])
        return result


def request_for(rng: np.random.Generator) -> tuple[list[int], int]:
    prompt = rng.integers(*VOCAB, size=int(rng.integers(*PROMPT_TOKENS))).tolist()
    return prompt, int(rng.integers(*OUTPUT_TOKENS))


async def stream_one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int,
                     in_flight: set[str] | None = None) -> Stream:
    """Stream one completion to its end; what went wrong, if anything, and the longest wait. Its
    request id is in `in_flight` while it streams."""
    sent = time.perf_counter()
    seen = Stream(sent)
    last = sent
    tokens = None
    request_id = None
    pieces: list[str] = []
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if in_flight is not None and request_id is None:
                request_id = chunk.id.removeprefix("cmpl-")
                in_flight.add(request_id)
            if chunk.choices:
                seen.longest_wait = max(seen.longest_wait, now - last)
                last = now
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if tokens != max_tokens:
            seen.error = f"{tokens} tokens streamed, {max_tokens} asked"
    except openai.OpenAIError as exc:
        # The transport's own error says whether the connection was refused, reset or cut mid-body.
        cause = f" ({type(exc.__cause__).__name__}: {str(exc.__cause__)[:120]})" if exc.__cause__ else ""
        stage = f" after {len(pieces)} chunks" if pieces else " before the first chunk"
        seen.error = f"{type(exc).__name__}: {str(exc)[:200]}{cause}{stage}"
    finally:
        if in_flight is not None:
            in_flight.discard(request_id)
        seen.ended = time.perf_counter()
        seen.text = "".join(pieces)
    return seen


async def capacity(client: openai.AsyncOpenAI, streams: int, seconds: float, seed: int) -> tuple[float, list[Stream]]:
    """Requests per second completed by `streams` closed-loop streams over `seconds`, and every
    stream they ran."""
    rng = np.random.default_rng(seed)
    end = time.perf_counter() + seconds
    seen: list[Stream] = []

    async def user() -> None:
        while time.perf_counter() < end:
            seen.append(await stream_one(client, *request_for(rng)))

    started = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(streams)))
    done = sum(1 for s in seen if not s.error and s.ended <= end)
    return done / (time.perf_counter() - started), seen


async def poisson(client: openai.AsyncOpenAI, rate: float, seconds: float, seed: int,
                  at: dict[float, Callable[[], Awaitable[Any]]], in_flight: set[str]) -> list[Stream]:
    """Open-loop arrivals at `rate` for `seconds`; each operator action of `at` runs at its time
    (seconds from the start) beside the load."""
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    tasks: list[asyncio.Task] = []
    actions = [asyncio.create_task(_after(start + offset, action)) for offset, action in at.items()]
    next_at = start
    while (next_at := next_at + rng.exponential(1 / rate)) < start + seconds:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(stream_one(client, *request_for(rng), in_flight)))
    streams = list(await asyncio.gather(*tasks))
    await asyncio.gather(*actions)
    return streams


async def _after(moment: float, action: Callable[[], Awaitable[Any]]) -> Any:
    await asyncio.sleep(max(0.0, moment - time.perf_counter()))
    return await action()


@dataclass
class Operator:
    """Scale out by a worker, scale in by draining one and retiring it; times of each."""

    running: Deployment
    dask: Client
    llum: LlumdaskClient
    timeout: float
    log: dict[str, Any] = field(default_factory=lambda: {"forced_migrations": 0, "forced_not_started": 0})

    async def instances(self) -> list[dict]:
        return list((await self.llum.instances()).rows)

    async def scale_out(self) -> None:
        before = {row["instance"] for row in await self.instances()}
        started = time.perf_counter()
        self.running.add_worker()
        await self._until(lambda rows: len({r["instance"] for r in rows if r["ready"]} - before) == 1,
                          "the new worker to serve")
        self.log["scale_out_s"] = time.perf_counter() - started

    async def scale_in(self) -> None:
        victim = (await self.instances())[0]["instance"]  # the oldest (the table is in registration order)
        started = time.perf_counter()
        await self.llum.drain(victim)
        await self._until(lambda rows: any(r["instance"] == victim and r["num_running"] == 0 and r["num_waiting"] == 0
                                           and r["num_migrating_out"] == 0 for r in rows), "the drained instance to empty")
        self.log["drain_s"] = time.perf_counter() - started
        await self.dask.retire_workers([victim], close_workers=True)
        await self._until(lambda rows: victim not in {r["instance"] for r in rows}, "the drained worker to leave")
        self.log.update(scale_in_s=time.perf_counter() - started, drained=victim)

    async def migrate_now_and_then(self, in_flight: set[str], period: float, seed: int) -> None:
        """Every `period` seconds, move a request in flight to another instance (until cancelled):
        the ready instances in a random order until one takes it (the first may be where it runs)."""
        rng = np.random.default_rng(seed)
        while True:
            await asyncio.sleep(period)
            ready = [r["instance"] for r in await self.instances() if r["ready"] and r["state"] != "terminating"]
            if not in_flight or len(ready) < 2:
                continue
            request_id = sorted(in_flight)[int(rng.integers(len(in_flight)))]
            for to in rng.permutation(ready):
                try:
                    await self.llum.migrate(request_id, to=str(to))
                except MigrationNotStarted:  # it runs there already, or it just finished
                    continue
                self.log["forced_migrations"] += 1
                break
            else:
                self.log["forced_not_started"] += 1

    async def _until(self, done: Callable[[list[dict]], bool], what: str) -> None:
        deadline = time.perf_counter() + self.timeout
        while not done(await self.instances()):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"waited {self.timeout} s for {what}")
            await asyncio.sleep(0.2)


async def idle_accounts(dask: Client, timeout: float) -> list[dict]:
    """Every instance's status once none has work or a migration in flight."""
    deadline = time.perf_counter() + timeout
    while True:
        statuses = list((await worker_statuses(dask)).values())
        if all(not s["has_work"] and not s["migrations_in_flight"] for s in statuses):
            return statuses
        if time.perf_counter() > deadline:
            raise TimeoutError(f"instances still busy after {timeout} s")
        await asyncio.sleep(0.5)


def processes(running: Deployment, gateway_port: int) -> dict[str, psutil.Process]:
    """The scheduler, the workers started with the deployment, and the gateway, by name."""
    named = {"scheduler": psutil.Process(running.procs[0].pid)}
    named |= {f"worker-{i}": psutil.Process(p.pid) for i, p in enumerate(running.procs[1:])}
    named["gateway"] = serve_process(gateway_port)
    return named


async def soak(url: str, running: Deployment, args: Any) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    watch = Watch()
    named = processes(running, int(url.rsplit(":", 1)[1]))
    async with Client(running.address, asynchronous=True) as dask:
        llum = LlumdaskClient(dask)
        operator = Operator(running, dask, llum, timeout=args.seconds)
        try:
            measured, probe = await capacity(client, args.probe_streams, args.probe_seconds, args.seed)
            rate = args.load * measured
            before = (await llum.instances()).migrations.get("committed", 0)

            async def sampling() -> None:
                while True:
                    watch.sample(named, time.perf_counter())
                    await asyncio.sleep(SAMPLE_PERIOD)

            in_flight: set[str] = set()
            background = [asyncio.create_task(sampling()),
                          asyncio.create_task(operator.migrate_now_and_then(in_flight, args.migrate_every, args.seed))]
            started = time.perf_counter()
            streams = await poisson(client, rate, args.seconds, args.seed + 1,
                                    {args.seconds / 3: operator.scale_out, 2 * args.seconds / 3: operator.scale_in},
                                    in_flight)
            ended = time.perf_counter()
            background[1].cancel()
            statuses = await idle_accounts(dask, timeout=120)
            watch.sample(named, time.perf_counter())
            background[0].cancel()
            migrations = (await llum.instances()).migrations.get("committed", 0) - before
        finally:
            await llum.close()
            await client.close()
    rss = watch.span(started + (ended - started) / 4, ended)
    return {"capacity_rps": measured, "rate": rate, "probe": probe, "streams": streams, "statuses": statuses,
            "migrations": migrations, "rss": rss, "operator": operator.log}


COLUMNS = (("process", "process", "{}"), ("rss_start_mib", "RSS at 1/4, MiB", "{:.1f}"),
           ("rss_end_mib", "RSS at end, MiB", "{:.1f}"), ("growth", "growth", "{:+.1%}"))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0, help="length of the soak (default %(default)s)")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of measured capacity")
    p.add_argument("--probe-streams", type=int, default=48)
    p.add_argument("--probe-seconds", type=float, default=20.0)
    p.add_argument("--migrate-every", type=float, default=5.0,
                   help="seconds between operator-forced migrations of a request in flight")
    p.add_argument("--stall-bound", type=float, default=10.0, help="seconds without a token that count as a stall")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.probe_seconds = 30.0, 10.0
    overrides = {"engine": "sim", "sim-engine": {"total-blocks": TOTAL_BLOCKS}}
    logs = args.logs / "soak"
    with deployment(args.instances, overrides, timeout=300) as running:
        with serving(llumdask_serve("--scheduler", running.address, "--served-model-name", MODEL),
                     logs / "gateway.log", env=running.env) as url:
            result = asyncio.run(soak(url, running, args))
    streams: list[Stream] = result["streams"]
    probe: list[Stream] = result["probe"]
    failed = [s for s in streams if s.error]
    stalled = [s for s in streams if s.longest_wait > args.stall_bound]
    probe_failed = [s for s in probe if s.error]
    probe_stalled = [s for s in probe if s.longest_wait > args.stall_bound]
    leaked = {s["instance"]: s["total_blocks"] - s["free_blocks"] for s in result["statuses"]
              if s["free_blocks"] != s["total_blocks"] or s["reserved_blocks"] or s["integrity_error"]}
    growth = {name: end / start - 1 for name, (start, end) in result["rss"].items()}
    rows = [{"process": name, "rss_start_mib": start / 2**20, "rss_end_mib": end / 2**20, "growth": growth[name]}
            for name, (start, end) in sorted(result["rss"].items())]
    waits = summarize((s.longest_wait for s in streams), 1e3)
    facts = {"seconds": args.seconds, "instances": args.instances, "load": args.load,
             "capacity_rps": result["capacity_rps"], "rate_rps": result["rate"], "requests": len(streams),
             "failed": len(failed), "stalled": len(stalled), "stall_bound_s": args.stall_bound,
             "longest_wait_p99_ms": waits["p99"], "longest_wait_max_ms": waits["max"],
             "probe_requests": len(probe), "probe_failed": len(probe_failed), "probe_stalled": len(probe_stalled),
             "probe_longest_wait_max_ms": max((s.longest_wait for s in probe), default=0.0) * 1e3,
             "leaked_blocks": sum(leaked.values()), "instances_not_clean": sorted(leaked),
             "migrations": result["migrations"], **result["operator"],
             "rss_growth_max": max(growth.values(), default=None), "rss_goal": RSS_GOAL,
             "goals_met": not (failed or stalled or probe_failed or probe_stalled or leaked)
             and all(g < RSS_GOAL for g in growth.values())}
    notes = sorted({s.error for s in failed + probe_failed})[:10]
    report("soak" + ("_quick" if args.quick else ""), args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
