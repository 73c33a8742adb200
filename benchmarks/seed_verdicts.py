"""Serving verdicts over many seeds: Llumnix against each simpler router, seed by seed.

`llumdask bench paper` reads its serving goals on three seeds. Near and past a trace's capacity
one seed's P99 can move 2x on a small change anywhere, so three seeds can call a loss that more do
not show, or miss one they do. This reruns chosen serving settings of the paper plan (same rates:
a load fraction of each seed's own ideal capacity, same cluster and policies) over more seeds and
reports, per setting and metric, the median of Llumnix's per-seed ratios to the router it compares
worst with, in how many seeds Llumnix was the better, and the median over the first three seeds
alone (the sweep's reading). Seeds 0-2 reproduce the sweep's runs exactly (the simulator is
deterministic).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from llumdask.benchmarks.common import parser, report
from llumdask.benchmarks.paper import (BASELINES, SERVING, Case, PaperPlan, Replay, case_key, replace_runs,
                                       replay_capacity, run_cases)
from llumdask.benchmarks.paper_report import against_worst_router, by_setting, finite_median, ratio, seed_pairs
from llumdask.sim.run import write_json

# The goals' metrics, then what the same runs say of the trade behind them.
METRICS = ("prefill_p99", "prefill_mean", "decode_p99", "e2e_mean", "preemption_count")


def setting(text: str) -> tuple[str, float]:
    """"L-L:1" -> ("L-L", 1.0): a trace and a load fraction of its ideal capacity."""
    trace, sep, load = text.partition(":")
    try:
        value = float(load)
    except ValueError:
        value = float("nan")
    if not sep or not trace or not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected TRACE:LOAD with a load > 0, e.g. L-L:1, got {text!r}")
    return trace, value


def seed_range(text: str) -> list[int]:
    """"0-9" or "0,3,5" -> the seeds."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST or distinct comma-separated seeds >= 0, got {text!r}")
    return seeds


def cases(plan: PaperPlan, settings: list[tuple[str, float]], seeds: list[int]) -> list[Case]:
    """Every baseline and Llumnix, for each setting and seed, at the sweep's rate for that seed."""
    out = []
    for trace, load in settings:
        for seed in seeds:
            rate = load * replay_capacity(Replay(trace, plan.requests, seed), plan.instances, plan.profile)
            out += [Case(SERVING, trace, load, rate, policy, plan.requests, plan.instances, plan.profile, seed)
                    for policy in (*BASELINES, "llumnix")]
    return out


def policy_set(text: str) -> frozenset[str]:
    """"llumnix,llumnix_base" -> the policies, each one the settings run."""
    policies = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(policies - {*BASELINES, "llumnix"})
    if not policies or unknown:
        raise argparse.ArgumentTypeError(f"expected policies among {', '.join((*BASELINES, 'llumnix'))}, got {text!r}")
    return policies


def rerun(wanted: list[Case], runs_file: Path, policies: frozenset[str], jobs: int) -> list[dict[str, Any]]:
    """The runs of `wanted`: those of `policies` simulated again, the others read from `runs_file`."""
    if not runs_file.is_file():
        raise SystemExit(f"--rerun needs {runs_file}, written by an earlier run")
    keys = {case_key(dataclasses.asdict(case)) for case in wanted}
    kept = [run for run in json.loads(runs_file.read_text())["runs"] if case_key(run) in keys]
    if len(kept) != len(wanted):
        raise SystemExit(f"{runs_file} holds {len(kept)} of the {len(wanted)} runs asked for: run them all again")
    return replace_runs(kept, run_cases([c for c in wanted if c.policy in policies], jobs, print), policies)


def verdicts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and metric: the router Llumnix compares worst with, that median ratio, the
    per-seed ratios in seed order, how many are below 1, and the median of the first seeds'
    ratios, as many as the paper plan runs."""
    first = len(PaperPlan().seeds)
    rows = []
    for (trace, load), group in by_setting(runs).items():
        for metric in METRICS:
            median, worst = against_worst_router(group, metric, BASELINES)
            pairs = sorted(seed_pairs(group, "llumnix", worst), key=lambda pair: pair[0]["seed"])
            per_seed = [ratio(mine[metric], theirs[metric]) for mine, theirs in pairs]
            rows.append({
                "trace": trace, "load": load, "metric": metric, "router": worst, "median": median,
                "better": sum(r < 1 for r in per_seed), "seeds": len(per_seed),
                "first_seeds_median": finite_median(per_seed[:first]),
                "per_seed": " ".join(f"{r:.2f}" for r in per_seed),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--setting", type=setting, action="append", required=True, dest="settings",
                   help="TRACE:LOAD, a serving setting of the paper plan (repeat for several)")
    p.add_argument("--seeds", type=seed_range, default=seed_range("0-9"), help="FIRST-LAST or a list (default 0-9)")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (default %(default)s)")
    p.add_argument("--rerun", type=policy_set, default=None, metavar="POLICY,...",
                   help="run only these policies again, keeping the others from OUT/seed_verdicts_runs.json "
                        "(after a change to those policies alone; the simulator is deterministic)")
    args = p.parse_args(argv)
    plan = PaperPlan()
    if args.quick:
        plan = plan.with_requests(500)
    started = time.perf_counter()
    wanted = cases(plan, args.settings, args.seeds)
    runs_file = args.out / "seed_verdicts_runs.json"
    if args.rerun is None:
        runs = run_cases(wanted, args.jobs, print)
    else:
        runs = rerun(wanted, runs_file, args.rerun, args.jobs)
    write_json(runs_file, {"runs": runs})
    columns = [("trace", "trace", "{}"), ("load", "load", "{:g}"), ("metric", "metric", "{}"),
               ("router", "worst router", "{}"), ("median", "median ratio", "{:.2f}"),
               ("better", "Llumnix better in", "{}"), ("seeds", "of", "{}"),
               ("first_seeds_median", f"first {len(PaperPlan().seeds)} seeds median", "{:.2f}"), ("per_seed", "per seed", "{}")]
    facts = {"requests": plan.requests, "instances": plan.instances, "profile": plan.profile, "seeds": args.seeds,
             "wall_seconds": round(time.perf_counter() - started, 1)}
    report("seed_verdicts", args.out, verdicts(runs), columns, facts,
           ["ratio: Llumnix / the router, per seed on the same requests; < 1 is Llumnix better"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
