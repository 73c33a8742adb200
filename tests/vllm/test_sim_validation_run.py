"""The simulator-vs-real benchmark end to end at a tiny size: a profile measured by two processes,
a real two-instance vLLM cluster replaying a dozen multi-turn requests (conversations: first turns
open loop, later ones closed loop), the simulator replaying the same trace. Behaviour only (every
request completes, the documented JSON, the prefix cache hit on both sides), not accuracy."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

METRIC_KEYS = {"ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"}
ROW_KEYS = {"metric", "key", "real_ms", "engine_ms", "engine_error", "engine_within_goal",
            "served_ms", "served_error", "served_within_goal"}
FACT_KEYS = {"model", "requests", "rate", "policy", "instances", "request_path_ms", "per_step_ms", "per_seq_ms",
             "real_completed", "sim_completed", "real_migrations", "sim_migrations", "goal", "probe_drift"}


def test_a_small_run_completes_every_request_and_writes_the_documented_json(vllm_ready, tmp_path, capsys):
    from llumdask.benchmarks.sim_validation import main

    # Seed 1: its conversations' later turns (four) all come within about 12 s; seed 0's last one
    # waits out think times until 58 s.
    # One round of each probe before the trace and after it: enough to fit the costs.
    code = main(["--trace", "multi-turn", "--requests", "12", "--rate", "6", "--seed", "1", "--probe-rounds", "1",
                 "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "sim_validation_multi_turn.json").read_text())
    assert set(result) == {"benchmark", "facts", "rows", "notes", "machine"}
    facts = result["facts"]
    assert FACT_KEYS <= set(facts)
    assert facts["real_completed"] == facts["sim_completed"] == facts["requests"] == 12 and facts["probe_rounds"] == 1
    # Later turns resend their history: both the instances and the sim engine find some of it cached.
    assert 0 < facts["real_hit_rate"] < 1 and 0 < facts["sim_hit_rate"] < 1
    # Fitted costs (a negative fit counts as none) in milliseconds, not seconds: a unit slip or a
    # fit gone wrong shows here.
    assert all(math.isfinite(facts[k]) and 0 <= facts[k] < bound
               for k, bound in (("request_path_ms", 1_000), ("per_step_ms", 100), ("per_seq_ms", 100)))
    # The probes ran before and after the trace: every probe's drift is a ratio of two medians.
    assert set(facts["probe_drift"]) == {f"{p}_{m}" for p in ("lone", "batched", "long") for m in ("ttft", "tpot")}
    assert all(math.isfinite(v) and v > 0 for v in facts["probe_drift"].values())
    assert {row["key"] for row in result["rows"]} == METRIC_KEYS
    for row in result["rows"]:
        assert ROW_KEYS <= set(row)
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("real_ms", "engine_ms", "served_ms"))
        assert all(math.isfinite(row[k]) for k in ("engine_error", "served_error"))
    measured = tmp_path / "logs" / "sim_validation"
    assert not (measured / "trace.csv").exists()  # no trace file says which turn follows which
    assert json.loads((measured / "sim-validation.json").read_text())["block_size"] == 128
    assert json.loads((measured / "sim-validation-served.json").read_text())["name"] == "sim-validation-served"
    assert "TTFT mean" in capsys.readouterr().out
