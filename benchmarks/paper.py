"""The Llumnix paper's evaluation (OSDI'24, figures 11-16), as far as a simulator can run it.

A `PaperPlan` says what to run; `plan_cases` expands it into independent `Case`s (one workload
through one policy preset on one simulated cluster), `run_paper` runs them in a process pool and
returns every run's summary, the capacities the rates were chosen from, and the scheduler
microbenchmark. Rendering (`paper_report`, `plots`) is separate, so this module is pure.

Every setting runs once per seed of the plan (a seed draws the workload: arrivals, lengths,
priorities; every policy of a setting and seed sees the same requests). Near capacity one seed
decides a P99, so the report reads medians over seeds.

Experiments:
- serving: generated (S-S, M-M, L-L, S-L, L-S) and real-trace-like (ShareGPT, BurstGPT) traces
  over a range of rates, every policy preset on the same requests, the clairvoyant oracle
  (`oracle`) beside them as the limit of dispatch; the infaas and llumnix runs of one loaded
  setting also keep the fragmentation timeline;
- priorities: S-S with 10% high-priority requests and Gamma arrivals of several CVs, Llumnix with
  and without priority headroom, the headroom derived from the latency profile for the trace's
  sequences (`llumdask.engine.headroom`);
- autoscaling: L-L with scaling enabled (1..16 instances, a stated start-up delay), Llumnix and
  INFaaS++ each over a sweep of freeness bands, so that their cost can be read at equal P99
  prefill from the two cost-vs-latency curves;
- scalability: `scalability.measure` at 16 to 1,024 instances.

Rates. Our latency model is not the paper's testbed, so request rates copied from the paper would
load our cluster differently. Each run's rate is a fraction of the *ideal capacity* of the very
requests it replays: the request rate the simulated cluster could sustain if its KV memory were
one perfectly packed pool (`ideal_capacity`: from the latency profile and the requests' lengths,
no simulation, no policy). Lengths are heavy-tailed, so 5,000 requests of one seed can need a
fifth more memory-time than another's: a load fraction taken from one seed's lengths would put
the other seeds past their limit at "0.9". The sweep so runs from light load to about the
cluster's limit for every seed; each run's backlog when the last request arrives tells on which
side of its own limit a policy ended up.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.headroom import DEFAULT_TOLERANCE, Headroom, derive_headroom
from llumdask.engine.latency import LatencyProfile, load_profile
from llumdask.request import Priority, Request
from llumdask.sim.metrics import ClusterSample, mean_instances, summarize
from llumdask.sim.presets import PRESETS
from llumdask.sim.run import make_spec, run_cluster
from llumdask.benchmarks.scalability import measure
from llumdask.sim.workload import PAIRINGS, WORKLOADS, TraceRequest, make_workload

SERVING, PRIORITIES, AUTOSCALING = "serving", "priorities", "autoscaling"
# The paper's auto-scaling band is [10, 60] with 1 to 16 instances; the sweep scales it up and
# down so that each policy traces a cost-vs-P99 curve.
AUTOSCALE_BANDS = ((5.0, 30.0), (7.5, 45.0), (10.0, 60.0), (20.0, 120.0))
AUTOSCALE_MAX_INSTANCES = 16
# The simpler routers Llumnix must never lose to, and the limit of dispatch beside them.
BASELINES = ("round_robin", "infaas", "lmetric", "power_of_two")
ORACLE = "oracle"
# Llumnix-base differs from Llumnix only in high-priority headroom, so without high-priority
# requests the two run identically: it is compared in the priorities experiment only.
SERVING_POLICIES = (*BASELINES, "llumnix", ORACLE)
PRIORITY_POLICIES = ("llumnix_base", "llumnix")
AUTOSCALING_POLICIES = ("infaas", "llumnix")
# The pair whose fragmentation over time is plotted (paper: INFaaS++ against Llumnix).
TIMELINE_POLICIES = ("infaas", "llumnix")
# Lengths drawn to estimate what a trace's decoding sequence holds (a sample, not a simulation: cheap).
_LENGTH_SAMPLE = 50_000


@dataclass(frozen=True)
class PaperPlan:
    """Sizes of every experiment. `full()` is the committed run, `quick()` a smoke run."""

    instances: int = 16
    profile: str = "llama-7b-a10"
    seeds: tuple[int, ...] = (0, 1, 2)
    # serving
    traces: tuple[str, ...] = ("sharegpt", "burstgpt", *PAIRINGS)
    loads: tuple[float, ...] = (0.6, 0.8, 0.9, 1.0)
    # The paper replays 10,000 requests; half keeps the full run within an hour on 2 cores.
    requests: int = 5_000
    policies: tuple[str, ...] = SERVING_POLICIES
    # Fragmentation needs memory pressure: the heaviest load of the sweep.
    timeline: tuple[str, float] = ("M-M", 1.0)
    # priorities
    priority_trace: str = "S-S"
    priority_share: float = 0.1
    priority_load: float = 0.85
    priority_cvs: tuple[float, ...] = (1.0, 2.0, 4.0, 6.0)
    priority_requests: int = 5_000
    # Near-ideal decode: within this of a lone sequence's step (the headroom's derivation).
    priority_tolerance: float = DEFAULT_TOLERANCE
    # autoscaling
    autoscale_trace: str = "L-L"
    autoscale_loads: tuple[float, ...] = (0.25, 0.5)
    autoscale_bands: tuple[tuple[float, float], ...] = AUTOSCALE_BANDS
    autoscale_requests: int = 5_000
    # Start fully provisioned: scaling trims the cluster to the load, so no start-up queue (an
    # artefact of the initial size, not of the policy) dominates the P99.
    autoscale_initial_instances: int = AUTOSCALE_MAX_INSTANCES
    # Assumed time from "add an instance" to its first request: load 13.5 GB of LLaMA-7B weights
    # at ~1.5 GB/s from local NVMe plus engine start; not measured.
    autoscale_startup_delay: float = 10.0
    # scalability
    scalability_sizes: tuple[int, ...] = (16, 64, 256, 1024)
    scalability_rounds: int = 100

    def __post_init__(self) -> None:
        for name in ("instances", "requests", "priority_requests", "autoscale_requests", "scalability_rounds",
                     "autoscale_initial_instances"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"paper plan: {name} must be an integer >= 1, got {value!r}")
        for trace in (*self.traces, self.priority_trace, self.autoscale_trace, self.timeline[0]):
            if trace not in WORKLOADS:
                raise ValueError(f"paper plan: unknown trace {trace!r}; choose from {', '.join(WORKLOADS)}")
        unknown = [p for p in self.policies if p not in PRESETS]
        if unknown or not self.policies:
            raise ValueError(f"paper plan: unknown policies {unknown or '(none given)'}; choose from {', '.join(PRESETS)}")
        for name in ("seeds", "loads", "autoscale_loads", "autoscale_bands", "priority_cvs", "scalability_sizes"):
            if not getattr(self, name):
                raise ValueError(f"paper plan: {name} must not be empty")
        if len(set(self.seeds)) != len(self.seeds) or not all(isinstance(s, int) for s in self.seeds):
            raise ValueError(f"paper plan: seeds must be distinct integers, got {self.seeds!r}")
        if any(not (0 < low < high) for low, high in self.autoscale_bands):
            raise ValueError(f"paper plan: autoscale_bands must be (low, high) with 0 < low < high, got {self.autoscale_bands}")
        if not self.priority_tolerance > 0:
            raise ValueError(f"paper plan: priority_tolerance must be > 0, got {self.priority_tolerance!r}")
        for load in (*self.loads, *self.autoscale_loads, self.priority_load, self.timeline[1]):
            if not (math.isfinite(load) and load > 0):
                raise ValueError(f"paper plan: load fractions must be finite and > 0, got {load!r}")
        if any(not (math.isfinite(cv) and cv >= 0) for cv in self.priority_cvs):
            raise ValueError(f"paper plan: priority_cvs must be finite and >= 0, got {self.priority_cvs}")
        if not 0 < self.priority_share < 1:
            raise ValueError(f"paper plan: priority_share must be in (0, 1), got {self.priority_share!r}")
        if self.autoscale_startup_delay < 0:
            raise ValueError(f"paper plan: autoscale_startup_delay must be >= 0, got {self.autoscale_startup_delay!r}")
        if self.autoscale_initial_instances > AUTOSCALE_MAX_INSTANCES:
            raise ValueError(f"paper plan: autoscale_initial_instances must be <= {AUTOSCALE_MAX_INSTANCES} (the paper's maximum)")

    @classmethod
    def full(cls) -> "PaperPlan":
        return cls()

    @classmethod
    def quick(cls) -> "PaperPlan":
        """Two traces, two rates, two seeds, fewer requests: the shape of every table in minutes."""
        return cls(
            seeds=(0, 1),
            traces=("sharegpt", "M-M"),
            loads=(0.7, 1.0),
            requests=2_000,
            priority_cvs=(1.0, 4.0),
            priority_requests=2_000,
            autoscale_loads=(0.5,),
            autoscale_bands=((10.0, 60.0), (40.0, 240.0)),
            autoscale_requests=1_000,
        )

    def all_traces(self) -> tuple[str, ...]:
        """Every trace some experiment runs, each once, serving traces first."""
        return tuple(dict.fromkeys((*self.traces, self.priority_trace, self.autoscale_trace)))

    def with_requests(self, requests: int) -> "PaperPlan":
        """Every simulation with `requests` requests (faster, noisier)."""
        return replace(self, requests=requests, priority_requests=requests, autoscale_requests=requests)


@dataclass(frozen=True)
class Case:
    """One simulation: picklable, so a worker process builds its own workload and cluster."""

    experiment: str
    trace: str
    load: float
    rate: float
    policy: str
    requests: int
    instances: int
    profile: str
    seed: int
    cv: float | None = None
    high_priority_share: float = 0.0
    # Tokens of high-priority headroom (priorities experiment; None: the profile's own).
    headroom_tokens: int | None = None
    # Instances kept for high-priority requests (the priority_pools policy only).
    pool_instances: int | None = None
    autoscale_startup_delay: float | None = None
    # The freeness band scaling keeps (autoscaling experiment only).
    band: tuple[float, float] | None = None
    # Seconds above the band before instances are drained (None: the configuration's).
    scale_in_period: float | None = None
    timeline: bool = False

    @property
    def label(self) -> str:
        cv = f" cv {self.cv:g}" if self.cv is not None else ""
        band = f" band [{self.band[0]:g}, {self.band[1]:g}]" if self.band is not None else ""
        band += f" in {self.scale_in_period:g}s" if self.scale_in_period is not None else ""
        pool = f" pool {self.pool_instances}" if self.pool_instances is not None else ""
        return (f"{self.experiment} {self.trace} load {self.load:g}{cv}{band} ({self.rate:.2f} req/s) {self.policy}{pool} "
                f"seed {self.seed}")

    @property
    def cost(self) -> float:
        """Relative wall time: simulated span x instances (the simulator's work is per step)."""
        return self.requests / self.rate * self.instances


# Fields of a run that identify its case; the only ones that may be None.
_CASE_FIELDS = frozenset(f.name for f in fields(Case))
# What identifies a setting: every case field but the seed, the rate (each seed's requests have
# their own capacity) and the timeline flag.
_SETTING_FIELDS = tuple(sorted(_CASE_FIELDS - {"seed", "rate", "timeline"}))


def _median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {k: runs[0].get(k) for k in _SETTING_FIELDS} | {"seeds": len(runs)}
    for key, value in runs[0].items():
        if (key in _CASE_FIELDS and key != "rate") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        merged[key] = float(np.median(values)) if values else math.nan
        merged[f"{key}_min"], merged[f"{key}_max"] = (min(values), max(values)) if values else (math.nan, math.nan)
    timeline = next((r["timeline"] for r in runs if "timeline" in r), None)
    if timeline is not None:
        merged["timeline"] = timeline
    return merged


# ------------------------------------------------------------------------------- capacity
def ideal_capacity(requests: Sequence[TraceRequest], instances: int, profile: LatencyProfile, config: LlumdaskConfig) -> float:
    """Requests/s `instances` could sustain on `requests` if their KV memory were one perfectly
    packed pool.

    Per instance, with memory full: a running request of input i and output o holds i + k tokens
    at its k-th decode step (k = 1 .. o - 1; prefill made the first token), plus half a block of
    rounding. Weighted by time, a running request holds ctx = E[token-steps] / E[o - 1] tokens, so
    the batch is b = min(max_num_seqs, capacity / ctx), and a decode step lasts
    T = decode_time(b, b x ctx). Each request needs (o - 1) / b steps' worth of the instance plus
    its own prefill, so one instance finishes 1 / (E[o - 1] T / b + E[prefill(i)]) requests a
    second. An estimate, not a bound: preemption, imbalance and fragmentation lower what real
    dispatch achieves.
    """
    inputs = np.array([r.input_len for r in requests], dtype=np.float64)
    decodes = np.array([r.output_len - 1 for r in requests], dtype=np.float64)
    block = config.block_size
    capacity_tokens = (config.sim_engine.total_blocks or profile.capacity_tokens // block) * block
    token_steps = decodes * inputs + decodes * (decodes + 1) / 2 + decodes * block / 2
    prefill = float(np.mean([profile.prefill_time([int(n)]) for n in inputs]))
    if decodes.mean() == 0:
        return instances / prefill
    ctx = token_steps.mean() / decodes.mean()
    batch = min(float(config.sim_engine.max_num_seqs), capacity_tokens / ctx)
    d = profile.decode
    step = d.base_s + d.per_seq_s * batch + d.per_context_token_s * batch * ctx
    return instances / (decodes.mean() * step / batch + prefill)


@dataclass(frozen=True, order=True)
class Replay:
    """The requests one run replays: a trace's first `requests` under `seed` (lengths do not
    depend on the rate, the CV or the priority share)."""

    trace: str
    requests: int
    seed: int


def replay_capacity(replay: Replay, instances: int, profile_name: str) -> float:
    """The ideal capacity of one replay's requests on `instances` (the paper plan's configuration)."""
    config = make_spec("llumnix", instances, profile=profile_name).config
    sample = make_workload(replay.trace, rate=1.0, num_requests=replay.requests, seed=replay.seed)
    return float(ideal_capacity(sample, instances, load_profile(profile_name), config))


def capacities(plan: PaperPlan) -> dict[Replay, float]:
    """Ideal capacity (requests/s of the whole `plan.instances` cluster) of every replay the plan
    runs: each run's rate is a load fraction of its own requests' capacity."""
    replays = {(plan.priority_trace, plan.priority_requests), (plan.autoscale_trace, plan.autoscale_requests)}
    replays |= {(trace, plan.requests) for trace in plan.traces}
    return {
        replay: replay_capacity(replay, plan.instances, plan.profile)
        for replay in sorted(Replay(t, n, s) for t, n in replays for s in plan.seeds)
    }


def decode_context_tokens(trace: str, *, seed: int = 0) -> int:
    """Tokens a request of the trace holds while it decodes, weighted by decode steps: what one
    sequence of a busy batch holds (long requests hold more, and for longer)."""
    sample = make_workload(trace, rate=1.0, num_requests=_LENGTH_SAMPLE, seed=seed)
    inputs = np.array([r.input_len for r in sample], dtype=np.float64)
    decodes = np.array([r.output_len - 1 for r in sample], dtype=np.float64)
    return max(1, round(float((decodes * inputs + decodes * (decodes + 1) / 2).sum() / max(decodes.sum(), 1))))


def priority_headroom(plan: PaperPlan) -> Headroom:
    """The priorities experiment's headroom: derived from the profile for the trace's sequences."""
    tokens = decode_context_tokens(plan.priority_trace, seed=plan.seeds[0])
    return derive_headroom(load_profile(plan.profile), tolerance=plan.priority_tolerance, sequence_tokens=tokens)


# ------------------------------------------------------------------------------- cases
def plan_cases(plan: PaperPlan, capacity: dict[Replay, float], headroom: Headroom) -> list[Case]:
    """Every simulation of the plan, once per seed; each rate is a load fraction times the ideal
    capacity of the requests the case replays. Timelines are kept for the first seed only."""
    cases = []
    for seed in plan.seeds:
        common = dict(instances=plan.instances, profile=plan.profile, seed=seed)
        first = seed == plan.seeds[0]
        cases += [
            Case(SERVING, trace, load, load * capacity[Replay(trace, plan.requests, seed)], policy, plan.requests,
                 timeline=first and (trace, load) == plan.timeline and policy in TIMELINE_POLICIES, **common)
            for trace in plan.traces
            for load in plan.loads
            for policy in plan.policies
        ]
        cases += [
            Case(PRIORITIES, plan.priority_trace, plan.priority_load,
                 plan.priority_load * capacity[Replay(plan.priority_trace, plan.priority_requests, seed)],
                 policy, plan.priority_requests, cv=cv, high_priority_share=plan.priority_share,
                 headroom_tokens=headroom.tokens, **common)
            for cv in plan.priority_cvs
            for policy in PRIORITY_POLICIES
        ]
        cases += [
            autoscaling_case(plan, capacity, seed, load, band, policy, timeline=first)
            for load in plan.autoscale_loads
            for band in plan.autoscale_bands
            for policy in AUTOSCALING_POLICIES
        ]
    return cases


def autoscaling_case(plan: PaperPlan, capacity: dict[Replay, float], seed: int, load: float,
                     band: tuple[float, float], policy: str, *, timeline: bool = False,
                     scale_in_period: float | None = None) -> Case:
    """One run of the auto-scaling experiment: the plan's trace at `load`, scaling in `band`."""
    return Case(AUTOSCALING, plan.autoscale_trace, load,
                load * capacity[Replay(plan.autoscale_trace, plan.autoscale_requests, seed)], policy,
                plan.autoscale_requests, plan.autoscale_initial_instances, plan.profile, seed,
                autoscale_startup_delay=plan.autoscale_startup_delay, band=band, scale_in_period=scale_in_period,
                timeline=timeline)


def case_config(case: Case) -> LlumdaskConfig:
    """The base configuration of a case; the preset is applied on top by `make_spec`."""
    config = load_config()
    if case.headroom_tokens is not None:
        config = replace(config, headroom_tokens={**config.headroom_tokens, Priority.HIGH: case.headroom_tokens})
    if case.pool_instances is not None:
        config = replace(config, dispatch=replace(config.dispatch, priority_pool_instances=case.pool_instances))
    if case.band is None:
        return replace(config, scaling=replace(config.scaling, enabled=False))
    return replace(
        config,
        scaling=replace(config.scaling, enabled=True, band=case.band, min_instances=1,
                        max_instances=AUTOSCALE_MAX_INSTANCES, startup_delay=case.autoscale_startup_delay or 0.0,
                        scale_in_period=(config.scaling.scale_in_period if case.scale_in_period is None
                                         else case.scale_in_period)),
    )


def timeline(samples: Sequence[ClusterSample]) -> dict[str, list[float]]:
    """Fragmentation (0..1) and instance count at each cluster sample, for plots."""
    return {
        "time": [round(s.time, 3) for s in samples],
        "fragmentation": [round(s.fragmentation(), 5) for s in samples],
        "instances": [len(s.instances) for s in samples],
    }


def backlog(requests: Iterable[Request], at: float) -> int:
    """Requests that had arrived by `at` but had no first token yet: a few under a sustainable
    load, a number growing with the run's length under overload."""
    return sum(
        1 for r in requests
        if r.arrival_time <= at and (r.timing.first_token is None or r.timing.first_token > at)
    )


def last_arrival(workload: Sequence[TraceRequest]) -> float:
    """When the last request arrived that came on its own: a conversation's later turns wait for
    the earlier answers (their arrival is only nominal), so its first turn is the last that load,
    not service, decides."""
    return max((r.arrival for r in workload if r.after is None), default=0.0)


def run_case(case: Case) -> dict[str, Any]:
    """Simulate one case; its summary plus what identifies it (and its timeline when asked)."""
    workload = make_workload(case.trace, rate=case.rate, num_requests=case.requests, seed=case.seed, cv=case.cv,
                             high_priority_share=case.high_priority_share)
    spec = make_spec(case.policy, case.instances, profile=case.profile, base=case_config(case))
    outcome, wall = run_cluster(spec, workload)
    summary = summarize(outcome.requests, outcome.samples, outcome.migrations, outcome.duration)
    case_fields = {k: v for k, v in asdict(case).items() if k != "timeline"}
    # summary["requests"] counts finished requests; the case's `requests` (offered) takes the key.
    result = summary | {"finished": summary["requests"]} | case_fields | {
        "backlog_at_last_arrival": backlog(outcome.requests, last_arrival(workload)),
        "rejected": len(outcome.rejected),
        "preemptions_with_room": outcome.preemptions_with_room,
        "simulated_seconds": outcome.duration,
        "wall_seconds": wall,
    }
    if case.band is not None:
        # Cost while the trace arrives: a policy that finishes its stragglers sooner must not look
        # dearer for the idle tail it no longer has.
        result["instances_serving_mean"] = mean_instances(outcome.samples, workload[-1].arrival if workload else 0.0)
    if case.timeline:
        result["timeline"] = timeline(outcome.samples)
    high = [r for r in workload if r.priority is Priority.HIGH]
    if high:
        # The limit of any placement: each high-priority request alone on an idle instance.
        result["high_solo_e2e_mean"] = float(np.mean([spec.profile.solo_latency(r.input_len, r.output_len) for r in high]))
    return result


# ------------------------------------------------------------------------------- runner
@dataclass
class PaperResults:
    plan: PaperPlan
    capacity: dict[Replay, float]
    runs: list[dict[str, Any]]
    scalability: list[dict[str, Any]]
    # The high-priority headroom of the priorities experiment, and what it was derived from.
    headroom: Headroom | None = None
    wall_seconds: float = 0.0
    jobs: int = 1
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    # The configuration every case started from (presets and the case's scaling on top).
    config: LlumdaskConfig = field(default_factory=load_config)
    # How the run was started, quoted in the report.
    command: str = "llumdask bench paper"

    def select(self, experiment: str, **match: Any) -> list[dict[str, Any]]:
        """Runs of one experiment whose fields equal `match`, in plan order."""
        return [r for r in self.runs if r["experiment"] == experiment and all(r.get(k) == v for k, v in match.items())]

    def medians(self) -> "PaperResults":
        """The same results with one run per setting and policy: each metric the median over the
        seeds, with `<metric>_min` / `<metric>_max` beside it and `seeds` the count. A timeline
        comes from the seed that kept one."""
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for run in self.runs:
            groups.setdefault(tuple(run.get(k) for k in _SETTING_FIELDS), []).append(run)
        return replace(self, runs=[_median_run(group) for group in groups.values()])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PaperResults":
        """Back from results.json (`to_dict` after JSON), e.g. to render the report again.

        JSON has no tuples and no NaN: sequences in the plan become tuples again, and a null
        metric (an undefined mean or percentile) becomes NaN again.
        """
        try:
            plan = PaperPlan(**{k: _tuples(v) for k, v in data["plan"].items()})
            capacity = {Replay(c["trace"], c["requests"], c["seed"]): float(c["ideal_requests_per_s"]) for c in data["capacity"]}
            runs = [{k: _tuples(v) if k in _CASE_FIELDS else math.nan if v is None else v for k, v in run.items()}
                    for run in data["runs"]]
            headroom = Headroom.from_dict(data["headroom"]) if data.get("headroom") else None
            return cls(plan, capacity, runs, data["scalability"], headroom, data["wall_seconds"], data["jobs"], data["cpus"],
                       LlumdaskConfig.from_dict(data["config"]), data.get("command", cls.command))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # AttributeError: a section of the wrong JSON type
            raise ValueError(f"not the results.json of 'llumdask bench paper': {exc!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": asdict(self.plan),
            "capacity": [asdict(r) | {"ideal_requests_per_s": c, "instances": self.plan.instances} for r, c in self.capacity.items()],
            "runs": self.runs,
            "scalability": self.scalability,
            "headroom": self.headroom.to_dict() if self.headroom is not None else None,
            "config": self.config.to_dict(),
            "command": self.command,
            "wall_seconds": self.wall_seconds,
            "jobs": self.jobs,
            "cpus": self.cpus,
        }


def case_key(run: dict[str, Any]) -> tuple:
    """What identifies a run's case (its fields but the timeline flag); of a `Case` too, through
    `dataclasses.asdict`."""
    return tuple(run.get(name) for name in sorted(_CASE_FIELDS - {"timeline"}))


def replace_runs(kept: Sequence[dict[str, Any]], fresh: Sequence[dict[str, Any]],
                 policies: frozenset[str]) -> list[dict[str, Any]]:
    """The kept runs, those of `policies` replaced by the fresh runs of the same cases."""
    by_case = {case_key(run): run for run in fresh}
    runs = [by_case.pop(case_key(r)) if r["policy"] in policies else r for r in kept]
    if by_case:
        raise ValueError(f"{len(by_case)} of the new runs have no counterpart in the kept results")
    return runs


def run_cases(cases: Sequence[Case], jobs: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every case, `jobs` at a time, costliest first; results in the order of `cases`."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    order = sorted(range(len(cases)), key=lambda i: -cases[i].cost)
    results: list[dict[str, Any] | None] = [None] * len(cases)
    started = time.perf_counter()

    def done(index: int, result: dict[str, Any]) -> None:
        results[index] = result
        finished = sum(r is not None for r in results)
        progress(
            f"[{finished}/{len(cases)} {time.perf_counter() - started:6.0f}s] {cases[index].label}: "
            f"prefill p99 {result['prefill_p99']:.2f}s, {result['wall_seconds']:.1f}s wall"
        )

    if jobs == 1:
        for index in order:
            done(index, _labelled(run_case, cases[index]))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_labelled, run_case, cases[index]): index for index in order}
            for future in as_completed(futures):
                done(futures[future], future.result())
    return [r for r in results if r is not None]


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples they were (plan fields, a case's band)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class CaseFailed(RuntimeError):
    """A simulation raised; the message names the case, the cause is chained."""


def _labelled(run: Callable[[Case], dict[str, Any]], case: Case) -> dict[str, Any]:
    try:
        return run(case)
    except Exception as exc:
        raise CaseFailed(f"simulation '{case.label}' (seed {case.seed}, {case.requests} requests) failed: {exc!r}") from exc


def run_paper(plan: PaperPlan, *, jobs: int = 2, progress: Callable[[str], None] = print,
              keep: PaperResults | None = None, policies: frozenset[str] = frozenset()) -> PaperResults:
    """Run every experiment of the plan (simulations in a pool of `jobs` processes); with `keep`
    (earlier results of the same plan), only the cases of `policies`, the other runs kept from
    it (the simulator is deterministic: a policy whose code did not change gives the same runs)."""
    if keep is not None and keep.plan != plan:
        raise ValueError("the kept results are of another plan: run them all again")
    started = time.perf_counter()
    capacity = capacities(plan)
    for replay, value in capacity.items():
        progress(f"ideal capacity {replay.trace} ({replay.requests} requests, seed {replay.seed}): "
                 f"{value:.2f} req/s on {plan.instances} instances")
    headroom = priority_headroom(plan)
    progress(f"priority headroom {headroom.tokens:,} tokens (near-ideal load {headroom.near_ideal_tokens:,} tokens for "
             f"sequences of {headroom.sequence_tokens}; ceiling {headroom.ceiling:.2f}x)")
    cases = plan_cases(plan, capacity, headroom)
    if keep is not None:
        cases = [c for c in cases if c.policy in policies]
    progress(f"{len(cases)} simulations, {jobs} at a time")
    runs = run_cases(cases, jobs, progress)
    if keep is not None:
        runs = replace_runs(keep.runs, runs, policies)
    progress(f"scheduler scalability at {', '.join(map(str, plan.scalability_sizes))} instances")
    scalability = [measure(n, rounds=plan.scalability_rounds, seed=plan.seeds[0]).to_dict() for n in plan.scalability_sizes]
    return PaperResults(plan, capacity, runs, scalability, headroom, time.perf_counter() - started, jobs)

