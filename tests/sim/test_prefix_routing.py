"""The prefix-routing benchmark: each workload's knee, the goals judged there, a quick run."""

from __future__ import annotations

import json

import pytest

from llumdask.benchmarks.paper import last_arrival
from llumdask.benchmarks import prefix_routing
from llumdask.benchmarks.prefix_routing import POLICIES, PREFIX_ROUTERS, goal_rows, knees, main, sustained_rates
from llumdask.sim.workload import MULTI_TURN, SYSTEM_PROMPT, make_workload


def row(rate: float, policy: str, backlog: float, **metrics: float) -> dict:
    values = {"prefill_p99": 1.0, "throughput": 1.0, "prefix_hit_rate": 0.5, "imbalance": 2.0} | metrics
    return {"trace": "system-prompt", "rate": rate, "policy": policy, "backlog_at_last_arrival": backlog, **values}


def test_the_knee_is_the_highest_rate_one_prefix_router_sustains():
    rows = [
        row(1.0, "dynamo_kv", 0), row(1.0, "prefix_affinity", 40),
        # A router may sustain a rate above one it did not: the highest sustained one counts.
        row(2.0, "dynamo_kv", 11), row(2.0, "sglang_cache_aware", 10),
        row(3.0, "dynamo_kv", 30), row(3.0, "prefix_affinity", 12),
        # Llumnix sustaining a rate does not move the knee: it is the routers' limit.
        row(4.0, "llumnix", 0), row(4.0, "dynamo_kv", 50),
    ]
    assert knees(sustained_rates(rows, {"system-prompt": 1000}), rows) == {"system-prompt": 2.0}
    # Where no router sustains any rate, the lowest.
    later = [r for r in rows if r["rate"] > 2.0]
    assert knees(sustained_rates(later, {"system-prompt": 1000}), later) == {"system-prompt": 3.0}
    # Each policy's own highest sustained rate; None for one that sustains none.
    assert sustained_rates(rows, {"system-prompt": 1000}) == {"system-prompt": {
        "dynamo_kv": 1.0, "prefix_affinity": None, "sglang_cache_aware": 2.0, "llumnix": 4.0}}


def test_goals_compare_llumnix_with_the_best_router_round_robin_and_prefix_affinity_at_the_knee():
    rows = [
        row(2.0, "llumnix", 0, prefill_p99_vs_best_router=0.9, throughput_vs_best_router=1.0,
            prefix_hit_rate=0.6, imbalance=2.5),
        row(2.0, "round_robin", 0, prefix_hit_rate=0.6),
        row(2.0, "prefix_affinity", 0, imbalance=3.0),
        # Another rate's rows are not read.
        row(3.0, "llumnix", 0, prefill_p99_vs_best_router=2.0, throughput_vs_best_router=0.5),
    ]
    sustained = {"system-prompt": {"llumnix": 3.0, "dynamo_kv": 2.0, "prefix_affinity": None}}
    goals = {g["goal"]: g for g in goal_rows(rows, {"system-prompt": 2.0}, sustained)}
    assert {g["rate"] for g in goals.values()} == {2.0}
    met = {name.split(" ")[0]: g["met"] for name, g in goals.items()}
    # A hit rate equal to round-robin's is not higher.
    assert met == {"P99": True, "throughput": True, "highest": True, "hit": False, "imbalance": True}
    assert goals["imbalance vs prefix_affinity's"]["reference"] == 3.0
    assert goals["highest rate sustained / best prefix router's"]["llumnix"] == 1.5
    # Sustaining only what the best router sustains does not beat it.
    sustained["system-prompt"]["llumnix"] = 2.0
    assert not {g["goal"]: g for g in goal_rows(rows, {"system-prompt": 2.0}, sustained)}[
        "highest rate sustained / best prefix router's"]["met"]


def test_a_conversations_last_turn_does_not_stand_for_the_last_arrival():
    workload = make_workload(MULTI_TURN, rate=4.0, num_requests=200, seed=0)
    firsts = [r.arrival for r in workload if r.after is None]
    assert last_arrival(workload) == max(firsts) and any(r.arrival > max(firsts) for r in workload)
    assert last_arrival([]) == 0.0


@pytest.mark.slow
def test_a_quick_run_writes_every_setting_the_knees_and_the_goals(tmp_path, monkeypatch):
    # A third of the quick run's requests: what is checked here is the report's shape.
    monkeypatch.setattr(prefix_routing, "REQUESTS", {SYSTEM_PROMPT: 1000, MULTI_TURN: 600})
    assert main(["--quick", "--seeds", "0", "--jobs", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix_routing_quick.json").read_text())
    rates = report["facts"]["rates"]
    shared = [r for r in report["rows"] if "policy" in r]
    assert sorted((r["trace"], r["rate"], r["policy"]) for r in shared) == sorted(
        (trace, rate, p) for trace, grid in rates.items() for rate in grid for p in POLICIES)
    assert all(r["seeds"] == 1 and r["backlog_at_last_arrival"] >= 0 for r in shared)
    # Only policies that migrate say what share of the moved blocks the destination held.
    assert all(r["migration_reused_share"] is None for r in shared if r["policy"] in PREFIX_ROUTERS)
    assert set(report["facts"]["knees"]) == set(rates) == set(report["facts"]["sustained"])
    assert all(knee in rates[trace] for trace, knee in report["facts"]["knees"].items())
    assert len(report["goals"]) == 5 * len(rates) and all(isinstance(g["met"], bool) for g in report["goals"])
    assert {r["trace"] for r in report["rows"] if "prefill_p99_ratio" in r} == {"sharegpt", "M-M"}
