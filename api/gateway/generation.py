"""One generation request from admission to its last text delta.

Admission (`InFlight`) bounds the requests a gateway serves at once: past the bound a client
gets 429 + retry-after at once instead of a queue that grows without limit. A `Generation`
submits to the backend, turns token batches into text (stop strings included), counts the
tokens the client received (that is the usage it reports) and records latency metrics. If it
ends early (client gone, stop string, error) `close` aborts the request on its instance, so
its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import NamedTuple

from prometheus_client import Gauge

from llumdask.api.gateway.backend import Backend, BackendOverloaded, BackendRejected, BackendUnavailable, TokenBatches
from llumdask.api.gateway.detok import IncrementalText
from llumdask.api.gateway.errors import ClusterBusy, InvalidRequest, Overloaded, Unavailable
from llumdask.api.gateway.metrics import GatewayMetrics
from llumdask.api.gateway.repetition import RepetitionDetection
from llumdask.api.gateway.responses import Usage
from llumdask.engine.base import TokenLogprob
from llumdask.request import FinishReason, Priority, SamplingParams


class InFlight:
    """At most `limit` generations at once; `acquire` raises Overloaded (429) past it. A response
    of n choices holds n of them: each choice is its own request on the cluster."""

    def __init__(self, limit: int, retry_after: float, gauge: Gauge) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self._count = 0
        self._gauge = gauge

    def acquire(self, count: int = 1) -> None:
        if self._count + count > self.limit:
            raise Overloaded(self.limit, self.retry_after)
        self._count += count
        self._gauge.set(self._count)

    def release(self, count: int = 1) -> None:
        self._count -= count
        self._gauge.set(self._count)


class Delta(NamedTuple):
    """New text of one choice, and which of its output tokens made it: [start, end)."""

    text: str
    start: int
    end: int


class Generation:
    """Use as: `await Generation.start_all([...])`, iterate `deltas()`, then read `finish_reason` / `usage`; always `close()`."""

    def __init__(self, backend: Backend, metrics: GatewayMetrics, endpoint: str,
                 request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams, priority: Priority,
                 text: IncrementalText, retry_after: float, cache_salt: str | None,
                 repetition: RepetitionDetection | None = None, named_stops: Collection[int] = ()) -> None:
        """`retry_after`: the least a 429 for load asks the client to wait; `repetition`: vLLM's
        repetition_detection, which ends the output where it repeats itself; `named_stops`: the
        stop tokens a stop_reason names when one ends the output (`named_stop_token_ids`)."""
        self._backend = backend
        self._retry_after = retry_after
        self._request_id = request_id
        self._metrics = metrics
        self._endpoint = endpoint
        self._prompt = list(prompt_token_ids)
        self._sampling = sampling
        self._priority = priority
        self._cache_salt = cache_salt
        self._repetition = None if repetition is None else repetition.watch()
        self._named_stops = frozenset(named_stops)
        self._text = text
        self._batches: TokenBatches | None = None
        self._finished = False  # by the engine: nothing to abort
        self._started = time.perf_counter()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string or named stop token that ended it, or
        # "repetition_detected"; None otherwise (the end-of-sequence token, max_tokens, ...).
        self.stop_reason: int | str | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens the client was given (what usage counts)."""
        return len(self.token_ids)

    @property
    def usage(self) -> Usage:
        cached = None if self._batches is None else self._batches.cached_tokens
        return Usage(len(self._prompt), self.num_output_tokens, cached)

    def logprobs(self, start: int, end: int) -> Sequence[TokenLogprob]:
        """Log probabilities of output tokens [start, end) (the request asked for them)."""
        assert self._batches is not None, "start_all() first"
        return self._batches.logprobs(start, end)

    @property
    def prompt_logprobs(self) -> Sequence[TokenLogprob | None]:
        """The prompt's (the request asked for them; the first is None): once a token came."""
        assert self._batches is not None, "start_all() first"
        return self._batches.prompt_logprobs or [None] * len(self._prompt)

    @staticmethod
    async def start_all(generations: Sequence["Generation"]) -> None:
        """Start the choices of one completion, placed together (they share the prompt); if they
        cannot be, none runs."""
        first = generations[0]
        try:
            batches = await first._backend.submit([(g._request_id, g._sampling) for g in generations], first._prompt,
                                                  first._priority, first._cache_salt)
        except BackendUnavailable as exc:
            raise Unavailable(f"No instance can take the request now: {exc}") from None
        except BackendOverloaded as exc:
            # The configured wait is the least; the cluster's estimate spreads a burst of refusals.
            raise ClusterBusy(str(exc), max(first._retry_after, exc.retry_after or 0.0)) from None
        except BackendRejected as exc:
            raise InvalidRequest(f"The request was rejected: {exc}", code="request_rejected") from None
        for generation, batch in zip(generations, batches):
            generation._batches = batch

    async def deltas(self) -> AsyncIterator[Delta]:
        """One text delta per token batch until the request finishes or hits a stop string.

        A delta may be empty: its tokens' text is held back (a character split over tokens, the
        tail of a possible stop string). It is still sent, as vLLM's server does, so that a client
        sees each token when it is made (time to first token is the first token's, not the first
        complete character's) and a streaming client's chunks follow the tokens."""
        assert self._batches is not None, "start_all() first"
        try:
            async for batch in self._batches:
                self._last_token = time.perf_counter()
                if self._first_token is None:
                    self._first_token = self._last_token
                start = self.num_output_tokens
                repeated = self._repeated(batch, start)
                if repeated is not None:  # the tokens after it are not the client's
                    batch = batch[:repeated]
                delta = self._text.add(batch)
                if delta.kept is not None:  # nor those after the one completing a stop string
                    batch = batch[:delta.kept]
                self.token_ids.extend(batch)
                text, stopped = delta.text, delta.stopped
                if repeated is not None and not stopped:  # the end: nothing is held back for later
                    rest = self._text.finish()
                    text, stopped = text + rest.text, rest.stopped
                yield Delta(text, start, self.num_output_tokens)
                if stopped or repeated is not None:  # the engine still runs it: close() aborts it
                    self.stop_reason = self._text.stop_string if stopped else "repetition_detected"
                    self._end("stop" if stopped else "repetition")
                    return
        except BackendUnavailable as exc:
            raise Unavailable(f"The request was lost: {exc}") from None
        self._finished = True
        rest = self._text.finish()
        reason = self._batches.finish_reason
        if rest.stopped:
            self.stop_reason = self._text.stop_string
        elif reason is FinishReason.STOP and self.token_ids and self.token_ids[-1] in self._named_stops:
            self.stop_reason = self.token_ids[-1]
        self._end("stop" if rest.stopped else _finish_reason(reason))
        if rest.text:
            yield Delta(rest.text, self.num_output_tokens, self.num_output_tokens)

    def _repeated(self, batch: Sequence[int], start: int) -> int | None:
        """How many of `batch`'s tokens (the output's from `start`) the output keeps where one of
        them completes a repetition, unless that token is the last of max_tokens anyway; None
        where none does. (A stop token cannot complete one: its first copy ends the request.)"""
        watch = self._repetition
        if watch is None:
            return None
        sampling = self._sampling
        for offset, token in enumerate(batch):
            kept = start + offset + 1
            if watch.add(token) and sampling.min_tokens <= kept < sampling.max_tokens:
                return offset + 1
        return None

    def _end(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason
        self._metrics.finished(self._endpoint, len(self._prompt), self.num_output_tokens, self._first_token,
                               self._last_token, self._started)

    async def text(self) -> str:
        """The whole completion (non-streaming responses)."""
        return "".join([delta.text async for delta in self.deltas()])

    async def close(self) -> None:
        """Abort the request unless it finished; safe to call in any state, even while cancelled."""
        if self._batches is None or self._finished:
            return
        self._finished = True
        await asyncio.shield(self._backend.abort(self._batches.request_id))


def _finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's names; an engine abort (rare: the instance gave up on it) is reported as such, like vLLM does."""
    if reason is None:
        return "stop"
    return reason.value


def total_usage(generations: Sequence[Generation]) -> Usage:
    """The prompt once (and its cached part as the first choice found it), the completions of every choice."""
    first = generations[0].usage
    return Usage(first.prompt_tokens, sum(g.num_output_tokens for g in generations), first.cached_tokens)


async def merged_deltas(generations: Sequence[Generation]) -> AsyncIterator[list[tuple[int, Delta | None]]]:
    """(choice index, delta) as each choice produces them, then (index, None) once that
    choice has finished (its `finish_reason` is set), in lists of what is ready together (the
    choices' tokens of one engine step): a stream writes each list at once. One choice is read
    directly; several are read by one task each into a queue with room for two items a choice (a
    step's last delta and the end), so a slow client slows them."""
    if len(generations) == 1:
        async for delta in generations[0].deltas():
            yield [(0, delta)]
        yield [(0, None)]
        return
    queue: asyncio.Queue[tuple[int, Delta | None | Exception]] = asyncio.Queue(maxsize=2 * len(generations))

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for delta in generation.deltas():
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as exc:  # raised to the reader, which ends the response with it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            batch: list[tuple[int, Delta | None]] = []
            for index, item in ready:
                if isinstance(item, Exception):
                    if batch:
                        yield batch
                    raise item
                running -= item is None
                batch.append((index, item))
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
