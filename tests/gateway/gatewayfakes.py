"""A scripted in-memory Backend for tests of the HTTP layer only (routes, validation, SSE, auth).

It follows the engine's token semantics (the stop token is emitted and ends the request with
"stop"; max_tokens ends it with "length") so that responses can be checked exactly. Tests of
the real serving path use `llumdask serve` over a cluster instead (test_serve.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from llumdask.api.gateway.backend import BackendUnavailable, ModelInfo
from llumdask.engine.base import TokenLogprob
from llumdask.request import FinishReason, Priority, SamplingParams

# The model the fake serves.
MODEL = "tiny-test"
MAX_CONTEXT = 256


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority
    cache_salt: str | None = None


def fake_logprob(token: int, position: int, top: int, seed: int | None = None) -> TokenLogprob:
    """A made-up but checkable entry: -(position + 1) / 10 for the token (plus seed / 100, so that
    seeded choices differ), alternatives after it."""
    own = -(position + 1) / 10 + (seed or 0) / 100
    return TokenLogprob(own, tuple((token + 1 + k, own - 1 - k) for k in range(top)))


class ScriptedBatches:
    def __init__(self, backend: "FakeBackend", request_id: str, sampling: SamplingParams,
                 prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._backend = backend
        self._sampling = sampling
        self._prompt = prompt_token_ids
        self._tokens: list[int] = []

    def logprobs(self, start: int, end: int) -> list[TokenLogprob]:
        assert self._sampling.logprobs is not None, "logprobs of a request that did not ask for them"
        s = self._sampling
        if self._backend.next_token is not None:
            return [self._backend.next_token(self._prompt)[1]][start:end]
        return [fake_logprob(t, i, s.logprobs, s.seed) for i, t in enumerate(self._tokens)][start:end]

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        top = self._sampling.prompt_logprobs
        if top is None or not self._tokens:
            return None
        return [None] + [fake_logprob(t, 100 + i, top)._replace(rank=i + 2) for i, t in enumerate(self._prompt[1:])]

    @property
    def cached_tokens(self) -> int | None:
        return self._backend.cached_tokens if self._tokens else None

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        b = self._backend
        emitted = 0
        script = b.script[: self._sampling.max_tokens]
        if b.next_token is not None:
            drawn = b.next_token(self._prompt)  # may raise, as a lost instance
            if drawn is None:
                await asyncio.Event().wait()  # until aborted (cancelled)
            script = [drawn[0]]
        for start in range(0, len(script), b.batch_size):
            if b.stall_after is not None and emitted >= b.stall_after:
                b.stalled.set()
                await asyncio.Event().wait()  # until aborted (cancelled)
            if b.fail_after is not None and emitted >= b.fail_after:
                raise BackendUnavailable("the instance died and no other could take the request")
            batch = script[start : start + b.batch_size]
            stop_at = next((i for i, t in enumerate(batch) if t in self._sampling.stop_token_ids), None)
            if stop_at is not None:
                batch = batch[: stop_at + 1]
            await asyncio.sleep(b.delay)
            emitted += len(batch)
            self._tokens.extend(batch)
            yield batch
            if stop_at is not None:
                self.finish_reason = FinishReason.STOP
                return
        self.finish_reason = FinishReason.LENGTH


@dataclass
class FakeBackend:
    model: ModelInfo
    # Output tokens every request gets (cut at max_tokens or at a stop token).
    script: list[int]
    batch_size: int = 1
    delay: float = 0.0
    ready: int = 2
    submit_error: Exception | None = None
    # Seconds a submission takes once recorded (its requests placed, the caller not told yet), by
    # its prompt.
    submit_delay: Callable[[list[int]], float] = lambda prompt: 0.0
    # Wait forever after this many tokens (a long request), or fail mid-stream.
    stall_after: int | None = None
    fail_after: int | None = None
    # What the engine reports of its prefix cache (None: nothing, as the sim engine).
    cached_tokens: int | None = None
    # A model of the next token by the prompt (beam search's one-token requests): the token drawn
    # and its log probabilities, or None to stall; replaces the script where set.
    next_token: Callable[[list[int]], tuple[int, TokenLogprob] | None] | None = None
    submitted: list[Submitted] = field(default_factory=list)
    # The request ids of each submission (a completion's choices come together).
    placements: list[list[str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    # Set (from the server's loop) when a request reached stall_after; tests wait on it from theirs.
    stalled: threading.Event = field(default_factory=threading.Event)
    opened: int = 0
    closed: int = 0

    async def submit(self, choices: Sequence[tuple[str, SamplingParams]], prompt_token_ids: list[int],
                     priority: Priority, cache_salt: str | None) -> list[ScriptedBatches]:
        if self.submit_error is not None:
            raise self.submit_error
        self.placements.append([request_id for request_id, _ in choices])
        self.submitted += [Submitted(request_id, list(prompt_token_ids), sampling, priority, cache_salt)
                           for request_id, sampling in choices]
        try:
            await asyncio.sleep(self.submit_delay(list(prompt_token_ids)))
        except asyncio.CancelledError:  # as the Dask backend: nothing it placed runs on
            self.aborted += [request_id for request_id, _ in choices]
            raise
        return [ScriptedBatches(self, request_id, sampling, list(prompt_token_ids)) for request_id, sampling in choices]

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def ready_instances(self) -> int:
        return self.ready

    @asynccontextmanager
    async def open(self) -> AsyncIterator["FakeBackend"]:
        self.opened += 1
        try:
            yield self
        finally:
            self.closed += 1

