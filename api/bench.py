"""``llumdask bench``: simulated cluster benchmarks (``sim``, ``paper``).

Every policy of a comparison runs on the same workload in one invocation, so the numbers are
read as ratios side by side, not against figures from another run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from llumdask.sim.presets import PRESETS
from llumdask.sim.run import make_spec, simulate, write_json
from llumdask.sim.cluster import SimulatorSettings
from llumdask.sim.workload import make_workload

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
    ("instances_mean", "instances", "{:.2f}"),
    ("migrations", "migrations", "{}"),
    ("wall_seconds", "wall s", "{:.1f}"),
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


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_simulation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="M-M", help="S-S, M-M, L-L, S-L, L-S, sharegpt, burstgpt, or a CSV/JSONL trace file")
    parser.add_argument("--rate", type=_positive(float), default=7.5, help="mean arrival rate, requests/s")
    parser.add_argument("--cv", type=float, default=None, help="Gamma arrivals with this coefficient of variation (default Poisson)")
    parser.add_argument("--instances", type=_positive(int), default=16)
    parser.add_argument("--requests", type=_positive(int), default=10_000)
    parser.add_argument("--high-priority-share", type=float, default=0.0)
    parser.add_argument("--profile", default="llama-7b-a10", help="latency profile name or JSON path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-delay", type=float, default=0.0, help="staleness of load reports, seconds")
    parser.add_argument("--bandwidth", type=_positive(float), default=SimulatorSettings.bandwidth, help="bytes/s between instances")


def sim_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llumdask bench sim", description="Compare scheduling policies on one simulated cluster and workload.")
    add_simulation_options(parser)
    parser.add_argument("--policies", type=_policies, default=_policies("round_robin,infaas,llumnix"))
    parser.add_argument("--out", type=Path, default=None, help="write DIR/results.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    workload = make_workload(
        args.trace, rate=args.rate, num_requests=args.requests, seed=args.seed, cv=args.cv,
        high_priority_share=args.high_priority_share,
    )
    settings = SimulatorSettings(report_delay=args.report_delay, bandwidth=args.bandwidth)
    run_facts = {"trace": args.trace, "rate": args.rate, "cv": args.cv, "requests": args.requests, "seed": args.seed,
                 "profile": args.profile, "report_delay": args.report_delay, "bandwidth": args.bandwidth}
    results = {}
    for policy in args.policies:
        spec = make_spec(policy, args.instances, profile=args.profile, settings=settings)
        results[policy] = simulate(spec, workload, progress=not args.no_progress) | run_facts
    print(f"trace {args.trace}, rate {args.rate}/s, {args.requests} requests, {args.instances} instances, profile {args.profile}")
    print(format_table(list(results.values())))
    if args.out is not None:
        write_json(args.out / "results.json", results)
        print(f"wrote {args.out / 'results.json'}")
    return 0


SUBCOMMANDS = {"sim": sim_main}


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: llumdask bench {{{','.join(SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return SUBCOMMANDS[argv[0]](list(argv[1:]))
