"""The simulator runs the production core on a virtual clock: deterministic, leak-free, CLI contract."""

from __future__ import annotations

import json
import math

import pytest

from dataclasses import replace

from llumdask.api.bench import main as bench_main
from llumdask.config import load_config
from llumdask.engine.latency import load_profile
from llumdask.request import Priority
from llumdask.sim.cluster import SimCluster, SimulatorSettings
from llumdask.sim.run import make_spec, simulate
from llumdask.sim.workload import TraceRequest, make_workload

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


def test_tiny_trace_worked_out_by_hand(tmp_path):
    """One instance of 4 blocks x 4 tokens; prefill 1 ms per token, decode 10 ms per step.

    t=0      A and B (6-token prompts, 4 output tokens) are admitted: 2 blocks each, pool full.
    t=0.012  both prefilled (12 tokens): first tokens. C (arrived at 0.001) waits for a block.
    t=0.022, 0.032  decodes 2 and 3; the KV of 8 tokens fills each request's 2 blocks.
    t=0.032  A needs a third block: B, the latest arrival, is preempted (blocks freed).
    t=0.042  A's fourth token: A finishes and frees its 3 blocks.
    t=0.042  B recomputes its 9 tokens and C prefills its 4 together (13 ms).
    t=0.055  B's fourth token (preemption loss 0.055 - 0.032) and C's only token.
    """
    profile = tmp_path / "hand.json"
    profile.write_text(json.dumps({
        "name": "hand", "capacity_tokens": 16, "block_size": 4, "model_kv_bytes_per_token": 1,
        "prefill": {"base_s": 0.0, "per_token_s": 0.001, "per_token_squared_s": 0.0},
        "decode": {"base_s": 0.01, "per_seq_s": 0.0, "per_context_token_s": 0.0},
        "derivation": "round numbers for a hand-worked test",
    }))
    config = load_config({"block-size": 4, "migration": {"enabled": False}})
    config = replace(config, sim_engine=replace(config.sim_engine, profile=str(profile), total_blocks=4, kv_bytes_per_token=0))
    cluster = SimCluster(config, load_profile(str(profile)), 1)
    outcome = cluster.run([
        TraceRequest(0.0, 6, 4, Priority.NORMAL), TraceRequest(0.0, 6, 4, Priority.NORMAL), TraceRequest(0.001, 4, 1, Priority.NORMAL),
    ])
    timing = {r.request_id: r.timing for r in outcome.requests}
    a, b, c = timing["req-0"], timing["req-1"], timing["req-2"]
    assert (a.first_token, a.finished, a.preemptions) == (pytest.approx(0.012), pytest.approx(0.042), 0)
    assert (b.first_token, b.finished, b.preemptions) == (pytest.approx(0.012), pytest.approx(0.055), 1)
    assert b.preemption_loss == pytest.approx(0.055 - 0.032)
    assert c.prefill_latency == pytest.approx(0.055 - 0.001)
