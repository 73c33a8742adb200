"""Priority headroom's trade-off: high-priority speedup against normal-priority cost, per tolerance,
beside dedicated pools.

The priorities experiment of `llumdask bench paper` runs Llumnix with one headroom, derived from
the latency profile at one tolerance (a high-priority decode step within 10% of a lone
sequence's). A larger headroom (a tighter tolerance) speeds high-priority requests up and makes
normal ones pay for it. This sweeps the tolerance on the same setting (S-S, 10% high priority,
Gamma arrivals of each CV, 16 simulated instances, every seed), each beside Llumnix-base on the
same requests, and reads off the frontier: per tolerance, the median over seeds of
base / Llumnix high-priority mean latency and of the normal-priority cost, per CV; and the best
speedup whose cost stays within the paper's bound (+4.5%) at every CV.

The reference frontier is isolation without rescheduling: `priority_pools` keeps k instances for
high-priority requests and the others for normal ones (k swept), each request the freest of its
pool. Where headroom's points lie on or above the pools' line, what is left between them and the
profile's ceiling is not a placement a router could find but capacity taken from normal requests.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from llumdask.benchmarks.common import float_list, int_list, parser, report, seed_range
from llumdask.benchmarks.paper_report import priority_gain
from llumdask.engine.headroom import derive_headroom
from llumdask.engine.latency import load_profile
from llumdask.benchmarks.paper import PRIORITIES, Case, PaperPlan, Replay, decode_context_tokens, replay_capacity, run_cases

# The paper's bound on what priorities may cost normal-priority requests.
NORMAL_COST_BOUND = 0.045
TOLERANCES = (0.05, 0.1, 0.15, 0.2, 0.3)
POOLS = (2, 3, 4, 5, 6)


def cases(plan: PaperPlan, tolerances: list[float], pools: list[int]) -> tuple[list[Case], dict[float, Any]]:
    """Llumnix-base, Llumnix at each tolerance's headroom and each pool size, for every seed and CV."""
    profile = load_profile(plan.profile)
    tokens = decode_context_tokens(plan.priority_trace, seed=plan.seeds[0])
    headrooms = {t: derive_headroom(profile, tolerance=t, sequence_tokens=tokens) for t in tolerances}
    out = []
    for seed in plan.seeds:
        rate = plan.priority_load * replay_capacity(Replay(plan.priority_trace, plan.priority_requests, seed),
                                                    plan.instances, plan.profile)
        for cv in plan.priority_cvs:
            setting = (PRIORITIES, plan.priority_trace, plan.priority_load, rate)
            common = dict(instances=plan.instances, profile=plan.profile, seed=seed, cv=cv,
                          high_priority_share=plan.priority_share)
            out.append(Case(*setting, "llumnix_base", plan.priority_requests, **common))
            out += [Case(*setting, "llumnix", plan.priority_requests, headroom_tokens=h.tokens, **common)
                    for h in headrooms.values()]
            out += [Case(*setting, "priority_pools", plan.priority_requests, pool_instances=k, **common) for k in pools]
    return out, headrooms


def frontier(runs: list[dict[str, Any]], headrooms: dict[float, Any], pools: list[int],
             cvs: tuple[float, ...]) -> list[dict[str, Any]]:
    """One row per tolerance, then one per pool size: medians over seeds of the speedup over
    Llumnix-base and the normal cost, per CV."""
    base = {(r["seed"], r["cv"]): r for r in runs if r["policy"] == "llumnix_base"}
    variants = [({"policy": "llumnix", "tolerance": t, "headroom_tokens": h.tokens,
                  "near_ideal_tokens": h.near_ideal_tokens},
                 lambda r, h=h: r["policy"] == "llumnix" and r["headroom_tokens"] == h.tokens)
                for t, h in headrooms.items()]
    variants += [({"policy": "priority_pools", "pool_instances": k},
                  lambda r, k=k: r["policy"] == "priority_pools" and r["pool_instances"] == k) for k in pools]
    rows = []
    for row, selects in variants:
        mine = [r for r in runs if selects(r)]
        for cv in cvs:
            gain = priority_gain([(base[(r["seed"], cv)], r) for r in mine if r["cv"] == cv])
            row[f"speedup_cv{cv:g}"], row[f"cost_cv{cv:g}"], row[f"ceiling_cv{cv:g}"] = gain
        row["speedup_min"] = min(row[f"speedup_cv{cv:g}"] for cv in cvs)
        row["cost_max"] = max(row[f"cost_cv{cv:g}"] for cv in cvs)
        rows.append(row)
    return rows


def best_within_bound(rows: list[dict[str, Any]], policy: str) -> dict[str, Any] | None:
    """The policy's row of the highest speedup whose normal cost stays within the bound at every CV."""
    within = [r for r in rows if r["policy"] == policy and r["cost_max"] <= NORMAL_COST_BOUND]
    return max(within, key=lambda r: r["speedup_min"], default=None)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tolerances", type=float_list, default=list(TOLERANCES),
                   help="headroom tolerances to sweep (default %(default)s)")
    p.add_argument("--pools", type=int_list, default=list(POOLS),
                   help="instances kept for high-priority requests by priority_pools, swept (default %(default)s)")
    p.add_argument("--seeds", type=seed_range, default=[0, 1, 2], metavar="FIRST-LAST|S,S,...",
                   help="workload seeds (default 0-2)")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (default %(default)s)")
    args = p.parse_args(argv)
    plan = PaperPlan()
    plan = replace(plan, seeds=tuple(args.seeds))
    if args.quick:
        plan = replace(plan, seeds=plan.seeds[:1], priority_cvs=(1.0,), priority_requests=1_000)
    started = time.perf_counter()
    pools = sorted(args.pools)
    todo, headrooms = cases(plan, sorted(args.tolerances), pools)
    runs = run_cases(todo, args.jobs, print)
    rows = frontier(runs, headrooms, pools, plan.priority_cvs)
    ceiling = min(rows[0][f"ceiling_cv{cv:g}"] for cv in plan.priority_cvs)
    notes = [f"ceiling (Llumnix-base / each high-priority request alone on an idle instance, lowest CV's): {ceiling:.2f}x"]
    for policy, name in (("llumnix", "tolerance"), ("priority_pools", "pool_instances")):
        best = best_within_bound(rows, policy)
        notes.append(f"{policy}: best within +{NORMAL_COST_BOUND:.1%} normal cost at every CV: {best['speedup_min']:.3f}x "
                     f"at {name} {best[name]:g}" if best else
                     f"{policy}: no setting keeps the normal cost within +{NORMAL_COST_BOUND:.1%} at every CV")
    columns = [("policy", "policy", "{}"), ("tolerance", "tolerance", "{:g}"), ("headroom_tokens", "headroom", "{}"),
               ("pool_instances", "pool", "{}"),
               *[(f"speedup_cv{cv:g}", f"high x cv{cv:g}", "{:.3f}") for cv in plan.priority_cvs],
               *[(f"cost_cv{cv:g}", f"normal cv{cv:g}", "{:+.1%}") for cv in plan.priority_cvs]]
    facts = {"trace": plan.priority_trace, "load": plan.priority_load, "high_share": plan.priority_share,
             "requests": plan.priority_requests, "instances": plan.instances, "profile": plan.profile,
             "seeds": list(plan.seeds), "cvs": list(plan.priority_cvs),
             "wall_seconds": round(time.perf_counter() - started, 1)}
    report("priority_frontier", args.out, rows, columns, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
