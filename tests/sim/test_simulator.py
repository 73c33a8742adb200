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
from llumdask.sim.workload import TraceRequest, make_workload, write_trace

RESULT_KEYS = {
    "prefill_mean", "prefill_p99", "decode_mean", "decode_p99", "e2e_mean", "e2e_p99",
    "preemption_loss_mean", "fragmentation_mean", "instances_mean", "migrations", "preemptions_with_room",
}


def small_run(preset: str, seed: int = 3, **settings):
    workload = make_workload("M-M", rate=6.0, num_requests=120, seed=seed)
    return simulate(make_spec(preset, 3, settings=SimulatorSettings(**settings)), workload)


def test_same_seed_same_results():
    first, second = small_run("llumnix"), small_run("llumnix")
    for run in (first, second):
        run.pop("wall_seconds"), run.pop("peak_rss_mib")
    assert json.dumps(first, sort_keys=True, default=str) == json.dumps(second, sort_keys=True, default=str)
    assert small_run("llumnix", seed=4)["e2e_mean"] != first["e2e_mean"]


def test_llumnix_without_migration_is_llumnix_but_for_migration():
    ours, ablated = make_spec("llumnix", 2).config, make_spec("llumnix_no_migration", 2).config
    assert ours.migration.enabled and not ablated.migration.enabled
    assert replace(ablated, migration=ours.migration) == ours


@pytest.mark.parametrize("preset", ["round_robin", "infaas", "llumnix", "lmetric", "power_of_two", "llumnix_base",
                                    "llumnix_no_migration"])
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


def test_admission_by_load_refuses_requests_past_capacity_and_serves_the_rest():
    base = load_config({"dispatch": {"admission-freeness": 0.0}})
    spec = make_spec("llumnix", 2, base=base)
    cluster = SimCluster(spec.config, spec.profile, spec.instances)
    workload = make_workload("L-L", rate=20.0, num_requests=120, seed=2)  # several times what 2 instances serve
    outcome = cluster.run(workload)
    assert outcome.rejected and len(outcome.rejected) + len(outcome.requests) == len(workload)
    assert all(r.status.is_done and r.timing.finished is not None for r in outcome.requests)
    unrefused = SimCluster(make_spec("llumnix", 2).config, spec.profile, spec.instances).run(workload)
    assert not unrefused.rejected
    worst_wait = max(r.timing.first_token - r.arrival_time for r in outcome.requests)
    assert worst_wait < max(r.timing.first_token - r.arrival_time for r in unrefused.requests)


def test_past_capacity_requests_wait_at_the_scheduler_and_every_one_finishes():
    spec = make_spec("llumnix", 2)
    workload = make_workload("L-L", rate=20.0, num_requests=120, seed=2)  # several times what 2 instances serve
    cluster = SimCluster(spec.config, spec.profile, spec.instances)
    outcome = cluster.run(workload)
    assert len(outcome.requests) == len(workload) and not outcome.rejected and not cluster.scheduler.held
    assert all(r.status.is_done for r in outcome.requests)
    waited = [r for r in outcome.requests if r.timing.dispatched - r.arrival_time > 1.0]
    assert waited  # held, then placed: their first token counts from arrival
    assert all(r.timing.first_token - r.arrival_time > r.timing.dispatched - r.arrival_time for r in waited)
    assert any(s.held_demand for s in outcome.samples)
    off = make_spec("llumnix", 2, base=load_config({"dispatch": {"hold-freeness": None}}))
    queued = SimCluster(off.config, off.profile, off.instances).run(workload)
    assert all(r.timing.dispatched == r.arrival_time for r in queued.requests)


def test_migrated_requests_count_once_and_finish():
    summary = small_run("llumnix")
    assert summary["requests"] == 120
    # Each committed migration moved a request once: some requests moved, none more often than counted.
    assert 0 < summary["migrated_requests"] <= summary["migrations"]


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


def test_bench_sim_replays_a_trace_file_at_its_own_times(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    # 30 requests over 29 s: 1 req/s, far from the default rate of generated traces.
    write_trace(trace, [TraceRequest(float(i), 64, 8) for i in range(30)])
    code = bench_main(["sim", "--trace", str(trace), "--instances", "2", "--policies", "llumnix", "--out", str(tmp_path),
                       "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())["llumnix"]
    assert result["requests"] == 30
    assert result["makespan"] == pytest.approx(29 + result["e2e_p99"], rel=0.05)
    assert "its own arrival times, 30 requests" in capsys.readouterr().out
    code = bench_main(["sim", "--trace", str(trace), "--instances", "2", "--policies", "llumnix", "--rate", "29",
                       "--requests", "10", "--out", str(tmp_path), "--no-progress"])
    result = json.loads((tmp_path / "results.json").read_text())["llumnix"]
    assert result["requests"] == 10 and result["makespan"] < 2


def test_bench_rejects_unknown_policy(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["sim", "--policies", "fastest"])
    assert exc.value.code == 2
    assert "unknown policy" in capsys.readouterr().err


SIM_ARGS = ["sim", "--requests", "20", "--instances", "2", "--policies", "llumnix", "--no-progress"]


@pytest.mark.parametrize(("option", "value"), [
    ("--rate", "nan"), ("--rate", "inf"), ("--cv", "-1"), ("--cv", "nan"), ("--high-priority-share", "2"),
    ("--high-priority-share", "nan"), ("--report-delay", "-1"), ("--report-delay", "inf"), ("--report-delay", "nan"),
    ("--bandwidth", "nan"), ("--bandwidth", "inf"), ("--seed", "-1"), ("--profile", "nosuch"),
])
def test_bench_sim_rejects_bad_options_naming_them(option, value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main([*SIM_ARGS, option, value])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_bench_sim_names_a_bad_configuration_as_such(capsys, monkeypatch):
    monkeypatch.setenv("DASK_LLUMDASK__REPORT_INTERVAL", "inf")
    import dask.config

    dask.config.refresh()
    try:
        with pytest.raises(SystemExit) as exc:
            bench_main(SIM_ARGS)
    finally:
        monkeypatch.delenv("DASK_LLUMDASK__REPORT_INTERVAL")
        dask.config.refresh()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: configuration: llumdask.report-interval" in err


@pytest.mark.parametrize(("rows", "options", "message"), [
    (None, [], "no such trace file"),
    ("arrival_time,input_len\n0,10\n", [], "lacks column(s) output_len"),
    ("arrival_time,input_len,output_len\n0,10,5\n1,10,5\n", ["--requests", "3"], "num_requests=3 asks for more"),
    ("arrival_time,input_len,output_len\n0,10,5\n0,10,5\n", ["--rate", "2"], "every request arrives at once"),
    ("arrival_time,input_len,output_len\n0,10,5\n1,10,5\n", ["--cv", "1"], "cv shapes generated arrivals"),
])
def test_bench_sim_rejects_a_trace_it_cannot_replay(rows, options, message, tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    if rows is not None:
        trace.write_text(rows)
    with pytest.raises(SystemExit) as exc:
        bench_main(["sim", "--trace", str(trace), "--instances", "2", "--policies", "llumnix", "--no-progress", *options])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--trace" in err and message in err


@pytest.mark.parametrize(("out", "message"), [("file", "exists and is not a directory"), ("file/sub", "--out"),
                                              ("dangling", "leads nowhere"), ("dangling/sub", "leads nowhere")])
def test_bench_sim_checks_out_before_simulating(out, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    monkeypatch.setattr("llumdask.api.bench.simulate", lambda *a, **k: pytest.fail("simulated before checking --out"))
    with pytest.raises(SystemExit) as exc:
        bench_main([*SIM_ARGS, "--out", str(tmp_path / out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and message in err


def test_bench_sim_refused_for_a_later_option_leaves_no_out_directory(tmp_path, capsys):
    out = tmp_path / "new" / "out"
    with pytest.raises(SystemExit) as exc:
        bench_main([*SIM_ARGS, "--trace", str(tmp_path / "missing.csv"), "--out", str(out)])
    assert exc.value.code == 2 and "--trace" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_bench_sim_makes_its_out_directory_when_it_writes(tmp_path):
    out = tmp_path / "new" / "out"
    assert bench_main([*SIM_ARGS, "--out", str(out)]) == 0
    assert "llumnix" in json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("field", ["report_delay", "dispatch_delay", "stage_overhead", "message_latency",
                                   "bandwidth", "sample_interval", "scale_interval"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_simulator_settings_reject_nan_infinite_and_negative_values(field, value):
    with pytest.raises(ValueError, match=field):
        SimulatorSettings(**{field: value})


def hand_profile(directory, capacity_tokens: int, kv_bytes_per_token: int):
    """Round numbers for hand-worked timelines: blocks of 4 tokens, prefill 1 ms per token, decode 10 ms per step."""
    profile = directory / "hand.json"
    profile.write_text(json.dumps({
        "name": "hand", "capacity_tokens": capacity_tokens, "block_size": 4,
        "model_kv_bytes_per_token": kv_bytes_per_token,
        "prefill": {"base_s": 0.0, "per_token_s": 0.001, "per_token_squared_s": 0.0},
        "decode": {"base_s": 0.01, "per_seq_s": 0.0, "per_context_token_s": 0.0},
        "derivation": "round numbers for a hand-worked test",
    }))
    return profile


def test_tiny_trace_worked_out_by_hand(tmp_path):
    """One instance of 4 blocks x 4 tokens; prefill 1 ms per token, decode 10 ms per step; no
    prefix cache (a recompute starts from nothing).

    t=0      A and B (6-token prompts, 4 output tokens) are admitted: 2 blocks each, pool full.
    t=0.012  both prefilled (12 tokens): first tokens. C (arrived at 0.001) waits for a block.
    t=0.022, 0.032  decodes 2 and 3; the KV of 8 tokens fills each request's 2 blocks.
    t=0.032  A needs a third block: B, the latest arrival, is preempted (blocks freed).
    t=0.042  A's fourth token: A finishes and frees its 3 blocks.
    t=0.042  B recomputes its 9 tokens and C prefills its 4 together (13 ms).
    t=0.055  B's fourth token (preemption loss 0.055 - 0.032) and C's only token.
    """
    profile = hand_profile(tmp_path, capacity_tokens=16, kv_bytes_per_token=1)
    # The engine's own queue at work: nothing held at the scheduler.
    config = load_config({"block-size": 4, "migration": {"enabled": False}, "dispatch": {"hold-freeness": None}})
    config = replace(config, sim_engine=replace(config.sim_engine, profile=str(profile), total_blocks=4, kv_bytes_per_token=0,
                                                prefix_caching=False))
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


def test_a_preemption_is_counted_where_another_instance_had_the_room(tmp_path):
    """A and B (6-token prompts, 4 output tokens) on one instance of two, as in the timeline above;
    round-robin sends the second request to the other. B is preempted at t=0.032 needing 3 blocks
    for its 9 tokens: counted where the other's request (4 tokens, 1 output) left it empty, not where
    its own (9 tokens, 5 outputs) holds 3 of its 4 blocks then. Alone, nothing is elsewhere."""
    profile = hand_profile(tmp_path, capacity_tokens=16, kv_bytes_per_token=1)
    config = load_config({"block-size": 4, "migration": {"enabled": False},
                          "dispatch": {"policy": "round_robin", "hold-freeness": None}})
    config = replace(config, sim_engine=replace(config.sim_engine, profile=str(profile), total_blocks=4, kv_bytes_per_token=0,
                                                prefix_caching=False))
    a, b = TraceRequest(0.0, 6, 4, Priority.NORMAL), TraceRequest(0.0, 6, 4, Priority.NORMAL)
    cases = {1: [a, TraceRequest(0.0, 4, 1, Priority.NORMAL), b], 0: [a, TraceRequest(0.0, 9, 5, Priority.NORMAL), b]}
    for with_room, workload in cases.items():
        outcome = SimCluster(config, load_profile(str(profile)), 2).run(workload)
        assert (outcome.requests[0].timing.preemptions, outcome.requests[2].timing.preemptions) == (0, 1)
        assert outcome.preemptions_with_room == with_room
    alone = SimCluster(config, load_profile(str(profile)), 1).run([a, b])
    assert sum(r.timing.preemptions for r in alone.requests) == 1 and alone.preemptions_with_room == 0


def test_one_migration_worked_out_by_hand(tmp_path):
    """Two instances of 16 blocks x 4 tokens; prefill 1 ms per token, decode 10 ms per step; KV
    4,000 bytes per block over 1 MB/s (4 ms per block), 2 ms per stage, 1 ms per control message.
    Reports every 10 ms, pairing every 50 ms; sources below F = 8, destinations above F = 12.

    t=0      A (41-token prompt, 11 output tokens) goes to instance-1 (ties go to the larger id): 11 blocks.
    t=0.041  first token; then one token every 10 ms.
    t=0.010  report: instance-1 F = (16 - 11) / 1 = 5 < 8, instance-0 F = 16 > 12.
    t=0.050  pairing: instance-1 -> instance-0. A holds 43 tokens: 10 completed blocks.
             stage 0: PRE-ALLOC (1 ms), reply (1 ms), 10 blocks (1 + 2 + 40 ms), ACK (1 ms).
    t=0.096  A holds 48 tokens (its 7th token was sampled in the step that began at 0.091):
             11 completed blocks, 1 unsent <= last-stage-blocks 2: the last stage reserves the
             tail blocks_for(48) - 10 = 2 blocks plus 1 of slack: PRE-ALLOC (1 ms), reply (1 ms).
    t=0.098  A still holds 48 tokens: pause; data of 2 blocks (1 + 2 + 8 ms).
    t=0.109  instance-0 resumes A and steps at once; COMMITTED reaches the source at 0.110:
             downtime 0.110 - 0.098 = 12 ms. A's tokens 8-11 at 0.119 ... 0.149 (unmigrated: 0.141).
    Bytes: 12 blocks x 4,000. Next pairing rounds: at 0.100 both are mid-migration, at 0.150 A is gone.
    """
    profile = hand_profile(tmp_path, capacity_tokens=64, kv_bytes_per_token=1000)
    settings = SimulatorSettings(bandwidth=1e6, stage_overhead=0.002, message_latency=0.001)
    trace = [TraceRequest(0.0, 41, 11, Priority.NORMAL)]

    def run(migration: bool):
        config = load_config({"block-size": 4, "report-interval": 0.01, "migration": {
            "enabled": migration, "interval": 0.05, "low-threshold": 8.0, "high-threshold": 12.0,
            "max-stages": 6, "last-stage-blocks": 2}})
        config = replace(config, sim_engine=replace(config.sim_engine, profile=str(profile), total_blocks=16, kv_bytes_per_token=0))
        cluster = SimCluster(config, load_profile(str(profile)), 2, settings)
        return cluster, cluster.run(trace)

    cluster, outcome = run(migration=True)
    [request] = outcome.requests
    started, committed = outcome.migrations
    assert (started.kind.value, started.time, started.source, started.destination) == ("started", pytest.approx(0.05), "instance-1", "instance-0")
    assert committed.kind.value == "committed" and committed.time == pytest.approx(0.110)
    assert (committed.stages, committed.blocks, committed.bytes) == (2, 12, 48_000)
    assert committed.downtime == pytest.approx(0.012)
    assert cluster.transport.bytes_moved == 48_000
    assert request.timing.first_token == pytest.approx(0.041) and request.timing.finished == pytest.approx(0.149)
    assert (request.timing.preemptions, request.timing.migrations) == (0, 1)
    for inst in cluster.instances.values():
        engine = inst.llumlet.engine
        assert not engine.has_work() and engine.snapshot().free_blocks == engine.total_blocks == 16

    _, unmigrated = run(migration=False)
    [alone] = unmigrated.requests
    assert not unmigrated.migrations and alone.timing.finished == pytest.approx(0.141) and alone.timing.migrations == 0
    assert request.output_token_ids == alone.output_token_ids and len(alone.output_token_ids) == 11


def test_requests_in_transit_are_not_a_stall():
    """A dispatched request not yet handed to its instance (dispatch delay) is on its way, not stuck."""
    spec = make_spec("llumnix", 2, settings=SimulatorSettings(dispatch_delay=0.3, sample_interval=0.1))
    summary = simulate(spec, [TraceRequest(0.0, 100, 5, Priority.NORMAL)])
    assert summary["requests"] == 1 and summary["prefill_mean"] >= 0.3


def test_shared_system_prompts_hit_the_prefix_cache_and_unshared_prompts_never_do():
    shared = simulate(make_spec("round_robin", 3), make_workload("system-prompt", rate=4.0, num_requests=90, seed=1))
    unshared = simulate(make_spec("round_robin", 3), make_workload("S-S", rate=4.0, num_requests=90, seed=1))
    assert shared["prefix_hit_rate"] > 0.5 and unshared["prefix_hit_rate"] == 0.0
    off = replace(load_config().sim_engine, prefix_caching=False)
    spec = make_spec("round_robin", 3, base=replace(load_config(), sim_engine=off))
    no_cache = simulate(spec, make_workload("system-prompt", rate=4.0, num_requests=90, seed=1))
    assert math.isnan(no_cache["prefix_hit_rate"]) and no_cache["prefill_mean"] > shared["prefill_mean"]


def test_conversation_turns_follow_their_answers_and_find_their_history_cached():
    workload = make_workload("multi-turn", rate=1.0, num_requests=60, seed=2)
    spec = make_spec("llumnix", 3)
    cluster = SimCluster(spec.config, spec.profile, spec.instances)
    outcome = cluster.run(workload)
    by_id = {r.request_id: r for r in outcome.requests}
    assert len(by_id) == 60 and all(r.status.is_done for r in by_id.values())
    hits = 0
    for index, trace in enumerate(workload):
        if trace.after is None:
            continue
        turn, previous = by_id[f"req-{index}"], by_id[f"req-{trace.after}"]
        assert turn.arrival_time == pytest.approx(previous.timing.finished + trace.think)
        assert turn.prompt_token_ids[: previous.num_tokens] == previous.prompt_token_ids + previous.output_token_ids
        hits += (turn.timing.cached_tokens or 0) > previous.num_prompt_tokens // 2
    assert hits >= sum(t.after is not None for t in workload) // 2


def test_priority_pools_keep_high_priority_requests_on_their_own_instances():
    base = load_config({"dispatch": {"priority-pool-instances": 1}})
    spec = make_spec("priority_pools", 3, base=base)
    cluster = SimCluster(spec.config, spec.profile, spec.instances)
    placed: list[tuple[str, Priority]] = []
    admit = cluster._admit
    cluster._admit = lambda target, request: (placed.append((target, request.execution_priority)), admit(target, request))[1]
    workload = make_workload("S-S", rate=8.0, num_requests=120, seed=1, high_priority_share=0.2)
    outcome = cluster.run(workload)
    assert len(outcome.requests) == 120 and not outcome.migrations
    high = {target for target, priority in placed if priority is Priority.HIGH}
    normal = {target for target, priority in placed if priority is not Priority.HIGH}
    assert high == {"instance-0"} and normal == {"instance-1", "instance-2"}
