"""Past capacity, admission by load against queueing: `llumdask serve` with and without
`dispatch.admission-freeness`, the same open-loop arrivals offered to each, side by side.

Two sim instances with little KV memory each (`--total-blocks`) are offered Poisson arrivals at a
rate well above what they serve (streamed /v1/completions through the official `openai` client,
token-id prompts, fixed output lengths). Without admission every request queues on an instance and
waits; with it (0: refuse what every instance would only queue) the gateway answers 429 at once,
and the clients either take the refusal (`admission`) or do what well-behaved clients do: wait
the Retry-After the answer names and send the request again, until it is served or their
--timeout has passed since the first attempt (`admission+retry`). Per mode: requests completed,
refused (429, for good), timed out or failed, attempts per request, the time to first token of
the completed ones counted from the first attempt, and goodput: completed requests whose first
token came within --ttft-slo-ms of the first attempt, per second of offered load. The modes
alternate (`--rounds`), each round offering all the same arrival times and prompts.

`--tenants` runs the per-key rate limits instead: two API keys share the cluster, one offering
--rate (past capacity), the other --quiet-rate (well within it), everything queueing (no admission
by load), once without limits and once with `--key-rpm` requests per minute for every key (the
gateway's `requests-per-minute`). Rows per mode and key: the quiet key's TTFT is what the limits
protect, the busy key's refusals (`rate_limit_exceeded`, OpenAI's rate-limit error) what they cost.

    python -m llumdask.benchmarks.admission [--rate 4] [--seconds 30] [--rounds 2] [--total-blocks 64]
    python -m llumdask.benchmarks.admission --tenants [--quiet-rate 0.25] [--key-rpm 20] [--seconds 60]
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai

from llumdask.benchmarks.common import parser, ratio, report, summarize
from llumdask.benchmarks.openai_load import Workload
from llumdask.benchmarks.servers import llumdask_serve, serve_process, serving, tree_rss
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.sim.workload import arrivals_within
from llumdask.tiny_model import build_tiny_model, default_model_dir

MODEL = "llumdask-tiny-llama"


@dataclass(frozen=True)
class Mode:
    # dispatch.admission-freeness (None: everything queues)
    freeness: float | None
    # Clients wait a 429's Retry-After and send the request again.
    retry: bool = False
    # Every key limited to --key-rpm requests per minute.
    key_limits: bool = False


MODES = {"queueing": Mode(None), "admission": Mode(0.0), "admission+retry": Mode(0.0, retry=True)}
TENANT_MODES = {"two keys, no limits": Mode(None), "two keys, per-key limits": Mode(None, key_limits=True)}
BUSY, QUIET = "busy", "quiet"

COLUMNS = (
    ("mode", "mode", "{}"),
    ("key", "key", "{}"),
    ("offered", "offered", "{}"),
    ("completed", "completed", "{}"),
    ("refused", "429", "{}"),
    ("rate_limited", "of which rate_limit_exceeded", "{}"),
    ("attempts_mean", "attempts", "{:.2f}"),
    ("timed_out", "timed out", "{}"),
    ("failed", "failed", "{}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("refusal_ms_p99", "429 in ms p99", "{:.0f}"),
    ("goodput_rps", "goodput req/s", "{:.2f}"),
    ("rss_peak_mib", "RSS peak MiB", "{:.0f}"),
    ("processes_lost", "processes lost", "{}"),
)
# Seconds between samples of the serving processes' memory.
MEMORY_PERIOD = 0.5


@dataclass
class Memory:
    """The serving processes' resident memory over a run: its peak, and processes that died."""

    peak: int = 0
    processes_lost: int = 0

    async def watch(self, url: str) -> None:
        """Sample until cancelled; a process count that falls below the first is a process lost."""
        root = serve_process(int(url.rsplit(":", 1)[1]))
        first = None
        while True:
            rss, count = tree_rss(root)
            first = count if first is None else first
            self.peak = max(self.peak, rss)
            self.processes_lost = max(self.processes_lost, first - count)
            await asyncio.sleep(MEMORY_PERIOD)


@dataclass(frozen=True)
class Outcome:
    kind: str  # completed, refused, timed_out, failed
    ttft: float | None = None  # seconds from the first attempt, completed requests
    answered: float | None = None  # seconds until the (last) 429, refused requests
    attempts: int = 1
    code: str | None = None  # the (last) 429's error code


@dataclass(frozen=True)
class Tenant:
    """One API key's open-loop arrivals."""

    key: str
    rate: float


async def _one(client: openai.AsyncOpenAI, work: Workload, number: int, at: float, retry: bool,
               timeout: float) -> Outcome:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    start = time.perf_counter()
    attempts = 0
    while True:
        attempts += 1
        attempt = time.perf_counter()
        first = None
        try:
            stream = await client.completions.create(
                model=work.model, prompt=work.prompt(number), max_tokens=work.output_tokens, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and first is None:
                    first = time.perf_counter()
        except openai.RateLimitError as exc:
            wait = float(exc.response.headers.get("retry-after", "1"))
            if not retry or time.perf_counter() + wait - start >= timeout:
                return Outcome("refused", answered=time.perf_counter() - attempt, attempts=attempts, code=exc.code)
            await asyncio.sleep(wait)
            continue
        except openai.APITimeoutError:
            return Outcome("timed_out", attempts=attempts)
        except openai.OpenAIError:
            return Outcome("failed", attempts=attempts)
        return Outcome("completed", ttft=None if first is None else first - start, attempts=attempts)


async def offer(url: str, work: Workload, tenants: Sequence[Tenant], seconds: float, timeout: float, seed: int,
                retry: bool, memory: Memory) -> dict[str, list[Outcome]]:
    """Each tenant's Poisson arrivals at its rate for `seconds` (seeded: the same for every
    server), each waited for at most `timeout` s (`retry`: a 429 is followed, after its
    Retry-After, by the same request again while the first attempt is less than `timeout` s
    old); the serving processes' memory is watched meanwhile. Outcomes by key."""
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=t.key, max_retries=0, timeout=timeout) for t in tenants]
    watching = asyncio.create_task(memory.watch(url))
    begin = time.perf_counter()
    try:
        outcomes = await asyncio.gather(*(
            asyncio.gather(*(_one(client, work, seed * 100_000 + i * 10_000 + k, begin + at, retry, timeout)
                             for k, at in enumerate(arrivals_within(np.random.default_rng(seed + 1000 * i), tenant.rate, seconds))))
            for i, (tenant, client) in enumerate(zip(tenants, clients))))
        return {tenant.key: list(got) for tenant, got in zip(tenants, outcomes)}
    finally:
        watching.cancel()
        for client in clients:
            await client.close()


def row(mode: str, key: str, outcomes: list[Outcome], seconds: float, slo: float, memory: Memory) -> dict[str, Any]:
    completed = [o for o in outcomes if o.kind == "completed"]
    ttft = summarize((o.ttft for o in completed if o.ttft is not None), 1e3)
    refusals = summarize((o.answered for o in outcomes if o.kind == "refused"), 1e3)
    good = sum(1 for o in completed if o.ttft is not None and o.ttft <= slo)
    counts = {kind: sum(1 for o in outcomes if o.kind == kind) for kind in ("completed", "refused", "timed_out", "failed")}
    return {"mode": mode, "key": key, "offered": len(outcomes), **counts,
            "rate_limited": sum(1 for o in outcomes if o.code == "rate_limit_exceeded"),
            "attempts_mean": sum(o.attempts for o in outcomes) / max(1, len(outcomes)),
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "refusal_ms_p99": refusals["p99"], "goodput_rps": good / seconds,
            "rss_peak_mib": memory.peak / 2**20, "processes_lost": memory.processes_lost}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=4.0, help="offered requests/s (default %(default)s)")
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals last this long (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two servers (default %(default)s)")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--total-blocks", type=int, default=64, help="KV blocks of 16 tokens per sim instance")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="a completed request counts as goodput within it")
    p.add_argument("--timeout", type=float, default=60.0, help="a client gives up on a request after this many s")
    p.add_argument("--tenants", action="store_true", help="per-key rate limits: a busy key and a quiet one")
    p.add_argument("--quiet-rate", type=float, default=0.25, help="the quiet key's requests/s (--tenants)")
    p.add_argument("--key-rpm", type=int, default=20, help="requests per minute per key, when limited (--tenants)")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = 10.0, 1
    model_dir = str(build_tiny_model(default_model_dir()))
    work = Workload(MODEL, load_tokenizer(model_dir).vocab_size, args.prompt_tokens, args.output_tokens)
    command = llumdask_serve("--engine", "sim", "--instances", str(args.instances), "--model", model_dir,
                             "--served-model-name", MODEL, "--max-in-flight", "100000")
    modes = TENANT_MODES if args.tenants else MODES
    tenants = [Tenant(BUSY, args.rate), Tenant(QUIET, args.quiet_rate)] if args.tenants else [Tenant("unused", args.rate)]
    by_mode: dict[str, dict[str, list[Outcome]]] = {mode: {t.key: [] for t in tenants} for mode in modes}
    memory = {mode: Memory() for mode in modes}
    for round_number in range(args.rounds):
        for name, mode in modes.items():
            env = {"DASK_LLUMDASK__SIM_ENGINE__TOTAL_BLOCKS": str(args.total_blocks),
                   "DASK_LLUMDASK__DISPATCH__ADMISSION_FREENESS": str(mode.freeness)}
            if args.tenants:
                env["DASK_LLUMDASK__GATEWAY__API_KEYS"] = repr([t.key for t in tenants])
            if mode.key_limits:
                env["DASK_LLUMDASK__GATEWAY__REQUESTS_PER_MINUTE"] = str(args.key_rpm)
            log = args.logs / "admission" / f"{re.sub(r'[^a-z0-9+]+', '-', name)}-{round_number}.log"
            with serving(command, log, env=env) as url:
                got = asyncio.run(offer(url, work, tenants, args.seconds, args.timeout, round_number, mode.retry,
                                        memory[name]))
            for key, outcomes in got.items():
                by_mode[name][key] += outcomes
    seconds = args.seconds * args.rounds
    slo = args.ttft_slo_ms / 1e3
    rows = [row(name, key, outcomes, seconds, slo, memory[name])
            for name, keys in by_mode.items() for key, outcomes in keys.items()]
    facts = {"instances": args.instances, "engine": "sim", "total_blocks": args.total_blocks, "rate": args.rate,
             "seconds": args.seconds, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
             "output_tokens": args.output_tokens, "ttft_slo_ms": args.ttft_slo_ms, "timeout_s": args.timeout}
    if args.tenants:
        free, limited = (r for r in rows if r["key"] == QUIET)
        facts |= {"quiet_rate": args.quiet_rate, "key_rpm": args.key_rpm,
                  "quiet_ttft_p99_limits_over_none": ratio(limited["ttft_p99_ms"], free["ttft_p99_ms"])}
        notes = [f"the quiet key's TTFT P99 with per-key limits / without = {facts['quiet_ttft_p99_limits_over_none']}",
                 f"every key may send {args.key_rpm} requests per minute when limited; no admission by load in either mode"]
        report("admission_tenants", args.out, rows, COLUMNS, facts, notes)
        return 0
    queueing, admission, retrying = rows
    facts |= {"goodput_admission_over_queueing": ratio(admission["goodput_rps"], queueing["goodput_rps"]),
              "goodput_retrying_over_queueing": ratio(retrying["goodput_rps"], queueing["goodput_rps"])}
    notes = [f"goodput (completed with TTFT <= {args.ttft_slo_ms:.0f} ms from the first attempt, per offered second): "
             f"admission / queueing = {facts['goodput_admission_over_queueing']}, admission with retrying clients / "
             f"queueing = {facts['goodput_retrying_over_queueing']}",
             "retrying clients wait the Retry-After of each 429 and send again until served or past --timeout"]
    report("admission", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
