"""Serving verdicts over many seeds: Llumnix against each simpler router, seed by seed.

`llumdask bench paper` reads its serving goals on three seeds. Near and past a trace's capacity
one seed's P99 can move 2x on a small change anywhere, so three seeds can call a loss that more do
not show, or miss one they do. This reruns chosen serving settings of the paper plan (same rates:
a load fraction of each seed's own ideal capacity, same cluster and policies) over more seeds and
reports, per setting and metric, the median of Llumnix's per-seed ratios to the router it compares
worst with, in how many seeds Llumnix was the better, and the median over the first three seeds
alone (the sweep's reading). Seeds 0-2 reproduce the sweep's runs exactly (the simulator is
deterministic). `--policy` judges another setup of Llumnix's instead (`llumnix_no_migration`:
what migration adds); `--cv` draws bursty arrivals (Gamma) instead of the sweep's Poisson ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from llumdask.benchmarks.common import parser, report, seed_range
from llumdask.benchmarks.paper import BASELINES, SERVING, Case, PaperPlan, Replay, case_key, replay_capacity, run_cases
from llumdask.benchmarks.paper_report import against_worst_router, by_setting, finite_median, ratio, seed_pairs
from llumdask.sim.presets import PRESETS
from llumdask.sim.run import write_json

# The goals' metrics, then what the same runs say of the trade behind them.
METRICS = ("prefill_p99", "prefill_mean", "decode_p99", "e2e_mean", "preemption_count")


def positive(text: str) -> float | None:
    """The number `text` spells if it is finite and above 0, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def setting(text: str) -> tuple[str, float]:
    """"L-L:1" -> ("L-L", 1.0): a trace and a load fraction of its ideal capacity."""
    trace, sep, load = text.partition(":")
    value = positive(load)
    if not sep or not trace or value is None:
        raise argparse.ArgumentTypeError(f"expected TRACE:LOAD with a load > 0, e.g. L-L:1, got {text!r}")
    return trace, value


def cases(plan: PaperPlan, settings: list[tuple[str, float]], seeds: list[int], ours: str = "llumnix",
          cv: float | None = None) -> list[Case]:
    """Every baseline and `ours`, for each setting and seed, at the sweep's rate for that seed."""
    out = []
    for trace, load in settings:
        for seed in seeds:
            rate = load * replay_capacity(Replay(trace, plan.requests, seed), plan.instances, plan.profile)
            out += [Case(SERVING, trace, load, rate, policy, plan.requests, plan.instances, plan.profile, seed, cv=cv)
                    for policy in (*BASELINES, ours)]
    return out


def judged(text: str) -> str:
    """A setup of Llumnix's (a preset that migrates or holds), judged against the routers."""
    preset = PRESETS.get(text)
    if preset is None or text in BASELINES or not (preset.migration or preset.holds):
        choices = [name for name, p in PRESETS.items() if name not in BASELINES and (p.migration or p.holds)]
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
    return text


def gamma_cv(text: str) -> float:
    """The coefficient of variation of the arrival gaps, > 0."""
    value = positive(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a coefficient of variation > 0, got {text!r}")
    return value


def policy_set(text: str) -> frozenset[str]:
    """"llumnix,infaas" -> the policies to simulate again (the routers' or a setup of Llumnix's)."""
    policies = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(p for p in policies if p not in PRESETS)
    if not policies or unknown:
        raise argparse.ArgumentTypeError(f"expected policies among {', '.join(PRESETS)}, got {text!r}")
    return policies


def rerun(wanted: list[Case], runs_file: Path, policies: frozenset[str], jobs: int) -> list[dict[str, Any]]:
    """The runs of `wanted`: those of `policies` simulated (again), the others read from `runs_file`."""
    if not runs_file.is_file():
        raise SystemExit(f"--rerun needs {runs_file}, written by an earlier run")
    keys = {case_key(dataclasses.asdict(case)) for case in wanted if case.policy not in policies}
    kept = [run for run in json.loads(runs_file.read_text())["runs"] if case_key(run) in keys]
    if len(kept) != len(keys):
        raise SystemExit(f"{runs_file} holds {len(kept)} of the {len(keys)} runs to keep: run them all again")
    fresh = run_cases([c for c in wanted if c.policy in policies], jobs, print)
    by_case = {case_key(run): run for run in (*kept, *fresh)}
    return [by_case[case_key(dataclasses.asdict(case))] for case in wanted]


def verdicts(runs: list[dict[str, Any]], ours: str = "llumnix") -> list[dict[str, Any]]:
    """Per setting and metric: the router `ours` compares worst with, that median ratio, the
    per-seed ratios in seed order, how many are below 1, and the median of the first seeds'
    ratios, as many as the paper plan runs."""
    first = len(PaperPlan().seeds)
    rows = []
    for (trace, load), group in by_setting(runs).items():
        for metric in METRICS:
            median, worst = against_worst_router(group, metric, BASELINES, ours)
            pairs = sorted(seed_pairs(group, ours, worst), key=lambda pair: pair[0]["seed"])
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
    p.add_argument("--policy", type=judged, default="llumnix",
                   help="the setup judged against the routers (default %(default)s)")
    p.add_argument("--cv", type=gamma_cv, default=None,
                   help="Gamma arrivals with this coefficient of variation (default: Poisson, as the sweep)")
    args = p.parse_args(argv)
    if args.rerun is not None and not args.rerun <= {*BASELINES, args.policy}:
        p.error(f"--rerun: policies among {', '.join((*BASELINES, args.policy))}")
    plan = PaperPlan()
    if args.quick:
        plan = plan.with_requests(250)
    started = time.perf_counter()
    wanted = cases(plan, args.settings, args.seeds, args.policy, args.cv)
    runs_file = args.out / "seed_verdicts_runs.json"
    if args.rerun is None:
        runs = run_cases(wanted, args.jobs, print)
    else:
        runs = rerun(wanted, runs_file, args.rerun, args.jobs)
    write_json(runs_file, {"runs": runs})
    columns = [("trace", "trace", "{}"), ("load", "load", "{:g}"), ("metric", "metric", "{}"),
               ("router", "worst router", "{}"), ("median", "median ratio", "{:.2f}"),
               ("better", f"{args.policy} better in", "{}"), ("seeds", "of", "{}"),
               ("first_seeds_median", f"first {len(PaperPlan().seeds)} seeds median", "{:.2f}"), ("per_seed", "per seed", "{}")]
    facts = {"requests": plan.requests, "instances": plan.instances, "profile": plan.profile, "seeds": args.seeds,
             "policy": args.policy, "arrivals": "Poisson" if args.cv is None else f"Gamma, CV {args.cv:g}",
             "wall_seconds": round(time.perf_counter() - started, 1)}
    report("seed_verdicts", args.out, verdicts(runs, args.policy), columns, facts,
           [f"ratio: {args.policy} / the router, per seed on the same requests; < 1 is {args.policy} better"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
