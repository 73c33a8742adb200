"""``llumdask demo``: six requests over three simulated instances, one live migration, one timeline.

Runs the production core (global scheduler, llumlets, sim engines) on the simulator's virtual
clock, with instances small enough that two long decodes outgrow theirs: the scheduler moves one
of them, while it decodes, to the instance that short requests have left empty. Prints
dispatches, first tokens, migrations and finishes in time order, then the same requests without
migration (the instance preempts instead).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Sequence

from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.latency import load_profile
from llumdask.llumlet import MigrationEventKind
from llumdask.request import Priority
from llumdask.sim.cluster import SimCluster, SimOutcome
from llumdask.sim.workload import TraceRequest

# (arrival s, prompt tokens, output tokens). Dispatch cannot know output lengths: equal prompts
# go round the three instances, so instance-0 gets both 1,100-token decodes (they outgrow its
# 160 blocks of 16 tokens), instance-2 both short ones (it empties early).
DEMO_WORKLOAD = (
    (0.00, 200, 1100), (0.01, 200, 600), (0.02, 200, 60),
    (0.03, 200, 1100), (0.04, 200, 600), (0.05, 200, 60),
)


def timeline(outcome: SimOutcome) -> list[tuple[float, str]]:
    lines = []
    for request in outcome.requests:
        t = request.timing
        lines.append((t.dispatched, f"{request.request_id} dispatched ({request.num_prompt_tokens} prompt tokens)"))
        if t.first_token is not None:
            lines.append((t.first_token, f"{request.request_id} first token after {t.prefill_latency * 1000:.0f} ms"))
        if t.finished is not None:
            lines.append((t.finished, f"{request.request_id} finished: {request.sampling.max_tokens} tokens"))
    for event in outcome.migrations:
        if event.kind is MigrationEventKind.COMMITTED:
            what = (f"migrated {event.request_id} {event.source} -> {event.destination}: {event.stages} stages, "
                    f"{event.blocks} blocks, downtime {event.downtime * 1000:.1f} ms")
        elif event.kind is MigrationEventKind.ABORTED:
            what = f"migration of {event.request_id} aborted: {event.reason}"
        else:
            what = f"migrating {event.request_id} {event.source} -> {event.destination} (decoding goes on)"
        lines.append((event.time, what))
    return sorted(lines, key=lambda line: line[0])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="llumdask demo", description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=160, help="KV blocks per instance (small, so load piles up)")
    args = parser.parse_args(argv)
    config = load_config()
    config = replace(config, sim_engine=replace(config.sim_engine, total_blocks=args.blocks, kv_bytes_per_token=16))
    outcome = run(config, args.instances)
    for time, what in timeline(outcome):
        print(f"{time:8.3f}s  {what}")
    committed = sum(e.kind is MigrationEventKind.COMMITTED for e in outcome.migrations)
    finished = sum(r.timing.finished is not None for r in outcome.requests)
    print(f"\n{finished} of {len(DEMO_WORKLOAD)} requests finished in {outcome.duration:.2f} simulated seconds, "
          f"{_plural(committed, 'live migration')}, {_plural(preemptions(outcome), 'preemption')}, no block leaked "
          "(checked on every instance).")
    if outcome.rejected:
        print(f"Refused, as they could never fit in {args.blocks} blocks: {', '.join(outcome.rejected)}.")
    pinned = run(replace(config, migration=replace(config.migration, enabled=False)), args.instances)
    print(f"Without migration: {_plural(preemptions(pinned), 'preemption')} (a preempted request recomputes its KV), "
          f"finished in {pinned.duration:.2f} simulated seconds.")
    return 0


def run(config: LlumdaskConfig, instances: int) -> SimOutcome:
    cluster = SimCluster(config, load_profile(config.sim_engine.profile), instances)
    return cluster.run([TraceRequest(a, i, o, Priority.NORMAL) for a, i, o in DEMO_WORKLOAD])


def preemptions(outcome: SimOutcome) -> int:
    return sum(r.timing.preemptions for r in outcome.requests)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"
