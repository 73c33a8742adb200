"""``llumdask bench``: simulated cluster benchmarks (``sim``, ``paper``) and live migration on two instances (``migration``).

Every policy of a comparison runs on the same workload in one invocation, so the numbers are
read as ratios side by side, not against figures from another run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from llumdask.api.argtypes import check_out_dir, checked, non_negative, positive
from llumdask.config import ConfigError
from llumdask.sim.presets import PRESETS
from llumdask.sim.run import make_spec, simulate, write_json
from llumdask.sim.cluster import SimulatorSettings
from llumdask.sim.workload import is_generated, make_workload

# What `bench sim` runs a generated trace at when no rate or count is given.
GENERATED_RATE = 7.5
GENERATED_REQUESTS = 10_000

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("prefill_mean", "prefill mean s", "{:.3f}"),
    ("prefill_p99", "prefill p99 s", "{:.3f}"),
    ("decode_mean", "decode mean s", "{:.4f}"),
    ("decode_p99", "decode p99 s", "{:.4f}"),
    ("e2e_mean", "e2e mean s", "{:.2f}"),
    ("e2e_p99", "e2e p99 s", "{:.2f}"),
    ("preemption_loss_mean", "preempt loss s", "{:.3f}"),
    ("fragmentation_mean", "frag", "{:.3f}"),
    ("prefix_hit_rate", "prefix hits", "{:.3f}"),
    ("instances_mean", "instances", "{:.2f}"),
    ("migrations", "migrations", "{}"),
    ("wall_seconds", "wall s", "{:.1f}"),
    ("peak_rss_mib", "peak MiB", "{:.0f}"),
)


def format_table(rows: Sequence[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    """A plain fixed-width table (copies into Markdown code blocks and terminals alike)."""
    header = [title for _, title, _ in columns]
    body = [[_cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return fmt.format(value)


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRESETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown) or text!r}; choose from {', '.join(PRESETS)}")
    return names


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def add_simulation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="M-M", help="S-S, M-M, L-L, S-L, L-S, sharegpt, burstgpt, system-prompt, "
                        "or a CSV/JSONL trace file")
    parser.add_argument("--rate", type=positive(float), default=None,
                        help=f"mean arrival rate, requests/s (generated traces: default {GENERATED_RATE}; "
                        "a trace file is replayed at its own times unless given)")
    parser.add_argument("--cv", type=non_negative(float), default=None, help="Gamma arrivals with this coefficient of variation (default Poisson)")
    parser.add_argument("--instances", type=positive(int), default=16)
    parser.add_argument("--requests", type=positive(int), default=None,
                        help=f"requests (generated traces: default {GENERATED_REQUESTS:,}; a trace file: all of it unless given)")
    parser.add_argument("--high-priority-share", type=checked(float, lambda v: 0 <= v <= 1, "in [0, 1]"), default=0.0)
    parser.add_argument("--profile", default="llama-7b-a10", help="latency profile name or JSON path")
    parser.add_argument("--seed", type=non_negative(int), default=0)
    parser.add_argument("--report-delay", type=non_negative(float), default=0.0, help="staleness of load reports, seconds")
    parser.add_argument("--bandwidth", type=positive(float), default=SimulatorSettings.bandwidth, help="bytes/s between instances")


def sim_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llumdask bench sim", description="Compare scheduling policies on one simulated cluster and workload.")
    add_simulation_options(parser)
    parser.add_argument("--policies", type=_policies, default=_policies("round_robin,infaas,llumnix"))
    parser.add_argument("--out", type=Path, default=None, help="write DIR/results.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.out is not None:
        check_out_dir(parser, args.out)
    if is_generated(args.trace):
        args.rate = args.rate or GENERATED_RATE
        args.requests = args.requests or GENERATED_REQUESTS
    try:
        workload = make_workload(
            args.trace, rate=args.rate, num_requests=args.requests, seed=args.seed, cv=args.cv,
            high_priority_share=args.high_priority_share,
        )
    except (ValueError, OSError) as exc:  # a trace file that is missing or malformed, or too short for the options
        parser.error(f"--trace: {exc}")
    settings = SimulatorSettings(report_delay=args.report_delay, bandwidth=args.bandwidth)
    try:
        specs = {policy: make_spec(policy, args.instances, profile=args.profile, settings=settings) for policy in args.policies}
    except ConfigError as exc:  # the configuration the instances are made from (DASK_LLUMDASK__..., a YAML file)
        parser.error(f"configuration: {exc}")
    except (ValueError, OSError) as exc:
        parser.error(f"--profile: {exc}")
    run_facts = {"trace": args.trace, "rate": args.rate, "cv": args.cv, "requests": len(workload), "seed": args.seed,
                 "profile": args.profile, "report_delay": args.report_delay, "bandwidth": args.bandwidth}
    results = {}
    for policy, spec in specs.items():
        results[policy] = simulate(spec, workload, progress=not args.no_progress) | run_facts
    rate = f"rate {args.rate}/s" if args.rate else "its own arrival times"
    print(f"trace {args.trace}, {rate}, {len(workload)} requests, {args.instances} instances, profile {args.profile}")
    print(format_table(list(results.values())))
    if args.out is not None:
        write_json(args.out / "results.json", results)
        print(f"wrote {args.out / 'results.json'}")
    return 0


def paper_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llumdask bench paper",
        description="Reproduce the Llumnix paper's evaluation on the simulated cluster: DIR/report.md, "
        "DIR/results.json and PNG figures.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for report.md, results.json and the PNGs")
    parser.add_argument("--quick", action="store_true", help="two traces, two rates, 2,000 requests a run (minutes)")
    parser.add_argument("--jobs", type=positive(int), default=2, help="simulations run at once, one process each (default 2)")
    parser.add_argument("--requests", type=positive(int), default=None, help="requests per simulation (overrides the plan)")
    parser.add_argument("--seeds", type=_seeds, default=None,
                        help="comma-separated workload seeds, each setting run once per seed (default: the plan's, 0,1,2)")
    parser.add_argument("--render-only", action="store_true",
                        help="simulate nothing: write report.md and the PNGs again from DIR/results.json")
    parser.add_argument("--rerun", type=_policies, default=None, metavar="POLICY,...",
                        help="run only these policies' simulations again, keeping the others from DIR/results.json "
                             "(after a change to those policies alone; the simulator is deterministic)")
    args = parser.parse_args(argv)
    if args.rerun is not None and (args.render_only or args.quick or args.seeds is not None or args.requests is not None):
        parser.error("--rerun keeps the plan of DIR/results.json: it takes no --render-only, --quick, --seeds or --requests")
    check_out_dir(parser, args.out)
    # Imported here: matplotlib and the experiment plan are only needed by this subcommand.
    try:
        from llumdask.benchmarks.paper import PaperPlan, PaperResults, run_paper
        from llumdask.benchmarks.paper_report import write_paper
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        parser.error("the paper's figures need matplotlib: pip install 'llumdask[bench]'")

    if args.render_only or args.rerun is not None:
        source = args.out / "results.json"
        if not source.is_file():
            parser.error(f"--{'render-only' if args.render_only else 'rerun'} needs {source}, written by an earlier run")
        try:
            results = PaperResults.from_dict(json.loads(source.read_text()))
        except ValueError as exc:
            parser.error(f"{source}: {exc}")
        if args.rerun is not None:
            results = replace(run_paper(results.plan, jobs=args.jobs, keep=results, policies=frozenset(args.rerun)),
                              command=shlex.join(["llumdask", "bench", "paper", *argv]))
    else:
        plan = PaperPlan.quick() if args.quick else PaperPlan.full()
        if args.seeds is not None:
            plan = replace(plan, seeds=args.seeds)
        if args.requests is not None:
            plan = plan.with_requests(args.requests)
        results = replace(run_paper(plan, jobs=args.jobs), command=shlex.join(["llumdask", "bench", "paper", *argv]))
    for path in write_paper(results, args.out):
        print(f"wrote {path}")
    return 0


def migration_main(argv: Sequence[str]) -> int:
    from llumdask.api.bench_migration import main as run_migration  # vLLM engines load only here

    return run_migration(argv)


def soak_main(argv: Sequence[str]) -> int:
    from llumdask.benchmarks.soak import main as run_soak  # the openai client and psutil load only here

    return run_soak(list(argv))


SUBCOMMANDS = {"sim": sim_main, "paper": paper_main, "migration": migration_main, "soak": soak_main}


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: llumdask bench {{{','.join(SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return SUBCOMMANDS[argv[0]](list(argv[1:]))
