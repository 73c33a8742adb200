"""Simulator vs real engine: one trace on two real vLLM-CPU instances and in the simulator.

Steps, all in one run:

1. Profile. `llumdask profile measure` measures the vLLM CPU engine and fits the simulator's
   latency profile. Conditions are the cluster's: on this 2-core machine each instance gets one
   core (a Dask worker's torch runs one thread: OMP_NUM_THREADS=1), so two measuring processes
   run at once, one thread each, each keeping the other core busy the way the second instance
   does; the profile is the mean of their two fitted profiles.
2. Trace. A seeded S-S workload (the paper's short power-law lengths, capped to the model's
   context) with Poisson arrivals, written as a CSV trace file; or, with --trace multi-turn,
   conversations whose turns resend their history (`llumdask.sim.workload.conversations`),
   which puts the prefix cache to work on both sides.
3. Real. A scheduler process and two `dask worker` processes hosting vLLM instances
   (benchmarks/deploy.py). This process is the notebook client. First it sends probes, rounds of
   requests sent at once on an idle cluster: a 128-token prompt per instance, four of them per
   instance, a 1,536-token prompt per instance; the same rounds again after the trace, so that the
   calibration below is of the machine the trace ran on, not of its state before (this machine's
   speed drifts between minutes). Then it replays the trace as the simulator does:
   each request that follows none at its arrival time, whatever happened before (open loop); a
   conversation's next turn its think time after the previous answer, its prompt the previous
   prompt and the tokens the instance generated, then tokens of its own (closed loop).
4. Simulated, twice, on the same trace file and configuration. "engine": with the measured
   profile alone (what the simulator knows from `profile measure`). "served": with the costs of
   serving that the probes measured (never the trace; `ServingCosts`): TPOT beyond the profile's
   decode step, as a fixed part per step and a part per sequence, and how much longer a prompt
   token takes to prefill, go into the profile's coefficients (the engine inside a worker shares
   its process and the cores with the serving machinery); TTFT beyond that profile's prefill
   (client -> scheduler -> worker, and the first token back) becomes the simulator's
   `dispatch_delay`.
5. The table: mean and P99 TTFT and TPOT, real vs simulated, and their relative errors; the
   preemptions and the prefix-cache hit rate (cached prompt tokens over prompt tokens: the
   instances' own counts at the client, the sim engine's in the simulator) beside it.

Where latency is measured: at the client, as tokens arrive, because that is what a user of the
cluster sees and what the simulator's numbers are read as. TTFT = first token - the moment the
request was sent (the simulator: first token - arrival, queueing included); TPOT = (last token
- first token) / (tokens - 1) per request, the simulator's decode latency (llumdask.sim.metrics).
Engine timestamps would leave out dispatch and token delivery, which a user waits for too.

Assumed: the client, the scheduler and the workers' event loops share the two cores with the
engines; what that costs beyond the probes' conditions (more streams at once, requests arriving
mid-step) shows in the real numbers only. The model is the offline tiny Llama (steps of 2-3 ms,
so the serving path weighs as much as the model) or, with --shape, a larger random Llama (8x768:
decode steps of about 25 ms on one core, as a 7B model's on one GPU).

    python -m llumdask.benchmarks.sim_validation --out DIR [--quick] [--shape 8x768 --rate 1.5] [--requests 300]
        [--trace multi-turn]
        [--rate 8] [--kv-tokens 16384] [--policy llumnix] [--profile PROFILE.json] [--probe-rounds 3]
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import dask
import numpy as np
from distributed import Client

from llumdask.benchmarks.common import bench_model, model_shape, parser, report
from llumdask.benchmarks.deploy import config_env, process_cluster
from llumdask.api.client import LlumdaskClient
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.config import load_config
from llumdask.engine.latency import DecodeCost, LatencyProfile, PrefillCost, load_profile
from llumdask.benchmarks.profile_fit import profile_json
from llumdask.llumlet import MigrationEventKind
from llumdask.request import RequestStatus
from llumdask.sim.cluster import SimulatorSettings
from llumdask.sim.metrics import mean_and_p99, migration_outcomes, prefix_hit_rate
from llumdask.sim.presets import Preset, get_preset
from llumdask.sim.run import make_spec, run_cluster
from llumdask.sim.workload import TraceRequest, make_workload, prompt_tokens, write_trace

GOAL = 0.15
HIT_RATE_GOAL = 0.10
INSTANCES = 2
# Requests/s that load two tiny-model instances moderately (a few sequences each, no queue).
TINY_RATE = 8.0
# The instances' engine, spelt out so that the simulated engine gets the same: bfloat16 (what
# vLLM's CPU backend picks for these float32 checkpoints), a KV cache of --kv-tokens tokens
# (plus the one block vLLM keeps aside), vLLM's CPU limits on sequences and tokens per step.
DTYPE_BYTES = 2
MAX_MODEL_LEN = 4096
TRACE_MAX_LEN = 2048
BLOCK_SIZE = 128  # vLLM's CPU backend always uses 128-token blocks
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 4096
# The profile's grid: prompts of 32-2048 tokens (the traces' longest), decode batches of 1-8
# (llumdask.benchmarks.profile_measure), measured with a KV cache that holds the grid (the cache's
# size does not change a step's time).
GRID = "long"
MEASURE_KV_TOKENS = 16384
# Each instance's KV cache unless --kv-tokens says otherwise: no memory pressure on the trace.
DEFAULT_KV_TOKENS = 16384
METRICS = (("ttft", "mean"), ("ttft", "p99"), ("tpot", "mean"), ("tpot", "p99"))
# Probe rounds per kind (PROBES, below) and output tokens per probe request.
PROBE_ROUNDS = 3
PROBE_TOKENS = 64

COLUMNS = (
    ("metric", "metric", "{}"),
    ("real_ms", "real ms", "{:.2f}"),
    ("engine_ms", "sim: engine ms", "{:.2f}"),
    ("engine_error", "error", "{:+.1%}"),
    ("served_ms", "sim: served ms", "{:.2f}"),
    ("served_error", "error", "{:+.1%}"),
    ("served_within_goal", f"within {GOAL:.0%}", "{}"),
)


@dataclass(frozen=True)
class Observed:
    """One request as the client saw it (perf_counter seconds)."""

    sent: float
    late: float  # how long after its trace arrival time it was sent
    first: float
    last: float
    tokens: int
    instance: str | None = None  # the instance that sent the last tokens
    prompt: int = 0
    cached: int | None = None  # prompt tokens the instance found in its prefix cache

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True)
class Latencies:
    """Seconds: per-request TTFT and TPOT (None where a request has a single token); and the
    prompt tokens each found in a prefix cache (None where its engine did not say), which tells
    apart a TTFT that differs by placement from one that differs by speed."""

    ttft: tuple[float, ...]
    tpot: tuple[float | None, ...]
    cached: tuple[int | None, ...]

    def stats(self) -> dict[str, float]:
        """ttft_mean, ttft_p99, tpot_mean, tpot_p99, as llumdask.sim.metrics computes them."""
        result = {}
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot)):
            result[f"{name}_mean"], result[f"{name}_p99"] = mean_and_p99(v for v in values if v is not None)
        return result


def error_rows(real: dict[str, float], simulated: dict[str, dict[str, float]],
               goal: float = GOAL) -> list[dict[str, Any]]:
    """One row per metric: real milliseconds, and for each simulated variant its milliseconds,
    its relative error (simulated - real) / real and whether that is within the goal."""
    rows = []
    for name, stat in METRICS:
        key = f"{name}_{stat}"
        row: dict[str, Any] = {"metric": f"{name.upper()} {stat}", "key": key, "real_ms": real[key] * 1e3}
        for variant, stats in simulated.items():
            error = stats[key] / real[key] - 1
            row |= {f"{variant}_ms": stats[key] * 1e3, f"{variant}_error": error,
                    f"{variant}_within_goal": abs(error) <= goal}
        rows.append(row)
    return rows


def mean_profile(profiles: Sequence[LatencyProfile], name: str, note: str) -> LatencyProfile:
    """The coefficient-wise mean of profiles of one engine measured at once (the mean of their
    step-time predictions); their derivations follow `note` in the result's."""
    first = profiles[0]
    if any((p.capacity_tokens, p.block_size, p.model_kv_bytes_per_token) !=
           (first.capacity_tokens, first.block_size, first.model_kv_bytes_per_token) for p in profiles):
        raise ValueError("the profiles describe different engines (capacity, block size or KV size differ)")

    def mean(part: str, field: str) -> float:
        return float(np.mean([getattr(getattr(p, part), field) for p in profiles]))

    prefill = PrefillCost(*(mean("prefill", f) for f in ("base_s", "per_token_s", "per_token_squared_s")))
    decode = DecodeCost(*(mean("decode", f) for f in ("base_s", "per_seq_s", "per_context_token_s")))
    derivation = "\n".join([note, *(f"Profile {i}: {p.derivation}" for i, p in enumerate(profiles))])
    return LatencyProfile(name, first.capacity_tokens, first.block_size, first.model_kv_bytes_per_token,
                          prefill, decode, derivation)


@dataclass(frozen=True)
class Probe:
    """Requests of `prompt` tokens, `per_instance` on every instance at once, on an idle cluster."""

    prompt: int
    per_instance: int


# What the probes measure: decode steps of one sequence and of several (lone, batched), and how
# prefill grows with the prompt (lone, long). The long prompt is where a trace's first-token tail
# is (multi-turn prompts reach 2,048 tokens): calibrated at 512 tokens, the served profile came
# out fast by 13-18% on prompts of 512 uncached tokens or more in runs that missed the TTFT P99.
PROBES = {"lone": Probe(128, 1), "batched": Probe(128, 4), "long": Probe(1536, 1)}


@dataclass(frozen=True)
class ServingCosts:
    """What serving adds to the engine's own steps as `profile measure` times them."""

    # Arrival to first token beyond the prefill step, seconds: dispatch, hand-over to the
    # instance, the first token's way back (the simulator's dispatch_delay).
    request_path: float
    # Seconds per decode step beyond the profile's (the worker's bookkeeping and token hand-off,
    # the engine sharing its process and the cores): a fixed part and a part per sequence.
    per_step: float
    per_seq: float
    # How much longer each prompt token takes to prefill than in the profile (a ratio).
    prefill_scale: float

    def served(self, profile: LatencyProfile) -> LatencyProfile:
        """The profile of an instance as served: every step pays per_step once (both bases carry
        it, and a mixed step pays the smaller base only as part of the larger), each decoding
        sequence per_seq, each prompt token prefill_scale times the profile's cost."""
        p, d = profile.prefill, profile.decode
        note = (f"Serving costs measured on the real cluster with probe requests: {self.per_step * 1e3:.3f} ms per "
                f"step added to prefill.base_s and decode.base_s, {self.per_seq * 1e3:.3f} ms per sequence to "
                f"decode.per_seq_s, prefill per-token terms x {self.prefill_scale:.3f}.")
        return replace(
            profile, name=f"{profile.name}-served", derivation=f"{note}\n{profile.derivation}",
            prefill=PrefillCost(p.base_s + self.per_step, p.per_token_s * self.prefill_scale,
                                p.per_token_squared_s * self.prefill_scale),
            decode=replace(d, base_s=d.base_s + self.per_step, per_seq_s=d.per_seq_s + self.per_seq),
        )


def serving_costs(observed: dict[str, Sequence[Observed]], profile: LatencyProfile) -> ServingCosts:
    """Medians of each probe's TTFT and TPOT (PROBES names them) against the profile.

    Decode: TPOT beyond the profile's decode step of the same batch (at the probes' mean
    context), lone and batched, as a line per_step + per_seq x batch. Prefill: the TTFT
    difference of long and lone prompts over the profile's (dispatch and the step's fixed cost
    cancel out) is prefill_scale. The request path is the lone TTFT beyond the served prefill
    step. A cost below zero (the profile slower than the cluster) counts as none.
    """
    def median(name: str, metric: str) -> float:
        return float(np.median([getattr(o, metric) for o in observed[name]]))

    batches, beyond = [], []
    for name in ("lone", "batched"):
        probe = PROBES[name]
        context = probe.prompt + float(np.mean([o.tokens for o in observed[name]])) / 2
        batches.append(probe.per_instance)
        beyond.append(median(name, "tpot") - profile.decode_time(probe.per_instance, round(probe.per_instance * context)))
    per_seq = max(0.0, (beyond[1] - beyond[0]) / (batches[1] - batches[0]))
    per_step = max(0.0, float(np.mean(np.array(beyond) - per_seq * np.array(batches))))
    short, long = PROBES["lone"].prompt, PROBES["long"].prompt
    modelled = profile.prefill_time([long]) - profile.prefill_time([short])
    scale = max(0.0, (median("long", "ttft") - median("lone", "ttft")) / modelled)
    costs = ServingCosts(0.0, per_step, per_seq, scale)
    path = median("lone", "ttft") - costs.served(profile).prefill_time([short])
    return replace(costs, request_path=max(0.0, path))


# ------------------------------------------------------------------ set-up
def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer and KV head, in bfloat16, from the checkpoint's config.json."""
    config = json.loads((Path(model) / "config.json").read_text())
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * DTYPE_BYTES


def cluster_overrides(model: str, preset: Preset, kv_tokens: int) -> dict[str, Any]:
    """The llumdask configuration of the real cluster; the simulation reads the same one."""
    limits = {"max-num-seqs": MAX_NUM_SEQS, "max-num-batched-tokens": MAX_NUM_BATCHED_TOKENS}
    kv_bytes = (kv_tokens + BLOCK_SIZE) * kv_bytes_per_token(model)
    return {
        "engine": "vllm",
        "vllm-engine": {"model": model, "dtype": "bfloat16", "max-model-len": min(MAX_MODEL_LEN, kv_tokens),
                        "kv-cache-memory-bytes": kv_bytes,
                        "engine-args": {k.replace("-", "_"): v for k, v in limits.items()}},
        "sim-engine": {"total-blocks": kv_tokens // BLOCK_SIZE, **limits},
        "dispatch": {"policy": preset.dispatch},
        "migration": {"enabled": preset.migration},
    }


def worker_environ() -> dict[str, str]:
    """What a Dask nanny sets in its worker's environment before starting it
    (`distributed.nanny.pre-spawn-environ`; the process's own variables win, as in the nanny):
    one thread for OpenMP, and malloc trimming at 64 KiB, which alone makes a vLLM CPU prefill
    step about 1.8x as long."""
    pre_spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
    return {k: os.environ.get(k, str(v)) for k, v in pre_spawn.items() if v is not None}


def measure_profile(overrides: dict[str, Any], directory: Path) -> Path:
    """Two `llumdask profile measure` processes at once in a worker's environment; the path of
    their mean profile."""
    nanny = worker_environ()
    env = {**config_env(directory / "config", overrides), **nanny}
    command = [sys.executable, "-c", "import sys; from llumdask.api.profile_cli import main; sys.exit(main())",
               "measure", "--grid", GRID]
    outputs = [directory / f"measured-{i}.json" for i in range(INSTANCES)]
    logs = [(directory / f"measure-{i}.log").open("w") for i in range(INSTANCES)]
    procs = [subprocess.Popen([*command, "--out", str(out), "--seed", str(i)], env=env, stdout=log,
                              stderr=subprocess.STDOUT) for i, (out, log) in enumerate(zip(outputs, logs))]
    for proc, log in zip(procs, logs):
        proc.wait()
        log.close()
        if proc.returncode:
            raise RuntimeError(f"profile measurement failed; see {log.name}")
    note = (f"Mean of {INSTANCES} profiles measured at the same time by {INSTANCES} `llumdask profile measure "
            f"--grid {GRID}` processes on this {INSTANCES}-core machine, each in the environment a Dask nanny "
            f"gives its worker ({', '.join(f'{k}={v}' for k, v in nanny.items())}): "
            "one core per instance, as the cluster's workers run them.")
    profile = mean_profile([load_profile(p) for p in outputs], "sim-validation", note)
    path = directory / "sim-validation.json"
    path.write_text(profile_json(profile))
    return path


def make_trace(workload: str, requests: int, rate: float, seed: int) -> list[TraceRequest]:
    """Requests of up to TRACE_MAX_LEN tokens (a conversation stays within it): a run's length
    stays bounded."""
    return make_workload(workload, rate=rate, num_requests=requests, seed=seed, max_seq_len=TRACE_MAX_LEN)


def prompt_of(key: Sequence[int], length: int, vocab: int) -> list[int]:
    """Random token ids seeded by `key`: no prompt shares a prefix-cache block with another."""
    return np.random.default_rng(list(key)).integers(1, vocab, size=length).tolist()


def turn_prompt(trace: Sequence[TraceRequest], index: int, history: Sequence[int], vocab: int) -> list[int]:
    """The trace's `index`-th prompt as the simulator builds it (`prompt_tokens`: the
    conversation so far, then tokens of its own), its own tokens folded into the model's
    vocabulary. The history is what the instance generated, in the vocabulary already."""
    own = prompt_tokens(trace[index], index, history)[len(history):]
    return [*history, *(1 + t % (vocab - 1) for t in own)]


# ------------------------------------------------------------------ real cluster
async def send(llum: LlumdaskClient, at: float, prompt: list[int], output_len: int) -> tuple[Observed, list[int]]:
    """At `at` (perf_counter), stream one request to the end; what the client saw, and the tokens."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sent = time.perf_counter()
    first, tokens = None, []
    stream = llum.stream(prompt, max_tokens=output_len, ignore_eos=True)
    async for token in stream:
        tokens.append(token)
        if first is None:
            first = time.perf_counter()
    if first is None or len(tokens) != output_len:
        raise RuntimeError(f"a request streamed {len(tokens)} of {output_len} tokens")
    return Observed(sent, sent - at, first, time.perf_counter(), len(tokens), stream.instance, len(prompt),
                    stream.cached_tokens), tokens


async def send_round(llum: LlumdaskClient, prompts: Sequence[list[int]], max_tokens: int,
                     settle: float) -> list[Observed]:
    """After `settle` seconds (for every instance to report itself idle: dispatch spreads a
    round only on fresh load reports), all at once, to the end."""
    await asyncio.sleep(settle)
    start = time.perf_counter()
    return [o for o, _ in await asyncio.gather(*(send(llum, start, p, max_tokens) for p in prompts))]


async def replay_trace(llum: LlumdaskClient, start: float, trace: Sequence[TraceRequest], vocab: int) -> list[Observed]:
    """The trace as the simulator replays it: a request that follows none is sent at its arrival
    time whatever happened before (open loop); a conversation's next turn `think` seconds after
    the previous answer's last token, its prompt that answer's prompt and tokens, then its own."""
    followers = {r.after: i for i, r in enumerate(trace) if r.after is not None}
    observed: dict[int, Observed] = {}

    async def conversation(index: int | None) -> None:
        at, history = start + trace[index].arrival, []
        while index is not None:
            prompt = turn_prompt(trace, index, history, vocab)
            observed[index], answer = await send(llum, at, prompt, trace[index].output_len)
            history = prompt + answer
            index = followers.get(index)
            at = time.perf_counter() + (trace[index].think if index is not None else 0.0)

    await asyncio.gather(*(conversation(i) for i, r in enumerate(trace) if r.after is None))
    return [observed[i] for i in range(len(trace))]


@dataclass(frozen=True)
class RealRun:
    # The probes before and after the trace, each name's in sending order.
    before: dict[str, list[Observed]]
    after: dict[str, list[Observed]]
    trace: list[Observed]
    migrations: int
    preemptions: int


def probe_rounds(seed: int, vocab: int, count: int) -> list[tuple[str, list[list[int]]]]:
    """A warm-up round, then `count` rounds of every probe, alternating, so that the machine's
    other load weighs on every probe alike: (probe name, prompts sent at once)."""
    keys = itertools.count()
    rounds = [("warm-up", PROBES["lone"])] + [(name, probe) for _ in range(count) for name, probe in PROBES.items()]
    return [(name, [prompt_of((seed, 1, next(keys)), probe.prompt, vocab) for _ in range(probe.per_instance * INSTANCES)])
            for name, probe in rounds]


async def replay_real(address: str, trace: Sequence[TraceRequest], vocab: int,
                      rounds: Sequence[tuple[str, list[list[int]]]], settle: float) -> RealRun:
    """The probe rounds, the trace from half a second on, then the probe rounds again (no warm-up)."""
    async with Client(address, asynchronous=True) as dask_client:
        llum = LlumdaskClient(dask_client)
        try:
            before = await send_rounds(llum, rounds, settle)
            counts_before = await llum.instances()
            start = time.perf_counter() + 0.5
            observed = await replay_trace(llum, start, trace, vocab)
            await asyncio.sleep(settle)  # the last load reports, with the last preemptions
            counts_after = await llum.instances()
            after = await send_rounds(llum, [(name, prompts) for name, prompts in rounds if name != "warm-up"], settle)
        finally:
            await llum.close()
        migrations = counts_after.migrations.get("committed", 0) - counts_before.migrations.get("committed", 0)
        preemptions = _preemptions(counts_after) - _preemptions(counts_before)
    return RealRun(before, after, list(observed), migrations, preemptions)


async def send_rounds(llum: LlumdaskClient, rounds: Sequence[tuple[str, list[list[int]]]],
                      settle: float) -> dict[str, list[Observed]]:
    """The rounds one after another: what each probe name observed."""
    probes: dict[str, list[Observed]] = defaultdict(list)
    for name, round_prompts in rounds:
        probes[name] += await send_round(llum, round_prompts, PROBE_TOKENS, settle)
    return dict(probes)


def probe_drift(real: RealRun) -> dict[str, float]:
    """After / before the trace, medians of each probe's TTFT and TPOT: how far the machine moved."""
    return {f"{name}_{metric}": float(np.median([getattr(o, metric) for o in real.after[name]])
                                     / np.median([getattr(o, metric) for o in real.before[name]]))
            for name in PROBES for metric in ("ttft", "tpot")}


def _preemptions(table) -> int:
    return sum(row["num_preemptions"] for row in table.rows)


def real_latencies(observed: Sequence[Observed]) -> Latencies:
    return Latencies(tuple(o.ttft for o in observed), tuple(o.tpot for o in observed), tuple(o.cached for o in observed))


def real_hit_rate(observed: Sequence[Observed]) -> float:
    """Share of prompt tokens the instances found cached (`prefix_hit_rate`'s rule, at the client)."""
    reported = [o for o in observed if o.cached is not None]
    prompts = sum(o.prompt for o in reported)
    return sum(o.cached for o in reported) / prompts if prompts else float("nan")


# ------------------------------------------------------------------ simulator
@dataclass(frozen=True)
class Simulated:
    latencies: Latencies
    migrations: int
    preemptions: int
    hit_rate: float


def simulate(trace: list[TraceRequest], profile: Path, preset: str, overrides: dict[str, Any],
             settings: SimulatorSettings) -> Simulated:
    """The trace through the simulated cluster; per-request latencies in trace order (the
    simulator names the i-th request of a workload req-i), the migrations, the preemptions and
    the prefix-cache hit rate."""
    spec = make_spec(preset, INSTANCES, profile=str(profile), base=load_config(overrides), settings=settings)
    outcome, _ = run_cluster(spec, trace)
    done = sorted((r for r in outcome.requests if r.status is RequestStatus.FINISHED),
                  key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    if len(done) != len(outcome.requests) or outcome.rejected:
        raise RuntimeError(f"the simulation finished {len(done)} of {len(outcome.requests)} requests")
    committed = migration_outcomes(outcome.migrations).values()
    return Simulated(Latencies(tuple(r.timing.prefill_latency for r in done),
                               tuple(r.timing.decode_latency(r.num_output_tokens) for r in done),
                               tuple(r.timing.cached_tokens for r in done)),
                     sum(e.kind is MigrationEventKind.COMMITTED for e in committed),
                     sum(r.timing.preemptions for r in done), prefix_hit_rate(done))


def write_requests(path: Path, trace: Sequence[TraceRequest], real: Latencies, simulated: dict[str, Latencies]) -> Path:
    """Every request's lengths, its TTFT and TPOT in milliseconds and its prompt tokens found
    cached, real and simulated (CSV)."""
    columns = {"real": real} | simulated
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", "arrival_s", "input_len", "output_len",
                         *(f"{name}_{metric}" for name in columns for metric in ("ttft_ms", "tpot_ms", "cached"))])
        for i, request in enumerate(trace):
            writer.writerow([i, f"{request.arrival:.4f}", request.input_len, request.output_len,
                             *(v for lat in columns.values()
                               for v in (_ms(lat.ttft[i]), _ms(lat.tpot[i]), "" if lat.cached[i] is None else lat.cached[i]))])
    return path


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


# ------------------------------------------------------------------ command
def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shape", type=model_shape, help="a larger random Llama, LAYERSxHIDDEN (default: the offline tiny model)")
    p.add_argument("--trace", default="S-S", choices=("S-S", "multi-turn"),
                   help="the workload: short independent requests, or conversations resending their history "
                        "(closed loop, the prefix cache at work)")
    p.add_argument("--requests", type=int, default=300, help="requests in the trace")
    p.add_argument("--rate", type=float, help=f"mean arrival rate, requests/s (Poisson); default {TINY_RATE} for the "
                   "tiny model, required with --shape")
    p.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS,
                   help="KV cache of each instance, tokens (a multiple of 128; default %(default)s)")
    p.add_argument("--policy", default="llumnix", help="scheduling preset of both clusters (llumdask.sim.presets)")
    p.add_argument("--profile", type=Path, help="a profile measured before, instead of measuring one now")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-rounds", type=int, default=PROBE_ROUNDS,
                   help="rounds of every probe before the trace and after it (default %(default)s)")
    args = p.parse_args(argv)
    if args.probe_rounds < 1:
        p.error(f"--probe-rounds must be at least 1, got {args.probe_rounds}")
    if args.kv_tokens < TRACE_MAX_LEN or args.kv_tokens % BLOCK_SIZE:  # every request must fit
        p.error(f"--kv-tokens must be a multiple of {BLOCK_SIZE} and hold the longest request ({TRACE_MAX_LEN} tokens)")
    if args.shape and args.rate is None:
        p.error("--shape needs --rate: a moderate load depends on the model's step times")
    rate = args.rate or TINY_RATE
    requests = 40 if args.quick else args.requests
    preset = get_preset(args.policy)
    work = args.logs / "sim_validation"
    work.mkdir(parents=True, exist_ok=True)
    served = bench_model(args.shape)
    model = served.path
    overrides = cluster_overrides(model, preset, args.kv_tokens)
    started = time.perf_counter()

    profile_path = args.profile or measure_profile(cluster_overrides(model, preset, MEASURE_KV_TOKENS), work)
    profile = load_profile(profile_path)
    load = {"load_after_profile": os.getloadavg()[0]}
    trace = make_trace(args.trace, requests, rate, args.seed)
    # A trace file replays independent requests only (it has no column for a turn's predecessor).
    trace_file = write_trace(work / "trace.csv", trace) if all(r.after is None for r in trace) else None
    vocab = load_tokenizer(model).vocab_size
    with process_cluster(INSTANCES, overrides, timeout=300) as address:
        settle = 3 * load_config(overrides).report_interval
        real = asyncio.run(replay_real(address, trace, vocab, probe_rounds(args.seed, vocab, args.probe_rounds), settle))
    load["load_after_real"] = os.getloadavg()[0]
    probes = {name: observed + real.after.get(name, []) for name, observed in real.before.items()}
    costs = serving_costs(probes, profile)
    served_path = work / "sim-validation-served.json"
    served_path.write_text(profile_json(costs.served(profile)))
    variants = {"engine": (profile_path, SimulatorSettings()),
                "served": (served_path, SimulatorSettings(dispatch_delay=costs.request_path))}
    simulated = {name: simulate(trace, path, preset.name, overrides, settings)
                 for name, (path, settings) in variants.items()}
    real_lat = real_latencies(real.trace)
    rows = error_rows(real_lat.stats(), {name: sim.latencies.stats() for name, sim in simulated.items()})
    per_request = write_requests(work / "requests.csv", trace, real_lat,
                                 {n: sim.latencies for n, sim in simulated.items()})
    sim_preemptions = simulated["served"].preemptions
    real_hits, sim_hits = real_hit_rate(real.trace), simulated["served"].hit_rate
    hit_error = sim_hits / real_hits - 1 if real_hits else None
    preemption_error = sim_preemptions / real.preemptions - 1 if real.preemptions else None
    facts = {"model": Path(model).name, "trace": args.trace, "requests": requests, "rate": rate,
             "policy": preset.name,
             "instances": INSTANCES, "kv_tokens": args.kv_tokens, "seed": args.seed, "probe_rounds": args.probe_rounds,
             "request_path_ms": costs.request_path * 1e3, "per_step_ms": costs.per_step * 1e3,
             "per_seq_ms": costs.per_seq * 1e3, "prefill_scale": costs.prefill_scale,
             "probe_ttft_ms": {n: [round(o.ttft * 1e3, 3) for o in obs] for n, obs in probes.items()},
             "probe_tpot_ms": {n: [round(o.tpot * 1e3, 3) for o in obs] for n, obs in probes.items()},
             "probe_instances": {n: [o.instance for o in obs] for n, obs in probes.items()},
             "probe_drift": probe_drift(real),
             "real_completed": len(real.trace), "sim_completed": len(simulated["served"].latencies.ttft),
             "real_migrations": real.migrations, "sim_migrations": simulated["served"].migrations,
             "real_preemptions": real.preemptions, "sim_preemptions": sim_preemptions,
             "sim_engine_preemptions": simulated["engine"].preemptions, "preemption_error": preemption_error,
             "preemptions_within_goal": preemption_error is not None and abs(preemption_error) <= GOAL,
             "real_hit_rate": real_hits, "sim_hit_rate": sim_hits, "hit_rate_error": hit_error,
             "hit_rate_within_goal": hit_error is not None and abs(hit_error) <= HIT_RATE_GOAL,
             "max_send_lateness_ms": max(o.late for o in real.trace) * 1e3, "goal": GOAL,
             "wall_s": time.perf_counter() - started, **load}
    notes = [f"profile: {profile_path}", f"served profile: {served_path}", f"trace: {trace_file or args.trace}",
             f"every request, real and simulated: {per_request}"]
    notes.append(f"preemptions: real {real.preemptions}, simulated {sim_preemptions}"
                 + (f" ({preemption_error:+.1%}; goal {GOAL:.0%})" if preemption_error is not None else ""))
    if real_hits:
        notes.append(f"prefix-cache hit rate: real {real_hits:.3f}, simulated {sim_hits:.3f} ({hit_error:+.1%}; "
                     f"goal {HIT_RATE_GOAL:.0%})")
    pressure = "" if args.kv_tokens == DEFAULT_KV_TOKENS else f"_kv{args.kv_tokens}"
    workload = "" if args.trace == "S-S" else "_" + args.trace.replace("-", "_")
    report("sim_validation" + served.suffix + pressure + workload, args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
