"""Live migration against its alternatives, on two real instances, one migrated request per length.

For each prompt length the same request is moved from a source to a destination instance while
both decode a background batch, three ways:

- live: the llumlet protocol (copy stages while the request decodes, a short last stage);
- blocking copy: pause, copy every block in one stage, resume (the same engine primitives);
- recompute: abort on the source, add prompt + generated tokens to the destination, which
  prefills them again (no KV moves).

Two figures per method, both from the moment the request stops decoding on the source (paused
or aborted):

- downtime: until the destination has taken the request over (its KV blocks imported, the
  request re-added and ready for the destination's next step) and the source has let go: the
  time it can make progress nowhere (the paper's migration downtime, and the llumlet's own
  figure: pause -> Committed, from the pause's return to the source freeing its blocks). Live:
  the last stage (the last blocks' export and import, the resume). Blocking copy: every block's
  export and import, the resume. Recompute: the destination rebuilds the KV in the prefill that
  also yields the next token, so its downtime is its token gap.
- token gap: until the request's next token on the destination, the gap the client sees: the
  downtime plus the destination's step that computes the token (one step, normally, computing
  the one token whose KV the source had not computed yet). Set against the source's normal
  iteration before the migration (the request's usual interval between tokens), it shows what
  the move added to the client's gap.

Both instances share one process and take turns, so from the stop the bench runs only the
critical path: migration messages are delivered at once and only the destination steps until
the token. A deployment adds the wait for a step boundary on each side (up to one step each
way) to every method alike.

Co-running requests' slowdown is each instance's mean iteration time (its engine step plus the
migration messages it handled in that round: block gathers on the source, scatters on the
destination) while the live migration runs, over the same before it starts.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from llumdask.benchmarks.common import tokens_alone
from llumdask.config import LlumdaskConfig
from llumdask.engine.base import Engine, MigrationState, StepResult, TokenOutput
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.protocol import MigrationMessage
from llumdask.request import Request, SamplingParams, blocks_for
from llumdask.transport import InProcessTransport

SOURCE, DESTINATION = "source", "destination"
MAX_ROUNDS = 10_000


@dataclass(frozen=True)
class BenchSettings:
    lengths: tuple[int, ...]
    background: int = 4  # co-running requests on each instance
    background_prompt: int = 128
    output_tokens: int = 40  # of the migrated request: outlasts every migration
    migrate_after: int = 4  # tokens the request has generated when it moves
    baseline_rounds: int = 6  # iterations measured before the migration starts
    vocab_size: int = 500
    seed: int = 0
    repeats: int = 1  # each figure is the median of this many runs of its length

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive prompt lengths, got {self.lengths}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.background < 1:  # the destination steps only with a batch; its slowdown divides by those steps
            raise ValueError(f"background must be at least 1, got {self.background}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.output_tokens < self.min_output_tokens:
            raise ValueError(f"output tokens ({self.output_tokens}) must be at least {self.min_output_tokens}: the request "
                             f"decodes {self.migrate_after + self.baseline_rounds} before it moves and must outlast the move")

    @property
    def min_output_tokens(self) -> int:
        return self.migrate_after + self.baseline_rounds + 20  # up to ~2 rounds a stage

    @property
    def background_tokens(self) -> int:
        """max_tokens of a background request: it outlasts the scenario it runs in."""
        return self.output_tokens + 4 * self.baseline_rounds + 64

    @property
    def longest_sequence(self) -> int:
        return max(max(self.lengths) + self.output_tokens, self.background_prompt + self.background_tokens)


@dataclass(frozen=True)
class LengthResult:
    """One row of results.json (times in milliseconds)."""

    length: int
    live_downtime_ms: float  # pause -> Committed back at the source (the llumlet's own figure)
    live_token_gap_ms: float  # pause -> the request's next token on the destination
    live_stages: int
    live_blocks: int
    live_bytes: int
    live_destination_steps: int  # destination steps from the resume to the request's token
    live_destination_step_ms: float  # their time: the token gap beyond the downtime
    live_destination_prefill_tokens: int  # computed in them as prefill (vLLM: 1, the last sampled token)
    normal_step_ms: float  # the source's median iteration before the migration
    blocking_downtime_ms: float  # paused -> resumed on the destination and freed on the source
    blocking_token_gap_ms: float
    blocking_bytes: int
    recompute_downtime_ms: float  # abort -> the request's next token on the destination (= its token gap)
    recompute_over_live: float  # token gaps: recompute / live
    source_slowdown: float
    destination_slowdown: float
    tokens_identical: bool  # live migration vs an unmigrated run
    blocking_tokens_identical: bool
    load_average: float  # the machine's 1-minute load average when the length was measured


class _PauseWatch:
    """The source engine as its llumlet sees it, noting when the last stage pauses the request."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.paused_at: float | None = None

    def pause(self, request_id: str) -> MigrationState:
        self.paused_at = time.perf_counter()
        return self._engine.pause(request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class Prompts:
    """Random prompts below the model's vocabulary (ids from 10 up, clear of special tokens), as requests."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size
        self._ids = itertools.count()

    def tokens(self, length: int) -> list[int]:
        """Fresh random tokens: never a prefix-cache hit of an earlier prompt."""
        return self._rng.integers(10, self._vocab, size=length).tolist()

    def request(self, prompt: list[int], max_tokens: int, name: str = "bg") -> Request:
        return Request(f"{name}-{next(self._ids)}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class _Pair:
    """Two llumlets on one in-process transport, stepped in turns, timed per instance."""

    def __init__(self, source: Engine, destination: Engine, config: LlumdaskConfig) -> None:
        self.transport = InProcessTransport()
        self.source = _PauseWatch(source)
        self.events: list[MigrationEvent] = []
        self.tokens: dict[str, dict[int, int]] = defaultdict(dict)
        self.token_times: dict[str, list[tuple[str, float]]] = defaultdict(list)
        self.handled: dict[str, float] = defaultdict(float)
        self.llumlets: dict[str, Llumlet] = {}
        for name, engine in ((SOURCE, self.source), (DESTINATION, destination)):
            llumlet = Llumlet(name, engine, self.transport, config, time.perf_counter,
                              self._tokens_of(name), self.events.append)  # type: ignore[arg-type]
            self.transport.register(name, self._timed(name, llumlet.on_message))
            self.llumlets[name] = llumlet

    def _tokens_of(self, name: str) -> Callable[[TokenOutput], None]:
        def record(out: TokenOutput) -> None:
            for offset, token in enumerate(out.token_ids):
                self.tokens[out.request_id].setdefault(out.first_index + offset, token)
            if out.token_ids:
                self.token_times[out.request_id].append((name, time.perf_counter()))

        return record

    def _timed(self, name: str, handler: Callable[[str, MigrationMessage], None]) -> Callable[[str, MigrationMessage], None]:
        def handle(sender: str, message: MigrationMessage) -> None:
            started = time.perf_counter()
            handler(sender, message)
            self.handled[name] += time.perf_counter() - started

        return handle

    def round(self) -> dict[str, float]:
        """Each instance steps once, then one round of messages; seconds each instance spent."""
        spent = {}
        self.handled.clear()
        for name, llumlet in self.llumlets.items():
            if llumlet.engine.has_work():
                started = time.perf_counter()
                llumlet.step()
                spent[name] = time.perf_counter() - started
        self.transport.deliver_round()
        return {name: spent.get(name, 0.0) + self.handled.get(name, 0.0) for name in self.llumlets}

    def step_until_token(self, name: str, request_id: str, after: float) -> tuple[float, list[tuple[StepResult, float]]]:
        """Step one instance until it emits a token of `request_id` later than `after`: that
        time, and each step taken with its wall time."""
        steps = []
        for _ in range(MAX_ROUNDS):
            started = time.perf_counter()
            result = self.llumlets[name].step()
            steps.append((result, time.perf_counter() - started))
            times = [t for where, t in self.token_times[request_id] if where == name and t > after]
            if times:
                return times[0], steps
        raise RuntimeError(f"{name} produced no token of {request_id} in {MAX_ROUNDS} steps")

    def sequence(self, request_id: str) -> list[int]:
        seen = self.tokens[request_id]
        return [seen[i] for i in range(len(seen))]

    def clear(self, request_ids: Iterable[str]) -> None:
        """Abort what is left and step both instances until idle."""
        for request_id in request_ids:
            for llumlet in self.llumlets.values():
                llumlet.abort_request(request_id)
        for _ in range(MAX_ROUNDS):
            if not any(l.engine.has_work() or l.migrations_in_flight() for l in self.llumlets.values()):
                return
            self.round()
        raise RuntimeError("instances did not go idle")


class MigrationBench:
    """The three ways of moving a request, measured on one pair of instances."""

    def __init__(self, source: Engine, destination: Engine, config: LlumdaskConfig, settings: BenchSettings) -> None:
        self._source, self._destination = source, destination
        self._config = config
        self._settings = settings
        self._prompts = Prompts(settings.vocab_size, settings.seed)
        block_size = source.block_size
        needed = (settings.background * blocks_for(settings.background_prompt + settings.background_tokens, block_size)
                  + 2 * blocks_for(settings.longest_sequence, block_size))  # the request, its copy arriving
        for name, engine in ((SOURCE, source), (DESTINATION, destination)):
            total = engine.snapshot().total_blocks
            if needed > total:
                raise ValueError(f"the {name} instance has {total} KV blocks of {block_size}; the background batch and "
                                 f"a {max(settings.lengths)}-token request need {needed}: lower --lengths or --background")

    def run(self, progress: Callable[[str], None] = lambda _: None) -> list[list[LengthResult]]:
        """Every run of every length, after one unreported pass at the shortest: the first
        migration, prefill and batch shapes of a fresh instance pay one-off costs."""
        progress("warm-up (not reported)")
        self.measure_length(min(self._settings.lengths))
        return [[self.measure_length(length, progress) for _ in range(self._settings.repeats)]
                for length in self._settings.lengths]

    def measure_length(self, length: int, progress: Callable[[str], None] = lambda _: None) -> LengthResult:
        s = self._settings
        prompt = self._prompts.tokens(length)
        progress(f"length {length}: unmigrated reference")
        expected = tokens_alone(self._source, self._prompts.request(prompt, s.output_tokens, "ref"))
        progress(f"length {length}: live migration")
        live = self._live(prompt)
        progress(f"length {length}: blocking copy")
        blocking = self._blocking(prompt)
        progress(f"length {length}: recompute")
        recompute = self._recompute(self._prompts.tokens(length))
        event = live["event"]
        return LengthResult(
            length=length,
            live_downtime_ms=event.downtime * 1e3,
            live_token_gap_ms=live["token_gap"] * 1e3,
            live_stages=event.stages,
            live_blocks=event.blocks,
            live_bytes=event.bytes,
            live_destination_steps=len(live["steps"]),
            live_destination_step_ms=sum(seconds for _, seconds in live["steps"]) * 1e3,
            live_destination_prefill_tokens=sum(step.num_prefill_tokens for step, _ in live["steps"]),
            normal_step_ms=live["normal_step"] * 1e3,
            blocking_downtime_ms=blocking["downtime"] * 1e3,
            blocking_token_gap_ms=blocking["token_gap"] * 1e3,
            blocking_bytes=blocking["bytes"],
            recompute_downtime_ms=recompute * 1e3,
            recompute_over_live=recompute / live["token_gap"],
            source_slowdown=live["slowdown"][SOURCE],
            destination_slowdown=live["slowdown"][DESTINATION],
            tokens_identical=live["tokens"] == expected,
            blocking_tokens_identical=blocking["tokens"] == expected,
            load_average=os.getloadavg()[0],
        )

    # ------------------------------------------------------------------ scenarios
    def _start(self, prompt: list[int]) -> tuple[_Pair, str, list[str], dict[str, list[float]]]:
        """Background batches on both, the request on the source; run until all decode, then
        the baseline iterations. Returns the pair, the request id, every id and the baseline."""
        s = self._settings
        pair = _Pair(self._source, self._destination, self._config)
        background = []
        for name in (SOURCE, DESTINATION):
            for _ in range(s.background):
                request = self._prompts.request(self._prompts.tokens(s.background_prompt), s.background_tokens)
                pair.llumlets[name].add_request(request)
                background.append(request.request_id)
        request = self._prompts.request(prompt, s.output_tokens, "moved")
        pair.llumlets[SOURCE].add_request(request)
        ids = [*background, request.request_id]
        for _ in range(MAX_ROUNDS):
            pair.round()
            if len(pair.tokens[request.request_id]) >= s.migrate_after and all(pair.tokens[b] for b in background):
                break
        baseline: dict[str, list[float]] = defaultdict(list)
        for _ in range(s.baseline_rounds):
            for name, seconds in pair.round().items():
                baseline[name].append(seconds)
        return pair, request.request_id, ids, baseline

    def _finish(self, pair: _Pair, request_id: str, ids: list[str]) -> list[int]:
        """Run until the moved request finishes; its tokens as the client saw them."""
        for _ in range(MAX_ROUNDS):
            if len(pair.tokens[request_id]) >= self._settings.output_tokens:
                break
            pair.round()
        tokens = pair.sequence(request_id)
        pair.clear(ids)
        return tokens

    def _live(self, prompt: list[int]) -> dict[str, Any]:
        pair, request_id, ids, baseline = self._start(prompt)
        if pair.llumlets[SOURCE].migrate_out(DESTINATION, request_id) is None:
            raise RuntimeError(f"request {request_id} could not start migrating")
        during: dict[str, list[float]] = defaultdict(list)
        token_gap = source_share = None
        steps: list[tuple[StepResult, float]] = []
        for _ in range(MAX_ROUNDS):
            paused_at = pair.source.paused_at
            if paused_at is not None and token_gap is None:
                token_gap, source_share, steps = self._last_stage(pair, request_id, paused_at, during)
            if any(e.kind is not MigrationEventKind.STARTED for e in pair.events):
                break
            for name, seconds in pair.round().items():
                during[name].append(seconds)
        event = pair.events[-1]
        if event.kind is not MigrationEventKind.COMMITTED or token_gap is None or source_share is None:
            raise RuntimeError(f"live migration of {request_id} did not commit: {event.kind.value} {event.reason}")
        # The source's last-stage work (pause, export) delays its next iteration.
        after = pair.round()
        during[SOURCE].append(after[SOURCE] + source_share)
        during[DESTINATION].append(after[DESTINATION])
        slowdown = {name: statistics.fmean(during[name]) / statistics.fmean(baseline[name]) for name in pair.llumlets}
        return {"token_gap": token_gap, "event": event, "slowdown": slowdown, "steps": steps,
                "normal_step": statistics.median(baseline[SOURCE]), "tokens": self._finish(pair, request_id, ids)}

    @staticmethod
    def _last_stage(pair: _Pair, request_id: str, paused_at: float,
                    during: dict[str, list[float]]) -> tuple[float, float, list[tuple[StepResult, float]]]:
        """From the pause on: the last stage's messages at once, then the destination steps until
        the request's next token. (The token gap, the source's share of that work, those steps.)"""
        pair.handled.clear()
        started = time.perf_counter()
        pair.transport.deliver_all()
        token_at, steps = pair.step_until_token(DESTINATION, request_id, paused_at)
        source_share = pair.handled[SOURCE]
        during[DESTINATION].append(time.perf_counter() - started - source_share)
        return token_at - paused_at, source_share, steps

    def _blocking(self, prompt: list[int]) -> dict[str, Any]:
        pair, request_id, ids, _ = self._start(prompt)
        source, destination = self._source, self._destination
        migration_id = f"blocking:{request_id}"
        started = time.perf_counter()
        state = source.pause(request_id)
        paused = time.perf_counter()
        num_blocks = blocks_for(state.num_tokens, source.block_size)
        payload = source.export_blocks(request_id, 0, num_blocks)
        if not destination.reserve_blocks(migration_id, num_blocks):
            raise RuntimeError(f"destination has no room for {num_blocks} blocks")
        destination.import_blocks(migration_id, 0, payload)
        destination.resume(migration_id, state)
        source.free_migrated(request_id)
        committed = time.perf_counter()  # timed as the llumlet times a live migration's downtime
        token_gap = pair.step_until_token(DESTINATION, request_id, started)[0] - started
        return {"downtime": committed - paused, "token_gap": token_gap, "bytes": int(payload.nbytes),
                "tokens": self._finish(pair, request_id, ids)}

    def _recompute(self, prompt: list[int]) -> float:
        pair, request_id, ids, _ = self._start(prompt)
        request = self._source.get_request(request_id)
        assert request is not None
        started = time.perf_counter()
        pair.llumlets[SOURCE].abort_request(request_id)
        again = self._prompts.request([*request.prompt_token_ids, *request.output_token_ids],
                                      request.sampling.max_tokens - request.num_output_tokens, "recomputed")
        pair.llumlets[DESTINATION].add_request(again)
        downtime = pair.step_until_token(DESTINATION, again.request_id, started)[0] - started
        pair.clear([*ids, again.request_id])
        return downtime


def median_result(runs: list[LengthResult]) -> LengthResult:
    """Each figure's median over runs of one length (the lower middle one for counts); the
    tokens are identical only when they were in every run."""
    fields = {}
    for name, value in asdict(runs[0]).items():
        values = [getattr(run, name) for run in runs]
        if isinstance(value, bool):
            fields[name] = all(values)
        elif isinstance(value, int):
            fields[name] = statistics.median_low(values)
        else:
            fields[name] = statistics.median(values)
    return LengthResult(**fields)


def results_dict(medians: list[LengthResult], runs: list[list[LengthResult]], facts: dict[str, Any]) -> dict[str, Any]:
    """results.json: the run's facts, one row per length (the medians of its runs), every run,
    and the goal figures (downtime flat in the length; recompute far slower), with the token
    gap's flatness beside the downtime's."""
    shortest, longest = medians[0], medians[-1]
    return {
        **facts,
        "lengths": [asdict(r) for r in medians],
        "runs": [asdict(r) for length_runs in runs for r in length_runs],
        "live_downtime_longest_over_shortest": longest.live_downtime_ms / shortest.live_downtime_ms,
        "live_token_gap_longest_over_shortest": longest.live_token_gap_ms / shortest.live_token_gap_ms,
        "recompute_over_live_at_longest": longest.recompute_over_live,
    }
