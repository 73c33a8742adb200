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

    python -m llumdask.benchmarks.admission [--rate 4] [--seconds 30] [--rounds 2] [--total-blocks 64]
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai

from llumdask.benchmarks.common import parser, ratio, report, summarize
from llumdask.benchmarks.openai_load import Workload
from llumdask.benchmarks.servers import llumdask_serve, serve_process, serving, tree_rss
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.tiny_model import build_tiny_model, default_model_dir

MODEL = "llumdask-tiny-llama"
# mode -> (dispatch.admission-freeness, clients retry after 429)
MODES = {"queueing": (None, False), "admission": (0.0, False), "admission+retry": (0.0, True)}

COLUMNS = (
    ("mode", "mode", "{}"),
    ("offered", "offered", "{}"),
    ("completed", "completed", "{}"),
    ("refused", "429", "{}"),
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
                return Outcome("refused", answered=time.perf_counter() - attempt, attempts=attempts)
            await asyncio.sleep(wait)
            continue
        except openai.APITimeoutError:
            return Outcome("timed_out", attempts=attempts)
        except openai.OpenAIError:
            return Outcome("failed", attempts=attempts)
        return Outcome("completed", ttft=None if first is None else first - start, attempts=attempts)


async def offer(url: str, work: Workload, rate: float, seconds: float, timeout: float, seed: int,
                retry: bool, memory: Memory) -> list[Outcome]:
    """Poisson arrivals at `rate` for `seconds` (seeded: the same for every server), each waited
    for at most `timeout` s (`retry`: a 429 is followed, after its Retry-After, by the same
    request again while the first attempt is less than `timeout` s old); the serving processes'
    memory is watched meanwhile."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=int(rate * seconds * 3) + 10)
    times = np.cumsum(gaps)
    times = times[times < seconds]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    watching = asyncio.create_task(memory.watch(url))
    begin = time.perf_counter()
    try:
        return await asyncio.gather(*(_one(client, work, seed * 100_000 + k, begin + t, retry, timeout)
                                      for k, t in enumerate(times)))
    finally:
        watching.cancel()
        await client.close()


def row(mode: str, outcomes: list[Outcome], seconds: float, slo: float, memory: Memory) -> dict[str, Any]:
    completed = [o for o in outcomes if o.kind == "completed"]
    ttft = summarize((o.ttft for o in completed if o.ttft is not None), 1e3)
    refusals = summarize((o.answered for o in outcomes if o.kind == "refused"), 1e3)
    good = sum(1 for o in completed if o.ttft is not None and o.ttft <= slo)
    counts = {kind: sum(1 for o in outcomes if o.kind == kind) for kind in ("completed", "refused", "timed_out", "failed")}
    return {"mode": mode, "offered": len(outcomes), **counts,
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
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = 10.0, 1
    model_dir = str(build_tiny_model(default_model_dir()))
    work = Workload(MODEL, load_tokenizer(model_dir).vocab_size, args.prompt_tokens, args.output_tokens)
    command = llumdask_serve("--engine", "sim", "--instances", str(args.instances), "--model", model_dir,
                             "--served-model-name", MODEL, "--max-in-flight", "100000")
    by_mode: dict[str, list[Outcome]] = {mode: [] for mode in MODES}
    memory = {mode: Memory() for mode in MODES}
    for round_number in range(args.rounds):
        for mode, (freeness, retry) in MODES.items():
            env = {"DASK_LLUMDASK__SIM_ENGINE__TOTAL_BLOCKS": str(args.total_blocks),
                   "DASK_LLUMDASK__DISPATCH__ADMISSION_FREENESS": "None" if freeness is None else str(freeness)}
            with serving(command, args.logs / "admission" / f"{mode}-{round_number}.log", env=env) as url:
                by_mode[mode] += asyncio.run(offer(url, work, args.rate, args.seconds, args.timeout, round_number,
                                                   retry, memory[mode]))
    seconds = args.seconds * args.rounds
    rows = [row(mode, outcomes, seconds, args.ttft_slo_ms / 1e3, memory[mode]) for mode, outcomes in by_mode.items()]
    queueing, admission, retrying = rows
    facts = {"instances": args.instances, "engine": "sim", "total_blocks": args.total_blocks, "rate": args.rate,
             "seconds": args.seconds, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
             "output_tokens": args.output_tokens, "ttft_slo_ms": args.ttft_slo_ms, "timeout_s": args.timeout,
             "goodput_admission_over_queueing": ratio(admission["goodput_rps"], queueing["goodput_rps"]),
             "goodput_retrying_over_queueing": ratio(retrying["goodput_rps"], queueing["goodput_rps"])}
    notes = [f"goodput (completed with TTFT <= {args.ttft_slo_ms:.0f} ms from the first attempt, per offered second): "
             f"admission / queueing = {facts['goodput_admission_over_queueing']}, admission with retrying clients / "
             f"queueing = {facts['goodput_retrying_over_queueing']}",
             "retrying clients wait the Retry-After of each 429 and send again until served or past --timeout"]
    report("admission", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
