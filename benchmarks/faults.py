"""Fault matrix: a live migration hit at each of its states by a dead peer or a lost message.

A cluster of two sim-engine instances in worker processes (real time: each step takes its
profile's time, so a request streams for seconds). In every run a greedy request streams to
this client, the operator migrates it to the other instance, and when the migration reaches a
state a fault fires, injected in the worker that receives that state's message:

- states: `prealloc` (the destination receives the pre-allocation), `stage` (it receives the
  first copy stage), `last_stage` (it receives the last stage, the request paused at the source),
  `commit` (the source receives the destination's commit: the destination runs the request);
- faults: `kill_source` / `kill_destination` (SIGKILL; the nanny starts a fresh worker),
  `drop` (that message is lost: the handshake times out).

Figures per cell: runs whose client received exactly the tokens of an unmigrated run (none
missing, none twice), runs that failed with an error, blocks or reservations left on a surviving
instance once all are idle (the engines' own counts), the migration's outcome, the time from
the fault to the stream's next token (recovery) and the longest wait for a token from the fault on. Goals: every run exact, no error, nothing leaked.

    python -m llumdask.benchmarks.faults --out DIR [--runs 20] [--states ...] [--faults ...]
"""

from __future__ import annotations

import itertools
from collections import Counter
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
from distributed import Client

from llumdask.api.client import LlumdaskClient, connect
from llumdask.benchmarks.common import parser, report, summarize, tokens_alone
from llumdask.clusters.instances import wait_for_instances, worker_statuses
from llumdask.clusters.local import local_cluster
from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.sim import SimEngine
from llumdask.protocol import Committed, PreAlloc, StageData
from llumdask.request import Request, SamplingParams

STATES = ("prealloc", "stage", "last_stage", "commit")
FAULTS = ("kill_source", "kill_destination", "drop")
# Long enough to copy in several stages while decoding; real-time steps of tens of milliseconds.
PROMPT_TOKENS, MAX_TOKENS = 600, 160
# (A worker runs its sim engine in real time whatever the configuration says; the reference run
# here does not sleep.)
OVERRIDES = {"sim-engine": {"total-blocks": 256},
             "migration": {"enabled": False, "handshake-timeout": 2.0}}
COLUMNS = (
    ("state", "state", "{}"),
    ("fault", "fault", "{}"),
    ("runs", "runs", "{}"),
    ("exact", "exact tokens", "{}"),
    ("failed", "failed", "{}"),
    ("leaked_blocks", "leaked blocks", "{}"),
    ("fired", "fault fired", "{}"),
    ("outcomes", "migration outcomes", "{}"),
    ("recovery_p50_ms", "recovery p50 ms", "{:.0f}"),
    ("recovery_max_ms", "recovery max ms", "{:.0f}"),
    ("longest_gap_max_ms", "longest token gap ms", "{:.0f}"),
)


def _trigger(state: str, message: Any) -> bool:
    """Whether `message`, received, marks `state`."""
    if state == "prealloc":
        return isinstance(message, PreAlloc)
    if state == "stage":
        return isinstance(message, StageData) and message.state is None
    if state == "last_stage":
        return isinstance(message, StageData) and message.state is not None
    return isinstance(message, Committed)


def _arm(state: str, fault: str, peer_pid: int, mark: str, dask_worker: Any) -> None:
    """In the worker receiving `state`'s message: the first time it comes, write the moment to
    `mark` and kill this process or its peer, or drop the message."""
    llumlet = dask_worker.plugins["llumdask"].host.llumlet
    deliver = llumlet.on_message

    def on_message(sender: str, message: Any) -> None:
        if _trigger(state, message):
            _disarm(dask_worker)  # once: the driver looks the method up per message
            Path(mark).write_text(repr(time.time()))
            receiver_is_source = state == "commit"
            if fault == "drop":
                return
            if (fault == "kill_source") == receiver_is_source:
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(peer_pid, signal.SIGKILL)
        deliver(sender, message)

    llumlet.on_message = on_message


def _disarm(dask_worker: Any) -> None:
    llumlet = dask_worker.plugins["llumdask"].host.llumlet
    llumlet.__dict__.pop("on_message", None)


@dataclass
class Run:
    exact: bool
    error: str | None
    leaked_blocks: int
    fired: bool
    outcome: str
    # From the fault to the stream's next token, and the longest wait for a token from the fault on.
    recovery_s: float | None
    longest_gap_s: float | None


def prompt_for(number: int) -> list[int]:
    return [(number * 7919 + i * 104729) % 30000 + 1 for i in range(PROMPT_TOKENS)]


def settled(dask: Client, timeout: float = 30.0) -> dict[str, dict]:
    """Two ready instances, none with work or a migration in flight: their statuses."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            wait_for_instances(dask, 2, timeout=max(1.0, deadline - time.monotonic()))
            found = worker_statuses(dask)
            if len(found) == 2 and all(not s["has_work"] and not s["migrations_in_flight"] for s in found.values()):
                return found
        except TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not settle within {timeout} s")
        time.sleep(0.2)


def run_once(llum: LlumdaskClient, config: LlumdaskConfig, state: str, fault: str, number: int, mark: Path) -> Run:
    dask = llum.dask_client
    prompt = prompt_for(number)
    expected = tokens_alone(SimEngine.from_config(config, clock=lambda: 0.0),
                            Request("reference", list(prompt), SamplingParams(max_tokens=MAX_TOKENS)))
    stream = llum.stream(prompt, max_tokens=MAX_TOKENS)
    received = [next(stream) for _ in range(5)]
    source = stream.instance
    destination = next(w for w in dask.scheduler_info()["workers"] if w != source)
    pids = dask.run(os.getpid, workers=[source, destination])
    receiver, peer = (source, destination) if state == "commit" else (destination, source)
    mark.unlink(missing_ok=True)
    dask.run(_arm, state, fault, pids[peer], str(mark), workers=[receiver])
    error, arrivals = None, []
    migration = ""
    try:
        migration = llum.migrate(stream.request_id, to=destination)
        for token in stream:
            received.append(token)
            arrivals.append(time.time())
    except Exception as exc:  # noqa: BLE001 - what the client saw is the figure
        error = f"{type(exc).__name__}: {exc}"
    fired = mark.exists()
    fault_at = float(mark.read_text()) if fired else None
    survivors = settled(dask)
    dask.run(_disarm, workers=list(survivors))
    leaked = sum(s["total_blocks"] - s["free_blocks"] + s["reserved_blocks"] for w, s in survivors.items()
                 if w in (source, destination))
    events = [e for s in survivors.values() for e in s["events"] if e["migration_id"] == migration]
    outcome = next((e["kind"] for e in events if e["kind"] != "started"), "unknown (its source died)")
    after = [fault_at, *(t for t in arrivals if t >= fault_at)] if fault_at is not None else []
    gaps = [b - a for a, b in zip(after, after[1:])]
    return Run(received == expected, error, leaked, fired, outcome, gaps[0] if gaps else None, max(gaps, default=None))


def cell(llum: LlumdaskClient, config: LlumdaskConfig, state: str, fault: str, runs: int, numbers: Any,
         mark: Path) -> dict[str, Any]:
    results = [run_once(llum, config, state, fault, next(numbers), mark) for _ in range(runs)]
    recovery = summarize((r.recovery_s for r in results if r.recovery_s is not None), 1e3)
    longest = summarize((r.longest_gap_s for r in results if r.longest_gap_s is not None), 1e3)
    outcomes = dict(Counter(r.outcome for r in results))
    return {"state": state, "fault": fault, "runs": runs, "exact": sum(r.exact for r in results),
            "failed": sum(r.error is not None for r in results), "leaked_blocks": sum(r.leaked_blocks for r in results),
            "fired": sum(r.fired for r in results), "outcomes": outcomes,
            "recovery_p50_ms": recovery["p50"], "recovery_max_ms": recovery["max"], "longest_gap_max_ms": longest["max"],
            "errors": sorted({r.error for r in results if r.error is not None})}


def matrix(states: Sequence[str], faults: Sequence[str], runs: int, scratch: Path) -> list[dict[str, Any]]:
    config = load_config(OVERRIDES)
    numbers = itertools.count()
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    # The nanny restarts a killed worker; the cluster object would also close a nanny whose worker
    # is missing when a check 15 s after an earlier loss runs (`lost-worker-timeout`), which runs
    # killing the same worker every few seconds hit.
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}), \
            local_cluster(2, config_overrides=OVERRIDES) as cluster, connect(cluster) as llum:
        settled(llum.dask_client)  # each run leaves the cluster settled for the next
        for state, fault in itertools.product(states, faults):
            rows.append(cell(llum, config, state, fault, runs, numbers, scratch / "fault-fired"))
            print(f"  {state} x {fault}: {rows[-1]['exact']}/{runs} exact", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per cell")
    p.add_argument("--states", nargs="+", choices=STATES, default=list(STATES))
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    args = p.parse_args(argv)
    runs = 1 if args.quick else args.runs
    started = time.perf_counter()
    rows = matrix(args.states, args.faults, runs, args.logs / "faults")
    goals = all(r["exact"] == r["runs"] == r["fired"] and not r["failed"] and not r["leaked_blocks"] for r in rows)
    facts = {"instances": 2, "engine": "sim (real time)", "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
             "handshake_timeout_s": OVERRIDES["migration"]["handshake-timeout"], "runs_per_cell": runs,
             "wall_s": round(time.perf_counter() - started), "goals_met": goals}
    notes = [f"{r['state']} x {r['fault']}: {e}" for r in rows for e in r["errors"]]
    report("faults", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
