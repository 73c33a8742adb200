"""Auto-scaling's cost at equal P99 prefill, with how soon instances are drained swept beside the band.

`llumdask bench paper` sweeps the freeness band with one scale-in period (30 s) for both policies.
How long the pooled freeness must stay above the band before instances drain is a setting
whose best value depends on how an instance drains: Llumnix migrates its requests out within
seconds, INFaaS++ waits for them to finish (minutes of decoding on L-L), so draining sooner costs
INFaaS++ instances that serve little while they drain, which a scale-out then takes back.
This runs the paper's auto-scaling experiment over bands x scale-in periods for both policies on
the same requests (every seed) and reads the saving at equal P99 prefill the way the report does
(each policy's cheapest setting whose median P99 prefill meets a target): with both policies at
one period, and with each policy at its own cheapest setting (the honest comparison when the
period is the operator's choice).
"""

from __future__ import annotations

import time
from dataclasses import replace

from llumdask.benchmarks.common import float_list, parser, report, seed_range
from llumdask.benchmarks.paper import (
    AUTOSCALING, AUTOSCALING_POLICIES, Case, PaperPlan, PaperResults, Replay, autoscaling_case, replay_capacity,
    run_cases,
)
from llumdask.benchmarks.paper_report import equal_p99_savings
from llumdask.benchmarks.plots import autoscaling_frontier_figure
from llumdask.sim.run import write_json

PERIODS = (10.0, 30.0, 60.0)


def cases(plan: PaperPlan, periods: list[float]) -> list[Case]:
    """Both policies over every load, band and scale-in period of the sweep, for every seed."""
    replays = (Replay(plan.autoscale_trace, plan.autoscale_requests, seed) for seed in plan.seeds)
    capacity = {replay: replay_capacity(replay, plan.instances, plan.profile) for replay in replays}
    return [autoscaling_case(plan, capacity, seed, load, band, policy, scale_in_period=period)
            for seed in plan.seeds for load in plan.autoscale_loads for band in plan.autoscale_bands
            for period in periods for policy in AUTOSCALING_POLICIES]


def savings(medians: PaperResults, periods: list[float]) -> dict[str, list[tuple]]:
    """Every saving at equal P99 prefill (load, target, INFaaS++ cost, Llumnix cost, saving), with
    both policies at each period, and with each policy at its own cheapest setting."""
    subsets = {f"both at {p:g} s": [r for r in medians.runs if r["scale_in_period"] == p] for p in periods}
    subsets["each its cheapest"] = medians.runs
    return {name: equal_p99_savings(replace(medians, runs=runs)) for name, runs in subsets.items()}


def best_savings(medians: PaperResults, periods: list[float]) -> dict[str, tuple | None]:
    """The largest of `savings` per comparison (None: no P99 target both policies meet)."""
    return {name: max(rows, key=lambda row: row[4], default=None) for name, rows in savings(medians, periods).items()}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--periods", type=float_list, default=list(PERIODS),
                   help="scale-in periods to sweep, seconds (default %(default)s)")
    p.add_argument("--seeds", type=seed_range, default=[0, 1, 2], help="FIRST-LAST or a list (default 0-2)")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (default %(default)s)")
    args = p.parse_args(argv)
    plan = replace(PaperPlan(), seeds=tuple(args.seeds))
    if args.quick:
        plan = replace(plan, seeds=plan.seeds[:1], autoscale_loads=(0.5,), autoscale_bands=((10.0, 60.0), (40.0, 240.0)),
                       autoscale_requests=250)
    started = time.perf_counter()
    periods = sorted(args.periods)
    runs = run_cases(cases(plan, periods), args.jobs, print)
    write_json(args.out / "autoscaling_frontier_runs.json", runs)
    medians = PaperResults(plan, {}, runs, []).medians()
    rows = sorted(medians.select(AUTOSCALING), key=lambda r: (r["load"], r["policy"], r["band"], r["scale_in_period"]))
    every = savings(medians, periods)
    notes = []
    for name, best in best_savings(medians, periods).items():
        if best is None:
            notes.append(f"{name}: no P99 prefill target both policies meet")
            continue
        load, target, infaas, llumnix, saving = best
        notes.append(f"{name}: Llumnix saves {saving:.1%} of instances at P99 prefill <= {target:.2f} s, load {load:g} "
                     f"(INFaaS++ {infaas:.2f}, Llumnix {llumnix:.2f}; the work fills {load * plan.instances:.2f})")
    columns = [("load", "load", "{:g}"), ("policy", "policy", "{}"), ("band", "band", "{}"),
               ("scale_in_period", "in after s", "{:g}"), ("prefill_p99", "prefill P99 s", "{:.2f}"),
               ("prefill_mean", "prefill mean s", "{:.3f}"), ("instances_serving_mean", "mean instances", "{:.2f}"),
               ("migrations", "migrations", "{:.0f}")]
    facts = {"trace": plan.autoscale_trace, "loads": list(plan.autoscale_loads), "requests": plan.autoscale_requests,
             "initial_instances": plan.autoscale_initial_instances, "startup_delay": plan.autoscale_startup_delay,
             "profile": plan.profile, "seeds": list(plan.seeds), "periods": periods,
             "wall_seconds": round(time.perf_counter() - started, 1)}
    table = [{k: r.get(k) for k, _, _ in columns} | {"band": f"[{r['band'][0]:g}, {r['band'][1]:g}]"} for r in rows]
    # Every target's reading beside the best (too long to print).
    every_target = {name: [dict(zip(("load", "p99_target", "infaas", "llumnix", "saving"), row)) for row in rows]
                    for name, rows in every.items()}
    report("autoscaling_frontier", args.out, table, columns, facts, notes, extra={"savings": every_target})
    print(f"wrote {autoscaling_frontier_figure(medians, args.out / 'autoscaling_frontier.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
