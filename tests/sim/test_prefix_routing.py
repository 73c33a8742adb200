"""The prefix-routing benchmark: each workload's knee, the search for each policy's highest sustained
rate, the goals, a run from an earlier report's grid, a quick run."""

from __future__ import annotations

import json

import pytest

from llumdask.benchmarks.paper import last_arrival
from llumdask.benchmarks import prefix_routing
from llumdask.benchmarks.prefix_routing import (POLICIES, PREFIX_ROUTERS, goal_rows, knees, main, refine_sustained,
                                                 sustained_rates)
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
    assert met == {"P99": True, "throughput": True, "hit": False, "imbalance": True}
    assert goals["imbalance vs prefix_affinity's"]["reference"] == 3.0
    assert goals["throughput (highest rate sustained) / best prefix router's"]["llumnix"] == 1.5
    # Sustaining only what the best router sustains does not beat it.
    sustained["system-prompt"]["llumnix"] = 2.0
    assert not {g["goal"]: g for g in goal_rows(rows, {"system-prompt": 2.0}, sustained)}[
        "throughput (highest rate sustained) / best prefix router's"]["met"]


def test_the_highest_sustained_rate_is_found_by_bisection_between_the_grid_rate_and_the_next(monkeypatch):
    """Each policy's search starts from its own grid rate; the middles of a round run together, each
    seed; a policy at the grid's top or sustaining none of it keeps its grid value."""
    capacity = {"llumnix": 52.3, "dynamo_kv": 51.1, "prefix_affinity": 80.0, "sglang_cache_aware": 10.0}
    rounds = []

    def simulate(cases, jobs, progress):
        rounds.append(sorted({(c.policy, c.load) for c in cases}))
        assert {c.seed for c in cases} == {0, 1, 2} and all(c.rate == c.load * 4 / 16 for c in cases)
        # Two of three seeds decide the median.
        return [{"trace": c.trace, "policy": c.policy, "seed": c.seed,
                 "backlog_at_last_arrival": 0 if c.load <= capacity[c.policy] or c.seed == 0 else 50} for c in cases]

    monkeypatch.setattr(prefix_routing, "run_cases", simulate)
    sustained = {"system-prompt": {"llumnix": 50.0, "dynamo_kv": 50.0, "prefix_affinity": 75.0,
                                   "sglang_cache_aware": None, "round_robin": 45.0}}
    refined, steps = refine_sustained(sustained, {"system-prompt": (40.0, 45.0, 50.0, 55.0, 75.0)}, (0, 1, 2), 4,
                                      {"system-prompt": 1000}, 3, 2)
    assert rounds[0] == [("dynamo_kv", 52.5), ("llumnix", 52.5)]
    assert refined == {"system-prompt": {"llumnix": 51.875, "dynamo_kv": 50.625, "prefix_affinity": 75.0,
                                         "sglang_cache_aware": None, "round_robin": 45.0}}
    assert [(s["policy"], s["rate"], s["sustained"]) for s in steps if s["policy"] == "llumnix"] == [
        ("llumnix", 52.5, False), ("llumnix", 51.25, True), ("llumnix", 51.875, True)]
    assert sustained["system-prompt"]["llumnix"] == 50.0  # the grid's reading is left as it was


def test_a_run_from_an_earlier_report_keeps_its_grid_and_runs_only_the_search(tmp_path, monkeypatch, capsys):
    """--refine-from reads the grid, its size and seeds from the report (one written before the
    search, with wall_seconds), runs the search alone and judges the goals on what it found."""
    # Every policy sustains 50 req/s and not 55.
    settings = [row(rate, policy, 0 if rate == 50.0 else 100, prefill_mean=0.5, migration_reused_share=None,
                    prefill_p99_vs_best_router=0.9, throughput_vs_best_router=1.0)
                for rate in (50.0, 55.0) for policy in POLICIES]
    cost = {"trace": "sharegpt", "load": 0.8, "prefill_p99_ratio": 1.0, "prefill_mean_ratio": 1.0,
            "decode_p99_ratio": 1.0}
    earlier = {"benchmark": "prefix_routing", "rows": [*settings, cost], "facts": {
        "seeds": [0, 1], "instances": 4, "requests": {"system-prompt": 1000}, "rates": {"system-prompt": [50.0, 55.0]},
        "wall_seconds": 12.5}}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    capacity = {"llumnix": 54.0, "dynamo_kv": 52.0, "prefix_affinity": 51.0, "sglang_cache_aware": 50.0}
    ran = []

    def simulate(cases, jobs, progress):
        ran.extend(cases)
        return [{"trace": c.trace, "policy": c.policy, "seed": c.seed,
                 "backlog_at_last_arrival": 0 if c.load <= capacity[c.policy] else 100} for c in cases]

    monkeypatch.setattr(prefix_routing, "run_cases", simulate)
    assert main(["--refine-from", str(tmp_path / "earlier.json"), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "prefix_routing.json").read_text())
    assert report["rows"] == earlier["rows"] and report["facts"]["grid_seconds"] == 12.5
    # Only the search ran: three rounds for Llumnix and each prefix router, the report's seeds and size.
    assert len(ran) == 3 * 4 * 2 and {c.seed for c in ran} == {0, 1} and all(50 < c.load < 55 for c in ran)
    assert all(c.requests == 1000 and c.instances == 4 and c.rate == c.load / 4 for c in ran)
    assert report["facts"]["sustained_refined"]["system-prompt"] == {
        "llumnix": 53.75, "dynamo_kv": 51.875, "prefix_affinity": 50.625, "sglang_cache_aware": 50.0,
        "round_robin": 50.0, "infaas": 50.0, "llumnix_no_prefix": 50.0}
    assert report["facts"]["sustained"]["system-prompt"]["llumnix"] == 50.0
    # The goal compares the rates the search found.
    goal = {g["goal"]: g for g in report["goals"]}["throughput (highest rate sustained) / best prefix router's"]
    assert goal["llumnix"] == 53.75 / 51.875 and goal["met"]
    for extra in (["--quick"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            main(["--refine-from", str(tmp_path / "earlier.json"), "--out", str(tmp_path / "refused"), *extra])
        assert "leave out --quick and --seeds" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_workload_run_again_replaces_its_settings_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    """--rerun runs the workload's grid again at the benchmark's requests and rates (the earlier
    report's seeds and instances), keeps the other workload's and the no-cost rows, then searches."""
    turns = [{**row(4.5, policy, 0, prefill_mean=0.5, migration_reused_share=None, prefill_p99_vs_best_router=0.9,
                    throughput_vs_best_router=1.0), "trace": MULTI_TURN} for policy in POLICIES]
    stale = row(50.0, "llumnix", 0, prefill_mean=0.5, migration_reused_share=None, prefill_p99_vs_best_router=0.9,
                throughput_vs_best_router=1.0)
    cost = {"trace": "sharegpt", "load": 0.8, "prefill_p99_ratio": 1.0, "prefill_mean_ratio": 1.0,
            "decode_p99_ratio": 1.0}
    earlier = {"benchmark": "prefix_routing", "rows": [stale, *turns, cost], "facts": {
        "seeds": [0, 1], "instances": 16, "requests": {SYSTEM_PROMPT: 3000, MULTI_TURN: 2000},
        "rates": {SYSTEM_PROMPT: [50.0], MULTI_TURN: [4.5]}, "grid_seconds": 12.5}}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    grid, ran = prefix_routing.RATES[SYSTEM_PROMPT], []

    def simulate(cases, jobs, progress):
        ran.extend(cases)
        return [{"trace": c.trace, "policy": c.policy, "seed": c.seed, "load": c.load, "finished": 10, "makespan": 5.0,
                 "prefill_p99": 1.0, "prefill_mean": 0.5, "prefix_hit_rate": 0.5, "imbalance": 2.0, "migrations": 0,
                 "migration_reused_share": float("nan"), "backlog_at_last_arrival": 0 if c.load <= grid[1] else 1000}
                for c in cases]

    monkeypatch.setattr(prefix_routing, "run_cases", simulate)
    args = ["--refine-from", str(tmp_path / "earlier.json"), "--rerun", SYSTEM_PROMPT, "--out", str(tmp_path / "out")]
    assert main(args) == 0
    report = json.loads((tmp_path / "out" / "prefix_routing.json").read_text())
    grid_cases = ran[:len(grid) * 2 * len(POLICIES)]
    assert {(c.load, c.seed, c.policy) for c in grid_cases} == {(r, s, p) for r in grid for s in (0, 1) for p in POLICIES}
    assert all(c.trace == SYSTEM_PROMPT and c.requests == prefix_routing.REQUESTS[SYSTEM_PROMPT] and c.instances == 16
               for c in grid_cases)
    assert all(grid[1] < c.load < grid[2] for c in ran[len(grid_cases):])  # then only the search, above the grid's knee
    rows = [r for r in report["rows"] if "policy" in r]
    assert stale not in rows and all(t in rows for t in turns) and cost in report["rows"]
    assert {r["rate"] for r in rows if r["trace"] == SYSTEM_PROMPT} == set(grid)
    assert report["facts"]["requests"][SYSTEM_PROMPT] == prefix_routing.REQUESTS[SYSTEM_PROMPT]
    assert report["facts"]["rates"][SYSTEM_PROMPT] == list(grid) and report["facts"]["knees"][SYSTEM_PROMPT] == grid[1]
    assert report["facts"]["grid_seconds"] >= 12.5
    with pytest.raises(SystemExit):
        main(["--rerun", SYSTEM_PROMPT, "--out", str(tmp_path / "refused")])
    assert "--rerun needs --refine-from" in capsys.readouterr().err
    (tmp_path / "quick.json").write_text(json.dumps(earlier | {"benchmark": "prefix_routing_quick"}))
    with pytest.raises(SystemExit):
        main(["--refine-from", str(tmp_path / "quick.json"), "--rerun", SYSTEM_PROMPT, "--out", str(tmp_path / "refused")])
    assert "not a --quick one" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


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
    assert len(report["goals"]) == 4 * len(rates) and all(isinstance(g["met"], bool) for g in report["goals"])
    assert {r["trace"] for r in report["rows"] if "prefill_p99_ratio" in r} == {"sharegpt", "M-M"}
    # The search starts at each policy's grid rate and stays below the grid's next: one round (quick)
    # for each of Llumnix and the routers that sustain the lowest rate and not the highest.
    searched = [p for p in ("llumnix", *PREFIX_ROUTERS) for trace, grid in rates.items()
                if report["facts"]["sustained"][trace][p] == min(grid)]
    assert len(report["refinement"]) == len(searched)
    for step in report["refinement"]:
        grid = rates[step["trace"]]
        start = report["facts"]["sustained"][step["trace"]][step["policy"]]
        assert start < step["rate"] < min(r for r in grid if r > start)
