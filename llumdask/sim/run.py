"""One simulation = one workload through one preset on one simulated cluster, summarized."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.latency import LatencyProfile, load_profile
from llumdask.request import Request
from llumdask.sim.cluster import SimCluster, SimOutcome, SimulatorSettings
from llumdask.sim.metrics import summarize
from llumdask.sim.presets import get_preset
from llumdask.sim.workload import TraceRequest


@dataclass(frozen=True)
class SimulationSpec:
    preset: str
    instances: int
    config: LlumdaskConfig
    profile: LatencyProfile
    settings: SimulatorSettings = SimulatorSettings()
    # Dispatch by the clairvoyant oracle instead of the configured policy.
    clairvoyant: bool = False


def simulation_config(base: LlumdaskConfig | None = None, *, profile: LatencyProfile | None = None) -> LlumdaskConfig:
    """A config fit for large simulations: no real KV bytes, the profile's block size."""
    config = base or load_config()
    block_size = profile.block_size if profile is not None else config.block_size
    return replace(config, block_size=block_size, sim_engine=replace(config.sim_engine, kv_bytes_per_token=0, real_time=False))


def make_spec(preset: str, instances: int, *, profile: str = "llama-7b-a10", base: LlumdaskConfig | None = None,
              settings: SimulatorSettings | None = None) -> SimulationSpec:
    loaded = load_profile(profile)
    config = simulation_config(base, profile=loaded)
    config = replace(config, sim_engine=replace(config.sim_engine, profile=profile))
    chosen = get_preset(preset)
    return SimulationSpec(preset, instances, chosen.apply(config), loaded, settings or SimulatorSettings(), chosen.clairvoyant)


def run_cluster(spec: SimulationSpec, workload: Sequence[TraceRequest], *,
                on_finish: Callable[[Request], None] | None = None) -> tuple[SimOutcome, float]:
    """Replay `workload` on a fresh simulated cluster; the outcome and the wall-clock seconds it took."""
    started = time.perf_counter()
    cluster = SimCluster(spec.config, spec.profile, spec.instances, spec.settings, on_finish=on_finish,
                         clairvoyant=spec.clairvoyant)
    outcome = cluster.run(list(workload))
    return outcome, time.perf_counter() - started


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (the simulator's memory goal is per process)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def simulate(spec: SimulationSpec, workload: Sequence[TraceRequest], *, progress: bool = False) -> dict[str, Any]:
    """Run to completion and return the metrics of `summarize` plus run facts (wall time, rejects)."""
    bar = tqdm(total=len(workload), desc=spec.preset, unit="req", disable=not progress, leave=False)
    outcome, wall = run_cluster(spec, workload, on_finish=lambda _: bar.update(1))
    bar.close()
    summary = summarize(outcome.requests, outcome.samples, outcome.migrations, outcome.duration)
    summary.update(
        policy=spec.preset,
        instances=spec.instances,
        rejected=len(outcome.rejected),
        preemptions_with_room=outcome.preemptions_with_room,
        simulated_seconds=outcome.duration,
        wall_seconds=wall,
        peak_rss_mib=peak_rss_mib(),
    )
    return summary


def to_json(value: Any) -> Any:
    """JSON has no NaN: undefined metrics become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(data), indent=2, sort_keys=True) + "\n")
