"""The auto-scaling frontier: bands x scale-in periods per policy, and the saving read at equal P99."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llumdask.benchmarks.autoscaling_frontier import best_savings, cases, main
from llumdask.benchmarks.paper import AUTOSCALING, PaperPlan, PaperResults, case_config


def point(policy: str, band: tuple[float, float], period: float, p99: float, instances: float) -> dict:
    return {"experiment": AUTOSCALING, "trace": "L-L", "load": 0.5, "policy": policy, "band": band,
            "scale_in_period": period, "prefill_p99": p99, "instances_serving_mean": instances}


def test_the_saving_is_read_with_both_at_one_period_and_with_each_at_its_cheapest():
    runs = [
        # INFaaS++ drains by waiting: draining sooner costs it latency (and here instances too).
        point("infaas", (10, 60), 30, 2.0, 10.0), point("infaas", (10, 60), 10, 9.0, 10.5),
        point("infaas", (20, 120), 30, 1.0, 12.0), point("infaas", (20, 120), 10, 1.5, 11.0),
        # Llumnix migrates out: draining sooner is cheaper at the same P99.
        point("llumnix", (10, 60), 30, 1.8, 9.5), point("llumnix", (10, 60), 10, 2.0, 8.0),
        point("llumnix", (20, 120), 30, 1.0, 11.5), point("llumnix", (20, 120), 10, 1.0, 9.0),
    ]
    medians = PaperResults(replace(PaperPlan(), autoscale_loads=(0.5,)), {}, runs, [])
    best = best_savings(medians, [10.0, 30.0])
    # Both at 10 s: at P99 <= 2 s INFaaS++ needs 11 (its [20, 120]), Llumnix 8.
    assert best["both at 10 s"] == (0.5, 2.0, 11.0, 8.0, pytest.approx(1 - 8 / 11))
    # Both at 30 s: at <= 1.8 s, 12 against 9.5; at <= 2 s, 10 against 9.5.
    assert best["both at 30 s"] == (0.5, 1.8, 12.0, 9.5, pytest.approx(1 - 9.5 / 12))
    # Each its cheapest: at <= 1 s INFaaS++ has only its 30 s point (12), Llumnix its 10 s one (9).
    assert best["each its cheapest"] == (0.5, 1.0, 12.0, 9.0, pytest.approx(0.25))


def test_no_common_target_reads_as_none():
    runs = [point("infaas", (10, 60), 30, 5.0, 10.0), point("llumnix", (10, 60), 10, 1.0, 8.0)]
    medians = PaperResults(replace(PaperPlan(), autoscale_loads=(0.5,)), {}, runs, [])
    best = best_savings(medians, [10.0, 30.0])
    assert best["both at 10 s"] is None and best["both at 30 s"] is None
    assert best["each its cheapest"][1:4] == (5.0, 10.0, 8.0)


def test_cases_cover_every_band_period_and_policy_and_the_period_reaches_the_configuration():
    plan = replace(PaperPlan(), seeds=(0,), autoscale_loads=(0.25,), autoscale_bands=((10.0, 60.0), (20.0, 120.0)),
                   autoscale_requests=200)
    todo = cases(plan, [10.0, 60.0])
    assert {(c.band, c.scale_in_period, c.policy) for c in todo} == {
        (band, period, policy) for band in plan.autoscale_bands for period in (10.0, 60.0)
        for policy in ("infaas", "llumnix")}
    assert len(todo) == 8 and all(c.experiment == AUTOSCALING and c.instances == 16 for c in todo)
    scaling = case_config(todo[0]).scaling
    assert scaling.enabled and scaling.band == todo[0].band and scaling.scale_in_period == todo[0].scale_in_period
    # Without a period of its own a case keeps the configuration's (the paper sweep's cases).
    assert case_config(replace(todo[0], scale_in_period=None)).scaling.scale_in_period == 30.0
    assert " in 10s " in todo[0].label


@pytest.mark.slow
def test_quick_run_writes_every_setting_and_the_savings(tmp_path, capsys):
    assert main(["--quick", "--periods", "10,30", "--jobs", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "autoscaling_frontier.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 2 and {r["scale_in_period"] for r in data["rows"]} == {10.0, 30.0}
    assert [n.split(":")[0] for n in data["notes"]] == ["both at 10 s", "both at 30 s", "each its cheapest"]
    assert data["facts"]["periods"] == [10.0, 30.0]
    assert (tmp_path / "autoscaling_frontier.png").read_bytes().startswith(b"\x89PNG")
    runs = json.loads((tmp_path / "autoscaling_frontier_runs.json").read_text())
    assert len(runs) == len(data["rows"]) and {r["seed"] for r in runs} == {0}
    assert set(data["savings"]) == {"both at 10 s", "both at 30 s", "each its cheapest"}
    assert all(set(row) == {"load", "p99_target", "infaas", "llumnix", "saving"}
               for rows in data["savings"].values() for row in rows)


def test_bad_periods_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--periods", "0,30", "--out", str(tmp_path)])
    assert "--periods: need positive numbers" in capsys.readouterr().err
