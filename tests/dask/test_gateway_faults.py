"""The gateway fault benchmark at its smallest, for the fault no other test covers: one of two
gateways killed under load. The other gateway's clients get every completion exactly; the dead
gateway's requests end on the instances and leave no block behind."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_killing_one_of_two_gateways_under_load_leaves_the_other_s_clients_untouched(tmp_path):
    from llumdask.benchmarks.gateway_faults import main

    assert main(["--quick", "--faults", "kill_gateway", "--instances", "2", "--out", str(tmp_path / "out"),
                 "--logs", str(tmp_path / "logs")]) == 0
    result = json.loads((tmp_path / "out" / "gateway_faults_quick.json").read_text())
    (row,) = result["rows"]
    assert row["failed"] == 0 and row["wrong_text"] == 0, result["notes"]
    assert row["exact"] == row["requests"] > 0
    # Streams of both gateways were in flight when it died: the living gateway's all completed.
    assert row["in_flight_at_fault"] > 0 and row["in_flight_exact"] == row["in_flight_at_fault"]
    assert row["cut_with_gateway"] > 0
    assert row["leaked_blocks"] == 0 and row["instances_after_min"] == 2
    assert result["facts"]["goals_met"]
