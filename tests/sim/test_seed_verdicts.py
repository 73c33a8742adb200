"""Serving verdicts over many seeds: each seed a paired comparison, the worst router named."""

from __future__ import annotations

import argparse
import json

import pytest

from llumdask.benchmarks.paper import BASELINES, PaperPlan, Replay, replay_capacity
from llumdask.benchmarks.seed_verdicts import cases, gamma_cv, judged, policy_set, seed_range, setting, verdicts


def run(policy: str, seed: int, decode_p99: float, **metrics: float) -> dict:
    values = {"prefill_p99": 1.0, "prefill_mean": 1.0, "e2e_mean": 1.0, "preemption_count": 10} | metrics
    return {"trace": "L-L", "load": 1.0, "policy": policy, "seed": seed, "decode_p99": decode_p99, **values}


def test_each_metric_is_read_against_the_router_llumnix_compares_worst_with_seed_by_seed():
    runs = []
    for seed, (ours, infaas) in enumerate([(2.0, 1.0), (0.5, 1.0), (3.0, 1.0), (1.2, 1.0)]):
        runs.append(run("llumnix", seed, ours))
        runs.append(run("infaas", seed, infaas))
        runs += [run(b, seed, 10.0, preemption_count=0) for b in BASELINES if b != "infaas"]
    rows = {r["metric"]: r for r in verdicts(runs)}
    decode = rows["decode_p99"]
    assert decode["router"] == "infaas" and decode["per_seed"] == "2.00 0.50 3.00 1.20"
    assert decode["median"] == pytest.approx(1.6) and decode["first_seeds_median"] == pytest.approx(2.0)
    assert (decode["better"], decode["seeds"]) == (1, 4)
    # Routers that never preempt give no finite ratio: the worst finite one is named.
    assert rows["preemption_count"]["router"] == "infaas" and rows["preemption_count"]["median"] == 1.0
    # Another setup of Llumnix's is judged the same way, by its own runs.
    others = [{**r, "policy": "llumnix_no_migration", "decode_p99": 0.5} for r in runs if r["policy"] == "llumnix"]
    mine = {r["metric"]: r for r in verdicts([*runs, *others], "llumnix_no_migration")}
    assert mine["decode_p99"]["router"] == "infaas" and mine["decode_p99"]["per_seed"] == "0.50 0.50 0.50 0.50"


def test_cases_run_every_router_and_llumnix_at_each_seeds_own_rate():
    plan = PaperPlan()
    todo = cases(plan, [("S-L", 0.9)], [0, 4])
    assert len(todo) == 2 * (len(BASELINES) + 1)
    assert {c.policy for c in todo} == {*BASELINES, "llumnix"}
    for c in todo:
        assert c.rate == 0.9 * replay_capacity(Replay("S-L", plan.requests, c.seed), plan.instances, plan.profile)
    assert len({c.rate for c in todo}) == 2
    assert all(c.cv is None for c in todo)  # Poisson, as the sweep
    bursty = cases(plan, [("S-L", 0.9)], [0], "llumnix_no_migration", 4.0)
    assert {c.policy for c in bursty} == {*BASELINES, "llumnix_no_migration"} and {c.cv for c in bursty} == {4.0}


def test_bad_settings_and_seeds_are_refused_with_the_expected_form():
    assert setting("sharegpt:0.9") == ("sharegpt", 0.9)
    assert seed_range("3-5") == [3, 4, 5] and seed_range("0,7") == [0, 7]
    for bad in ("L-L", "L-L:", ":1", "L-L:0", "L-L:x", "L-L:nan", "L-L:inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="TRACE:LOAD"):
            setting(bad)
    for bad in ("", "a-b", "5-3", "1,1", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="seeds"):
            seed_range(bad)
    assert policy_set("llumnix, infaas") == {"llumnix", "infaas"}
    for bad in ("", ",", "llumnix,nonesuch"):
        with pytest.raises(argparse.ArgumentTypeError, match="policies"):
            policy_set(bad)
    assert judged("llumnix_no_migration") == "llumnix_no_migration"
    for bad in ("infaas", "oracle", "nonesuch"):  # a router, the oracle: nothing of Llumnix's to judge
        with pytest.raises(argparse.ArgumentTypeError, match="llumnix_no_migration"):
            judged(bad)
    assert gamma_cv("4") == 4.0
    for bad in ("0", "-1", "x", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="coefficient of variation"):
            gamma_cv(bad)


@pytest.mark.slow
def test_a_quick_run_writes_every_run_and_a_verdict_per_metric(tmp_path):
    from llumdask.benchmarks.seed_verdicts import METRICS, main

    assert main(["--quick", "--setting", "S-L:0.9", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "seed_verdicts_runs.json").read_text())["runs"]
    assert sorted(r["policy"] for r in runs) == sorted((*BASELINES, "llumnix")) and {r["seed"] for r in runs} == {1}
    rows = json.loads((tmp_path / "seed_verdicts.json").read_text())["rows"]
    assert [r["metric"] for r in rows] == list(METRICS) and all(r["seeds"] == 1 for r in rows)
    # Llumnix again, the routers kept: the same verdicts (the simulator is deterministic); runs
    # asked for that the file lacks are refused, not run in part.
    assert main(["--quick", "--setting", "S-L:0.9", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path),
                 "--rerun", "llumnix"]) == 0
    assert json.loads((tmp_path / "seed_verdicts.json").read_text())["rows"] == rows
    again = json.loads((tmp_path / "seed_verdicts_runs.json").read_text())["runs"]
    assert [{k: v for k, v in r.items() if k != "wall_seconds"} for r in again] == \
        [{k: v for k, v in r.items() if k != "wall_seconds"} for r in runs]
    with pytest.raises(SystemExit, match="holds 4 of the 8 runs to keep"):
        main(["--quick", "--setting", "S-L:0.9", "--seeds", "1,2", "--out", str(tmp_path), "--rerun", "llumnix"])
    # A setup the file has no runs of is run beside the routers' kept runs.
    assert main(["--quick", "--setting", "S-L:0.9", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path),
                 "--policy", "llumnix_no_migration", "--rerun", "llumnix_no_migration"]) == 0
    beside = json.loads((tmp_path / "seed_verdicts_runs.json").read_text())["runs"]
    assert sorted(r["policy"] for r in beside) == sorted((*BASELINES, "llumnix_no_migration"))
    assert [r for r in beside if r["policy"] in BASELINES] == [r for r in again if r["policy"] in BASELINES]
    assert all(r["migrations"] == 0 for r in beside)
