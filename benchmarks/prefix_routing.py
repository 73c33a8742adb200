"""Prefix-aware routing on shared-prefix traffic, against the routers built for it, over seeds.

Two simulated workloads where prompts share prefixes (`llumdask.sim.workload`): system-prompt (a
few long shared prompts, Zipf popularity, short questions and answers) and multi-turn (chat
conversations that resend their history, sent an exponential think time after each answer).
On 16 simulated instances, over a grid of request rates from comfortable to past what every
prefix router sustains, every policy serves the same requests per seed: round-robin and INFaaS++
(no prefix awareness), Llumnix with prefix-aware dispatch off and on, and the prefix routers by
their published rules at their defaults (prefix_affinity, dynamo_kv, sglang_cache_aware).
Reported per setting: the median over seeds of P99 and mean TTFT, the prefix-cache hit rate
(prompt tokens found cached), throughput (requests over the span from first arrival to last
completion), the load imbalance (the mean over samples of the busiest instance's running
requests over the mean's), the backlog when the last request arrived that came on its own, and
for Llumnix the share of migrated blocks the destination held already; Llumnix's P99 TTFT and
throughput also as ratios to the best prefix router of the same seed.

Each workload's knee is chosen as the paper sweep chooses its loads, against the routers this
compares with: the highest rate of the grid that one of the prefix routers sustains (the median
over seeds of its backlog at most 1% of the requests). The goals but throughput are judged there. At a rate both
sustain, throughput is the offered load for both (their ratio is one to within the timing of the
last completions), so the throughput goal compares the highest rate each sustains: Llumnix's and
each prefix router's, found by bisection between its highest sustained rate of the grid and the
next (`--refine-from` runs only that search again, on an earlier report's grid; with `--rerun
WORKLOAD` that workload's grid too, at this benchmark's requests and rates).

A second part checks that prefix awareness costs nothing where nothing is shared: Llumnix with
and without it on two paper traces at 0.8 of their ideal capacity, paired seed by seed.
"""

from __future__ import annotations

import json
import math
import operator
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from llumdask.benchmarks.common import parser, report
from llumdask.benchmarks.paper import Case, PaperPlan, Replay, replay_capacity, run_cases
from llumdask.sim.workload import MULTI_TURN, SYSTEM_PROMPT

PREFIX_ROUTERS = ("prefix_affinity", "dynamo_kv", "sglang_cache_aware")
# The policies whose highest sustained rate is searched between the grid's rates.
SEARCHED = ("llumnix", *PREFIX_ROUTERS)
POLICIES = ("round_robin", "infaas", "llumnix_no_prefix", "llumnix", *PREFIX_ROUTERS)
# Requests per second on 16 instances, from comfortable to past what every prefix router sustains.
RATES = {SYSTEM_PROMPT: tuple(float(r) for r in range(12, 33, 3)),
         MULTI_TURN: tuple(r / 2 for r in range(6, 13))}
# A rate is sustained where the backlog when the last request arrived is at most this share of
# the requests (the paper sweep's rule for its knees).
SUSTAINED_BACKLOG = 0.01
# Enough that each run reaches its steady state: a system-prompt answer holds its instance's
# memory for minutes at the tail, and 3,000 requests (a minute of arrivals) read only how a
# burst is absorbed while memory fills.
REQUESTS = {SYSTEM_PROMPT: 10000, MULTI_TURN: 2000}
# Bisection rounds between a policy's highest sustained rate of the grid and the next: sustained
# rates are compared to 1/2**REFINE_ROUNDS of the grid's step.
REFINE_ROUNDS = 3
PROFILE = "llama-7b-a10"
# Paper traces (nothing shared) for the no-cost check, at this fraction of their ideal capacity.
UNSHARED = ("sharegpt", "M-M")
UNSHARED_LOAD = 0.8
EXPERIMENT = "prefix"
METRICS = ("prefill_p99", "prefill_mean", "prefix_hit_rate", "throughput", "imbalance", "backlog_at_last_arrival")


def shared_cases(seeds: tuple[int, ...], instances: int, requests: dict[str, int],
                 rates: dict[str, tuple[float, ...]]) -> list[Case]:
    """Every policy at every rate and seed; rates scale with the instances (RATES are for 16)."""
    return [shared_case(trace, rate, policy, seed, instances, requests)
            for trace, grid in rates.items() for rate in grid for seed in seeds for policy in POLICIES]


def shared_case(trace: str, rate: float, policy: str, seed: int, instances: int, requests: dict[str, int]) -> Case:
    """One policy at one rate (for 16 instances, scaled to `instances`) and seed."""
    return Case(EXPERIMENT, trace, rate, rate * instances / 16, policy, requests[trace], instances, PROFILE, seed)


def quick_rates() -> dict[str, tuple[float, ...]]:
    """The lowest and the highest rate of each grid."""
    return {trace: (grid[0], grid[-1]) for trace, grid in RATES.items()}


def unshared_cases(seeds: tuple[int, ...], instances: int, scale: float) -> list[Case]:
    profile, requests = PaperPlan().profile, max(50, round(5000 * scale))
    capacity = {(t, s): replay_capacity(Replay(t, requests, s), instances, profile) for t in UNSHARED for s in seeds}
    return [
        Case(EXPERIMENT, trace, UNSHARED_LOAD, UNSHARED_LOAD * capacity[(trace, seed)], policy,
             requests, instances, profile, seed)
        for trace in UNSHARED for seed in seeds for policy in ("llumnix_no_prefix", "llumnix")
    ]


def with_derived(run: dict[str, Any]) -> dict[str, Any]:
    """Throughput: requests finished over the span from the first arrival to the last completion."""
    return run | {"throughput": run["finished"] / run["makespan"]}


def setting_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (trace, rate, policy): medians over seeds, and Llumnix's ratios to the best
    prefix router of the same seed (lower TTFT, higher throughput is better)."""
    rows = []
    keys = sorted({(r["trace"], r["load"]) for r in runs})
    for trace, rate in keys:
        group = [r for r in runs if r["trace"] == trace and r["load"] == rate]
        seeds = sorted({r["seed"] for r in group})
        by = {(r["policy"], r["seed"]): r for r in group}
        for policy in POLICIES:
            mine = [by[(policy, s)] for s in seeds if (policy, s) in by]
            if not mine:
                continue
            row: dict[str, Any] = {"trace": trace, "rate": rate, "policy": policy, "seeds": len(mine)}
            for metric in METRICS:
                row[metric] = float(np.median([r[metric] for r in mine]))
            # Committed migrations that moved blocks (a waiting request handed over moves none).
            shares = [r["migration_reused_share"] for r in mine if math.isfinite(r["migration_reused_share"])]
            row["migrations"] = float(np.median([r["migrations"] for r in mine]))
            row["migration_reused_share"] = float(np.median(shares)) if shares else None
            if policy == "llumnix":
                for metric, better in (("prefill_p99", min), ("throughput", max)):
                    ratios = [by[("llumnix", s)][metric] / better(by[(p, s)][metric] for p in PREFIX_ROUTERS) for s in seeds]
                    row[f"{metric}_vs_best_router"] = float(np.median(ratios))
            rows.append(row)
    return rows


def sustained_rates(rows: list[dict[str, Any]], requests: dict[str, int]) -> dict[str, dict[str, float | None]]:
    """Per workload and policy, the highest rate of the grid it sustains (None: not even the
    lowest): what a serving system's throughput is once the offered load is its own choice."""
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        rates = out.setdefault(r["trace"], {})
        rates.setdefault(r["policy"], None)
        if sustains(r["backlog_at_last_arrival"], requests[r["trace"]]):
            rates[r["policy"]] = max(r["rate"], rates[r["policy"]] or 0.0)
    return out


def sustains(backlog: float, requests: int) -> bool:
    """The knee's rule: a backlog (the median over seeds) of at most SUSTAINED_BACKLOG of the requests."""
    return backlog <= SUSTAINED_BACKLOG * requests


def refine_sustained(sustained: dict[str, dict[str, float | None]], rates: dict[str, tuple[float, ...]],
                     seeds: tuple[int, ...], instances: int, requests: dict[str, int], rounds: int, jobs: int,
                     ) -> tuple[dict[str, dict[str, float | None]], list[dict[str, Any]]]:
    """`sustained` with Llumnix's and each prefix router's rate found by `rounds` of bisection
    between its highest sustained rate of the grid and the grid's next (each round's middles run
    together, every seed); one sustaining no rate of the grid, or its highest, keeps its grid
    value. Also each bisection step: its rate, median backlog and whether it was sustained."""
    bounds: dict[tuple[str, str], tuple[float, float]] = {}
    for trace, grid in rates.items():
        for policy in SEARCHED:
            low = sustained[trace].get(policy)
            above = [rate for rate in grid if low is not None and rate > low]
            if above:
                bounds[(trace, policy)] = (low, min(above))
    steps: list[dict[str, Any]] = []
    for _ in range(rounds):
        middles = {key: (low + high) / 2 for key, (low, high) in bounds.items()}
        runs = run_cases([shared_case(trace, rate, policy, seed, instances, requests)
                          for (trace, policy), rate in middles.items() for seed in seeds], jobs, print)
        for (trace, policy), rate in middles.items():
            backlog = float(np.median([r["backlog_at_last_arrival"] for r in runs
                                       if r["trace"] == trace and r["policy"] == policy]))
            held = sustains(backlog, requests[trace])
            low, high = bounds[(trace, policy)]
            bounds[(trace, policy)] = (rate, high) if held else (low, rate)
            steps.append({"trace": trace, "policy": policy, "rate": rate, "backlog_at_last_arrival": backlog,
                          "sustained": held})
    refined = {trace: dict(policies) for trace, policies in sustained.items()}
    for (trace, policy), (low, _) in bounds.items():
        refined[trace][policy] = low
    return refined, steps


def knees(sustained: dict[str, dict[str, float | None]], rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each workload's highest rate that one of the prefix routers sustains (`sustained_rates`),
    else the lowest rate of its rows."""
    out = {}
    for trace, rates in sustained.items():
        routers = [rate for policy, rate in rates.items() if policy in PREFIX_ROUTERS and rate is not None]
        out[trace] = max(routers) if routers else min(r["rate"] for r in rows if r["trace"] == trace)
    return out


def sustained_note(trace: str, refined: dict[str, float | None], top: float) -> str:
    """The searched policies' highest sustained rates; one at the grid's top sustains at least that."""
    def shown(policy: str) -> str:
        rate = refined.get(policy)
        return f"{policy} none of the grid" if rate is None else f"{policy} {'>= ' if rate == top else ''}{rate:g}"
    return f"{trace}: highest rate sustained, found by bisection: " + ", ".join(
        shown(p) for p in SEARCHED)


def goal_rows(rows: list[dict[str, Any]], knee: dict[str, float],
              sustained: dict[str, dict[str, float | None]]) -> list[dict[str, Any]]:
    """The goals at each knee: Llumnix's P99 TTFT below the best prefix router's (the median of
    per-seed ratios), its throughput above it, its hit rate above round-robin's and its imbalance
    below prefix_affinity's (medians over seeds). Throughput is the highest rate sustained
    (`sustained`, as `refine_sustained` finds them): at a rate every router sustains it is the
    offered load for all."""
    out = []
    for trace, rate in knee.items():
        at = {r["policy"]: r for r in rows if r["trace"] == trace and r["rate"] == rate}
        mine = at["llumnix"]
        routers = [sustained[trace].get(p) for p in PREFIX_ROUTERS]
        best_router = max((r for r in routers if r is not None), default=None)
        mine_sustained = sustained[trace].get("llumnix")
        for goal, value, reference, holds in (
            ("P99 TTFT / best prefix router's", mine["prefill_p99_vs_best_router"], 1.0, operator.lt),
            ("throughput (highest rate sustained) / best prefix router's",
             (mine_sustained or 0.0) / best_router if best_router else math.nan, 1.0, operator.gt),
            ("hit rate vs round_robin's", mine["prefix_hit_rate"], at["round_robin"]["prefix_hit_rate"], operator.gt),
            ("imbalance vs prefix_affinity's", mine["imbalance"], at["prefix_affinity"]["imbalance"], operator.lt),
        ):
            out.append({"trace": trace, "rate": rate, "goal": goal, "llumnix": value, "reference": reference,
                        "met": bool(holds(value, reference))})
    return out


def no_cost_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Llumnix with prefix awareness / without, paired by seed, per unshared trace."""
    rows = []
    for trace in UNSHARED:
        pairs = {}
        for r in runs:
            if r["trace"] == trace:
                pairs.setdefault(r["seed"], {})[r["policy"]] = r
        row: dict[str, Any] = {"trace": trace, "load": UNSHARED_LOAD}
        for metric in ("prefill_p99", "prefill_mean", "decode_p99"):
            row[f"{metric}_ratio"] = float(np.median([p["llumnix"][metric] / p["llumnix_no_prefix"][metric] for p in pairs.values()]))
        rows.append(row)
    return rows


class Grid(NamedTuple):
    """The runs the search and the goals read: the grid's settings and the no-cost check."""

    name: str
    seeds: tuple[int, ...]
    instances: int
    requests: dict[str, int]
    rates: dict[str, tuple[float, ...]]
    rows: list[dict[str, Any]]
    cost: list[dict[str, Any]]
    seconds: float | None


def run_grid(seeds: tuple[int, ...], quick: bool, jobs: int) -> Grid:
    """Every policy over the grid, and the no-cost check."""
    started = time.perf_counter()
    scale, instances, rates = (0.1, 4, quick_rates()) if quick else (1.0, 16, RATES)
    requests = {k: max(50, round(v * scale)) for k, v in REQUESTS.items()}
    shared = [with_derived(r) for r in run_cases(shared_cases(seeds, instances, requests, rates), jobs, print)]
    cost = no_cost_rows(run_cases(unshared_cases(seeds, instances, scale), jobs, print))
    return Grid("prefix_routing" + ("_quick" if quick else ""), seeds, instances, requests, rates,
                setting_rows(shared), cost, round(time.perf_counter() - started, 1))


def earlier_grid(path: Path) -> Grid:
    """The same, read back from an earlier report of this benchmark (one written before the search
    named the grid's seconds wall_seconds)."""
    earlier = json.loads(path.read_text())
    facts = earlier["facts"]
    return Grid(earlier["benchmark"], tuple(facts["seeds"]), facts["instances"], facts["requests"],
                {trace: tuple(grid) for trace, grid in facts["rates"].items()},
                [r for r in earlier["rows"] if "policy" in r], [r for r in earlier["rows"] if "policy" not in r],
                facts.get("grid_seconds", facts.get("wall_seconds")))


def rerun_workload(grid: Grid, trace: str, jobs: int) -> Grid:
    """`grid` with `trace`'s settings run again at this benchmark's requests and rates (the
    grid's seeds and instances), the other workload's and the no-cost runs kept."""
    started = time.perf_counter()
    requests, rates = {**grid.requests, trace: REQUESTS[trace]}, {**grid.rates, trace: RATES[trace]}
    runs = run_cases(shared_cases(grid.seeds, grid.instances, requests, {trace: RATES[trace]}), jobs, print)
    rows = [r for r in grid.rows if r["trace"] != trace] + setting_rows([with_derived(r) for r in runs])
    rows.sort(key=lambda r: list(rates).index(r["trace"]))
    return grid._replace(requests=requests, rates=rates, rows=rows,
                         seconds=round((grid.seconds or 0.0) + time.perf_counter() - started, 1))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated workload seeds (default %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (default %(default)s)")
    p.add_argument("--refine-from", type=Path, default=None, metavar="REPORT",
                   help="an earlier report of this benchmark: keep its grid and no-cost runs (and their seeds, "
                        "requests and rates) and run only the search for each policy's highest sustained rate")
    p.add_argument("--rerun", choices=tuple(RATES), default=None, metavar="WORKLOAD",
                   help="with --refine-from: run this workload's grid again too, at this benchmark's requests "
                        "and rates, keeping the rest of the earlier report")
    args = p.parse_args(argv)
    if args.refine_from is not None and (args.quick or args.seeds != p.get_default("seeds")):
        p.error("--refine-from takes the earlier report's seeds and size: leave out --quick and --seeds")
    if args.rerun is not None and args.refine_from is None:
        p.error("--rerun needs --refine-from: the report whose other runs it keeps")
    grid = earlier_grid(args.refine_from) if args.refine_from is not None else run_grid(
        tuple(int(s) for s in args.seeds.split(",")), args.quick, args.jobs)
    if args.rerun is not None:
        if grid.name.endswith("_quick"):
            p.error("--rerun runs the full grid: give it a full report, not a --quick one")
        grid = rerun_workload(grid, args.rerun, args.jobs)
    name, seeds, instances, requests, rates, rows, cost, grid_seconds = grid
    refining = time.perf_counter()
    sustained = sustained_rates(rows, requests)
    knee = knees(sustained, rows)
    rounds = 1 if name.endswith("_quick") else REFINE_ROUNDS
    refined, steps = refine_sustained(sustained, rates, seeds, instances, requests, rounds, args.jobs)
    goals = goal_rows(rows, knee, refined)
    notes = [f"{r['trace']} rate {r['rate']:g}: Llumnix P99 TTFT {r['prefill_p99_vs_best_router']:.2f}x, throughput "
             f"{r['throughput_vs_best_router']:.2f}x the best prefix router's (median over seeds of per-seed ratios)"
             + (f"; migrated blocks the destination held: {r['migration_reused_share']:.1%}"
                if r["migration_reused_share"] is not None else "")
             for r in rows if r["policy"] == "llumnix"]
    notes += [f"knee of {trace}: {rate:g} req/s (the highest rate a prefix router sustains)" for trace, rate in knee.items()]
    notes += [sustained_note(trace, refined[trace], max(rates[trace])) for trace in refined]
    notes += [f"{g['trace']} at its knee {g['rate']:g}: {g['goal']}: {g['llumnix']:.3f} vs {g['reference']:.3f}: "
              f"{'met' if g['met'] else 'NOT met'}" for g in goals]
    notes += [f"{r['trace']} load {r['load']:g} (nothing shared): Llumnix with / without prefix awareness: P99 TTFT "
              f"{r['prefill_p99_ratio']:.3f}x, mean TTFT {r['prefill_mean_ratio']:.3f}x, P99 TPOT {r['decode_p99_ratio']:.3f}x"
              for r in cost]
    columns = [("trace", "trace", "{}"), ("rate", "req/s", "{:g}"), ("policy", "policy", "{}"),
               ("prefill_p99", "TTFT p99 s", "{:.3f}"), ("prefill_mean", "TTFT mean s", "{:.3f}"),
               ("prefix_hit_rate", "hit rate", "{:.3f}"), ("throughput", "req/s done", "{:.2f}"),
               ("imbalance", "imbalance", "{:.2f}"), ("backlog_at_last_arrival", "backlog", "{:.0f}")]
    facts = {"instances": instances, "profile": PROFILE, "seeds": list(seeds), "requests": requests,
             "rates": {k: list(v) for k, v in rates.items()}, "knees": knee, "sustained": sustained,
             "sustained_refined": refined, "refine_rounds": rounds, "grid_seconds": grid_seconds,
             "refine_seconds": round(time.perf_counter() - refining, 1)}
    report(name, args.out, rows + cost, columns, facts, notes, extra={"goals": goals, "refinement": steps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
