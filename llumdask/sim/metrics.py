"""Run metrics as the paper reports them, from finished requests, cluster samples and migration events.

Pure functions over plain records: the simulator (or a real cluster's recorder) collects
`Request`s, periodic `ClusterSample`s and `MigrationEvent`s, and `summarize` turns them into one
flat dict per run, so every policy is measured by the same code.

Conventions:
- Latencies come from each request's `RequestTiming`: prefill = arrival -> first token (queueing
  included), decode = (last token - first token) / (output tokens - 1), end-to-end = arrival ->
  finished. Only FINISHED requests count; decode skips requests with fewer than two output tokens.
- P99 is numpy's default (linear interpolation between order statistics).
- Over an empty set every mean and percentile is NaN (float('nan')) and every count is 0; the
  keys are always present, so tables line up across policies.
- Quantities sampled over time (fragmentation, instance count, migrating share) are time-weighted:
  a sample holds until the next one, the last until `duration`. If all samples share one instant
  they weigh equally.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from llumdask.llumlet import MigrationEvent, MigrationEventKind
from llumdask.load import InstanceLoad
from llumdask.request import Priority, Request, RequestStatus

_NAN = float("nan")


@dataclass(frozen=True)
class InstanceSample:
    """One instance's memory and queue at a sample instant (blocks, not tokens)."""

    instance_id: str
    total_blocks: int
    free_blocks: int
    head_of_line_demand: int = 0
    num_running: int = 0
    num_waiting: int = 0
    migrating: bool = False

    @classmethod
    def from_load(cls, load: InstanceLoad) -> "InstanceSample":
        return cls(
            load.instance_id,
            load.total_blocks,
            load.free_blocks,
            load.head_of_line_demand,
            load.num_running,
            load.num_waiting,
            migrating=load.num_migrating_out + load.num_migrating_in > 0,
        )

    @property
    def memory_blocked(self) -> bool:
        """Its head-of-line request waits because this instance lacks the blocks for its prompt."""
        return self.head_of_line_demand > self.free_blocks


@dataclass(frozen=True)
class ClusterSample:
    """The cluster at one instant: what fragmentation, cost and migrating share are computed from."""

    time: float
    instances: tuple[InstanceSample, ...] = ()
    # Blocks the first request held at the scheduler needs (0: none is held); it counts as blocked
    # when no instance has the free blocks for it (`fragmented_blocks`).
    held_demand: int = 0

    @classmethod
    def from_loads(cls, time: float, loads: Iterable[InstanceLoad], held_demand: int = 0) -> "ClusterSample":
        return cls(time, tuple(InstanceSample.from_load(load) for load in loads), held_demand)

    @property
    def total_blocks(self) -> int:
        return sum(i.total_blocks for i in self.instances)

    @property
    def free_blocks(self) -> int:
        return sum(i.free_blocks for i in self.instances)

    def fragmented_blocks(self) -> int:
        """Free blocks that would serve queued requests if the free memory were one pool.

        A head-of-line request is blocked when its instance has fewer free blocks than its
        prompt needs. The first request held at the scheduler may go to any instance, so it is
        blocked when none has the free blocks for its prompt; held while one has (waiting for
        room to spare there), the free memory is not scattered: the policy waits. Pool the
        cluster's free blocks F and admit the blocked demands smallest first while they fit: the
        blocks so admitted are fragmented, free memory that queued requests could use but that
        lies elsewhere, scattered. A single instance never fragments. Counting the admitted
        demand rather than all of F keeps one small blocked request from marking a whole idle
        cluster's memory as fragmented.
        """
        budget = self.free_blocks
        used = 0
        blocked = [i.head_of_line_demand for i in self.instances if i.memory_blocked]
        if self.held_demand > max((i.free_blocks for i in self.instances), default=0):
            blocked.append(self.held_demand)
        for demand in sorted(blocked):
            if used + demand > budget:
                break
            used += demand
        return used

    def fragmentation(self) -> float:
        """Fragmented blocks over total cluster blocks, in [0, 1]; 0 for an empty cluster."""
        total = self.total_blocks
        return self.fragmented_blocks() / total if total else 0.0


def mean_and_p99(values: Iterable[float]) -> tuple[float, float]:
    """(mean, P99); (NaN, NaN) for no values."""
    data = np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return _NAN, _NAN
    return float(data.mean()), float(np.percentile(data, 99))


def _mean(values: Iterable[float]) -> float:
    data = np.fromiter(values, dtype=np.float64)
    return float(data.mean()) if data.size else _NAN


def _latency_stats(requests: Sequence[Request], prefix: str = "") -> dict[str, float]:
    series = {
        "prefill": (r.timing.prefill_latency for r in requests),
        "decode": (r.timing.decode_latency(r.num_output_tokens) for r in requests),
        "e2e": (r.timing.end_to_end for r in requests),
    }
    stats: dict[str, float] = {}
    for name, values in series.items():
        stats[f"{prefix}{name}_mean"], stats[f"{prefix}{name}_p99"] = mean_and_p99(v for v in values if v is not None)
    return stats


def _time_weights(samples: Sequence[ClusterSample], duration: float) -> np.ndarray:
    times = np.array([s.time for s in samples], dtype=np.float64)
    if np.any(np.diff(times) < 0):
        raise ValueError("cluster samples must be in time order")
    weights = np.diff(np.append(times, max(duration, times[-1])))
    return weights if weights.sum() > 0 else np.ones_like(weights)


def mean_instances(samples: Sequence[ClusterSample], until: float) -> float:
    """Time-weighted mean instance count from the first sample to `until` (samples after it
    ignored): the cost of a run over a window every policy shares, such as its arrivals."""
    kept = [s for s in samples if s.time < until] or list(samples[:1])
    if not kept:
        return _NAN
    counts = np.array([len(s.instances) for s in kept], dtype=np.float64)
    return float(np.average(counts, weights=_time_weights(kept, until)))


def _sample_stats(samples: Sequence[ClusterSample], duration: float) -> dict[str, float]:
    if not samples:
        return {"fragmentation_mean": _NAN, "instances_mean": _NAN, "migrating_time_share": _NAN, "imbalance": _NAN}
    weights = _time_weights(samples, duration)
    counts = np.array([len(s.instances) for s in samples], dtype=np.float64)
    migrating = np.array([sum(i.migrating for i in s.instances) for s in samples], dtype=np.float64)
    instance_time = float(weights @ counts)
    return {
        "fragmentation_mean": float(np.average([s.fragmentation() for s in samples], weights=weights)),
        "instances_mean": float(np.average(counts, weights=weights)),
        # Instance-time spent migrating (as source or destination) over all instance-time.
        "migrating_time_share": float(weights @ migrating) / instance_time if instance_time else _NAN,
        "imbalance": imbalance(samples, weights),
    }


def imbalance(samples: Sequence[ClusterSample], weights: np.ndarray) -> float:
    """Load imbalance: the busiest instance's running requests over the mean's, averaged over the
    samples where anything runs (1: even; what prefix-only routing drives up)."""
    ratios, kept = [], []
    for sample, weight in zip(samples, weights):
        running = [i.num_running for i in sample.instances]
        if running and sum(running):
            ratios.append(max(running) * len(running) / sum(running))
            kept.append(weight)
    return float(np.average(ratios, weights=kept)) if ratios and sum(kept) else _NAN


def migration_outcomes(events: Iterable[MigrationEvent]) -> dict[str, MigrationEvent]:
    """The final event (COMMITTED or ABORTED) of each migration that ended, by migration id."""
    return {e.migration_id: e for e in events if e.kind is not MigrationEventKind.STARTED}


def churn(events: Iterable[MigrationEvent]) -> tuple[int, int]:
    """(requests moved more than once, requests moved back to an instance they had left)."""
    moves: dict[str, list[MigrationEvent]] = defaultdict(list)
    for event in migration_outcomes(events).values():
        if event.kind is MigrationEventKind.COMMITTED:
            moves[event.request_id].append(event)
    repeated = returned = 0
    for path in moves.values():
        path.sort(key=lambda e: e.time)
        repeated += len(path) > 1
        left: set[str] = set()
        for move in path:
            if move.destination in left:
                returned += 1
                break
            left.add(move.source)
    return repeated, returned


def _migration_stats(events: Iterable[MigrationEvent]) -> dict[str, float]:
    events = list(events)
    outcomes = migration_outcomes(events).values()
    committed = [e for e in outcomes if e.kind is MigrationEventKind.COMMITTED]
    repeated, returned = churn(events)
    return {
        "migrations": len(committed),
        # Of them, waiting requests handed over (no KV moved, nothing paused).
        "migrations_waiting": sum(e.waiting for e in committed),
        "migrations_aborted": sum(e.kind is MigrationEventKind.ABORTED for e in outcomes),
        # Bytes that crossed the network, aborted migrations' partial copies included.
        "migration_bytes": sum(e.bytes for e in outcomes),
        # Of the blocks committed migrations moved, the share the destination held already.
        "migration_reused_share": (sum(e.reused_blocks for e in committed) / moved
                                   if (moved := sum(e.blocks for e in committed)) else _NAN),
        "migration_downtime_mean": _mean(e.downtime for e in committed if not e.waiting),
        "churn": repeated,
        "churn_returns": returned,
    }


def prefix_hit_rate(requests: Iterable[Request]) -> float:
    """Share of prompt tokens found in a prefix cache when first scheduled (NaN where no engine said)."""
    reported = [(r.timing.cached_tokens, r.num_prompt_tokens) for r in requests if r.timing.cached_tokens is not None]
    prompts = sum(n for _, n in reported)
    return sum(c for c, _ in reported) / prompts if prompts else _NAN


def summarize(
    requests: Iterable[Request],
    samples: Sequence[ClusterSample],
    migrations: Iterable[MigrationEvent],
    duration: float,
) -> dict[str, float]:
    """Every metric of one run, flat. Per-priority keys (high_/normal_ + prefill/decode/e2e
    mean/p99) appear only when both priorities finished requests; priority means scheduling
    priority, which the simulator sets equal to execution priority.
    """
    if not (math.isfinite(duration) and duration >= 0):
        raise ValueError(f"duration must be a finite number >= 0, got {duration!r}")
    finished = [r for r in requests if r.status is RequestStatus.FINISHED]
    result: dict[str, float] = {"requests": len(finished), **_latency_stats(finished)}
    result["makespan"] = max((r.timing.finished for r in finished), default=math.nan)
    result["preemption_count"] = sum(r.timing.preemptions for r in finished)
    result["preemption_loss_mean"] = _mean(r.timing.preemption_loss for r in finished)
    result["migrated_requests"] = sum(r.timing.migrations > 0 for r in finished)
    result["prefix_hit_rate"] = prefix_hit_rate(finished)
    result.update(_sample_stats(samples, duration))
    result.update(_migration_stats(migrations))
    by_priority = {p: [r for r in finished if r.scheduling_priority is p] for p in Priority}
    if all(by_priority.values()):
        for priority, group in by_priority.items():
            result.update(_latency_stats(group, prefix=f"{priority.name.lower()}_"))
    return result
