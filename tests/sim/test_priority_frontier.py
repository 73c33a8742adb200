"""The priority frontier's reading of its runs: speedups and costs per tolerance and per pool size."""

from __future__ import annotations

import pytest

from llumdask.benchmarks.priority_frontier import best_within_bound, frontier
from llumdask.benchmarks.paper import PaperPlan
from llumdask.engine.headroom import Headroom


def run(policy: str, seed: int, high: float, normal: float, **variant) -> dict:
    return {"policy": policy, "seed": seed, "cv": 1.0, "high_e2e_mean": high, "normal_e2e_mean": normal,
            "high_solo_e2e_mean": 3.0, **variant}


def test_each_variant_is_read_against_base_on_the_same_seed():
    headroom = Headroom(tokens=1000, near_ideal_tokens=200, tolerance=0.1, sequence_tokens=100, ceiling=1.5)
    runs = [
        run("llumnix_base", 0, 4.0, 5.0), run("llumnix_base", 1, 8.0, 10.0),
        run("llumnix", 0, 2.0, 5.5, headroom_tokens=1000), run("llumnix", 1, 4.0, 11.0, headroom_tokens=1000),
        run("priority_pools", 0, 3.2, 5.1, pool_instances=3), run("priority_pools", 1, 6.4, 10.2, pool_instances=3),
        run("priority_pools", 0, 2.0, 6.0, pool_instances=6), run("priority_pools", 1, 5.0, 12.0, pool_instances=6),
    ]
    rows = frontier(runs, {0.1: headroom}, [3, 6], (1.0,))
    assert [(r["policy"], r.get("tolerance"), r.get("pool_instances")) for r in rows] == [
        ("llumnix", 0.1, None), ("priority_pools", None, 3), ("priority_pools", None, 6)]
    llumnix, three, six = rows
    assert llumnix["speedup_cv1"] == pytest.approx(2.0) and llumnix["cost_cv1"] == pytest.approx(0.1)
    assert three["speedup_cv1"] == pytest.approx(1.25) and three["cost_cv1"] == pytest.approx(0.02)
    # Seeds 0 and 1: speedups 2.0 and 1.6, costs +20% each; the ceiling is base over solo.
    assert six["speedup_cv1"] == pytest.approx(1.8) and six["cost_cv1"] == pytest.approx(0.2)
    assert six["ceiling_cv1"] == pytest.approx((4.0 / 3.0 + 8.0 / 3.0) / 2)
    assert best_within_bound(rows, "priority_pools") is three
    assert best_within_bound(rows, "llumnix") is None


def test_quick_plan_cases_cover_base_every_tolerance_and_every_pool():
    from llumdask.benchmarks.priority_frontier import cases

    todo, headrooms = cases(PaperPlan(), [0.1, 0.2], [2, 4])
    per_setting = {(c.seed, c.cv) for c in todo}
    assert len(todo) == len(per_setting) * 5
    assert sorted(headrooms) == [0.1, 0.2]
    assert {c.pool_instances for c in todo if c.policy == "priority_pools"} == {2, 4}
    assert all(c.pool_instances is None for c in todo if c.policy != "priority_pools")


@pytest.mark.parametrize("seeds", ["x", "2-1", "0,0", "-1"])
def test_bad_seeds_are_refused_before_anything_runs(seeds, capsys):
    from llumdask.benchmarks.priority_frontier import main

    with pytest.raises(SystemExit) as exit_:
        main(["--seeds", seeds])
    assert exit_.value.code == 2 and "--seeds" in capsys.readouterr().err
