"""The simulator runs the production core on a virtual clock: deterministic, leak-free, CLI contract."""

from __future__ import annotations

import json
import math

import pytest

from llumdask.api.bench import main as bench_main
from llumdask.sim.cluster import SimCluster, SimulatorSettings
from llumdask.sim.run import make_spec, simulate
from llumdask.sim.workload import make_workload

RESULT_KEYS = {
    "prefill_mean", "prefill_p99", "decode_mean", "decode_p99", "e2e_mean", "e2e_p99",
    "preemption_loss_mean", "fragmentation_mean", "instances_mean", "migrations",
}


def small_run(preset: str, seed: int = 3, **settings):
    workload = make_workload("M-M", rate=6.0, num_requests=120, seed=seed)
    return simulate(make_spec(preset, 3, settings=SimulatorSettings(**settings)), workload)


def test_same_seed_same_results():
    first, second = small_run("llumnix"), small_run("llumnix")
    first.pop("wall_seconds"), second.pop("wall_seconds")
    assert json.dumps(first, sort_keys=True, default=str) == json.dumps(second, sort_keys=True, default=str)
    assert small_run("llumnix", seed=4)["e2e_mean"] != first["e2e_mean"]


@pytest.mark.parametrize("preset", ["round_robin", "infaas", "llumnix", "lmetric", "power_of_two", "llumnix_base"])
def test_every_request_finishes_and_no_block_leaks(preset):
    spec = make_spec(preset, 3)
    cluster = SimCluster(spec.config, spec.profile, spec.instances)
    outcome = cluster.run(make_workload("S-L", rate=8.0, num_requests=80, seed=1))
    assert len(outcome.requests) == 80 and not outcome.rejected
    assert all(r.status.is_done and r.timing.finished is not None for r in outcome.requests)
    for inst in cluster.instances.values():
        engine = inst.llumlet.engine
        engine.check_integrity()
        assert not engine.has_work() and engine.snapshot().free_blocks == engine.total_blocks


def test_migrated_requests_count_once_and_finish():
    summary = small_run("llumnix")
    assert summary["requests"] == 120


def test_stale_reports_still_finish_everything():
    summary = small_run("llumnix", report_delay=0.2)
    assert summary["requests"] == 120 and math.isfinite(summary["prefill_p99"])


def test_bench_sim_writes_documented_keys(tmp_path, capsys):
    code = bench_main(["sim", "--requests", "60", "--instances", "2", "--rate", "4", "--policies", "round_robin,llumnix",
                       "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"round_robin", "llumnix"}
    for metrics in results.values():
        assert RESULT_KEYS <= set(metrics)
        assert 0 <= metrics["fragmentation_mean"] <= 1
    assert "llumnix" in capsys.readouterr().out


def test_bench_rejects_unknown_policy(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["sim", "--policies", "fastest"])
    assert exc.value.code == 2
    assert "unknown policy" in capsys.readouterr().err
