"""The soak benchmark at its smallest (`--quick`: half a minute): real scheduler, worker and gateway
processes at about 80% of measured capacity, requests migrated while they stream, one worker added
and one drained and retired meanwhile. Behaviour: no request fails or stalls (the capacity probe's
streams, started together right after the gateway comes up, included), no block leaks, no process
grows by a tenth after warm-up."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_half_a_minute_of_load_through_a_scale_cycle_loses_nothing(tmp_path):
    from llumdask.benchmarks.soak import main

    assert main(["--quick", "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")]) == 0
    result = json.loads((tmp_path / "out" / "soak_quick.json").read_text())
    facts = result["facts"]
    # Poisson arrivals at 80% of the capacity measured this run: their count follows the machine's
    # speed (about 60 on an idle machine, 49 on a slow one), within chance of rate x seconds.
    assert facts["rate_rps"] == pytest.approx(0.8 * facts["capacity_rps"])
    assert facts["requests"] > 30 and facts["requests"] >= 0.6 * facts["rate_rps"] * facts["seconds"]
    assert facts["failed"] == 0 and facts["stalled"] == 0, result["notes"]
    assert facts["probe_requests"] >= 48 and facts["probe_failed"] == 0 and facts["probe_stalled"] == 0, result["notes"]
    assert facts["leaked_blocks"] == 0 and facts["instances_not_clean"] == []
    assert facts["scale_out_s"] > 0 and facts["scale_in_s"] > 0 and facts["drained"]
    # Requests moved while they streamed: forced by the operator every 5 s, and off the drained instance.
    assert facts["forced_migrations"] >= 3 and facts["migrations"] >= facts["forced_migrations"]
    # Memory is watched for the processes that ran throughout (the drained worker left).
    processes = {row["process"] for row in result["rows"]}
    assert {"scheduler", "gateway"} <= processes and len(processes) == 4
    assert all(row["rss_end_mib"] > 10 for row in result["rows"])
    assert facts["rss_growth_max"] < facts["rss_goal"], result["rows"]
    assert facts["goals_met"]
