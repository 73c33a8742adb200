"""The notebook client: `llumdask.connect(...)` -> generate, chat, stream, instances, migrate.

A thin synchronous/asynchronous face over `llumdask.plugins.requester.Requester`, which places
requests (scheduler dispatch, or bypass mode when the scheduler does not answer), receives their
tokens on a listener, and resubmits a request whose instance died.

Prompts are text or token ids. Text goes through the served model's tokenizer and chat template,
loaded once per client the way the gateway loads them (`llumdask.api.gateway.tokenizer`), and
comes back as text, stop strings included (`IncrementalText`, the gateway's own). A list of
prompts runs concurrently, bounded, with a progress bar, results in input order.

Works with a synchronous Dask client (methods block; `async for` also works from another event
loop, e.g. Jupyter's) and with an asynchronous one (methods return awaitables).
"""

from __future__ import annotations

import asyncio
import functools
import html
import math
import numbers
import os
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Self, Sequence, TypeVar,
)

from distributed import Client
from distributed.deploy.cluster import Cluster
from tqdm.auto import tqdm

from llumdask.api.gateway.detok import IncrementalText, check_stop
from llumdask.api.gateway.errors import InvalidRequest
from llumdask.api.gateway.schemas import check_messages
from llumdask.api.gateway.tokenizer import Tokenizer, model_location, served_tokenizer, stop_token_ids
from llumdask.config import load_config
from llumdask.engine.base import TokenLogprob
from llumdask.plugins.control import MigrationNotStarted, MigrationPinned, NoLlumdaskScheduler, Op, RequestRejected, call
from llumdask.plugins.requester import Requester
from llumdask.plugins.streams import TokenStream
from llumdask.request import (
    FinishReason, Priority, Request, SamplingParams, check_cache_salt, is_text, new_request_id, token_ids,
)

if TYPE_CHECKING:
    import dask.bag
    import dask.dataframe

__all__ = ["Generation", "InstanceTable", "LlumdaskClient", "MigrationNotStarted", "MigrationPinned", "MigrationTable",
           "NoLlumdaskScheduler", "RequestRejected", "TextIterator", "TokenIterator", "connect"]

T = TypeVar("T")


@dataclass(frozen=True)
class Generation:
    """A finished request as the requester saw it."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    # The instance that produced the last tokens (the owner at the end).
    instance: str | None
    # The completion's text, for a text prompt (None for token ids).
    text: str | None = None
    num_prompt_tokens: int = 0
    # One per token (sampling logprobs=k), and per prompt token (prompt_logprobs=k; the first None).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Prompt tokens the engine found in its prefix cache (None: the engine does not say).
    cached_tokens: int | None = None

    @property
    def usage(self) -> dict[str, Any]:
        """Tokens in the prompt and received, as the gateway reports them."""
        usage: dict[str, Any] = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": len(self.token_ids),
                                 "total_tokens": self.num_prompt_tokens + len(self.token_ids)}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


class _Table:
    """Rows of dicts shown as a fixed-width text table, and as HTML in Jupyter."""

    COLUMNS: tuple[str, ...] = ()
    rows: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    @staticmethod
    def _cell(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    def __repr__(self) -> str:
        lines = ["  ".join(self.COLUMNS)]
        lines += ["  ".join(self._cell(row.get(c, "")) for c in self.COLUMNS) for row in self.rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(self._cell(row.get(c, '')))}</td>" for c in self.COLUMNS) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass(frozen=True, repr=False)
class InstanceTable(_Table):
    """The scheduler's instance table; renders as HTML in Jupyter."""

    rows: tuple[dict[str, Any], ...]
    migrations: dict[str, Any] = field(default_factory=dict)
    # Requests the scheduler holds for room: how many, and the longest wait so far (s).
    held: dict[str, Any] = field(default_factory=dict)

    COLUMNS = ("instance", "state", "freeness", "free_blocks", "total_blocks", "num_running",
               "num_waiting", "num_pending", "num_migrating_out", "num_migrating_in", "num_preemptions",
               "cached_blocks")

    def __getitem__(self, instance: str) -> dict[str, Any]:
        for row in self.rows:
            if row["instance"] == instance:
                return row
        raise KeyError(f"no instance {instance!r} in the table")


@dataclass(frozen=True, repr=False)
class MigrationTable(_Table):
    """The latest migration outcomes (committed and aborted), newest last; downtime in ms."""

    rows: tuple[dict[str, Any], ...]

    COLUMNS = ("time", "kind", "request_id", "source", "destination", "stages", "blocks", "downtime_ms", "reason")


class _Closing(ABC):
    """A stream in a `with` / `async with` block: closed (its request aborted unless it finished) at the end."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class TokenIterator(_Closing):
    """Tokens of one request, in order, as they arrive; iterate with `for` or `async for`.

    The request is submitted on first iteration; `request_id` is known before that, so an
    operator can migrate it while it streams. A stream left before its end (`close()`, the end of
    a `with` block, an error, interrupt or cancelled read while waiting, a read timed out with
    `asyncio.wait_for` among them, or the iterator dropped) aborts the request, so that it does
    not hold its instance's blocks until its max_tokens; reading it again raises.
    """

    def __init__(self, client: "LlumdaskClient", request: Request) -> None:
        self._client = client
        self.request = request
        self._stream: TokenStream | None = None
        self._buffer: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._abandoned: weakref.finalize | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def instance(self) -> str | None:
        """The instance that sent the latest tokens (changes when a migration commits)."""
        return None if self._stream is None else self._stream.sequence.owner

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Log probabilities of the tokens received so far (None unless the request asked for them)."""
        if self.request.sampling.logprobs is None or self._stream is None:
            return None
        sequence = self._stream.sequence
        return sequence.logprobs(0, sequence.next_index)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's, once the first token came (None unless the request asked for them)."""
        if self._stream is None or self._stream.sequence.prompt_logprobs is None:
            return None
        return list(self._stream.sequence.prompt_logprobs)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens found in the prefix cache, once the first token came (None: the engine does not say)."""
        return None if self._stream is None else self._stream.sequence.cached_tokens

    async def _next_tokens(self) -> list[int]:
        """On the client's loop."""
        requester = self._client.requester
        if self._stream is None:
            self._stream = await requester.submit(self.request)
            self._abandoned = weakref.finalize(self, _abort_dropped, self._client._client.loop, requester,
                                               self.request_id)
            self._abandoned.atexit = False
        try:
            tokens = await self._stream.next_tokens()
        except BaseException:  # the stream failed, or its reader was cancelled or interrupted
            self._end()
            raise
        if not tokens:
            self.finish_reason = self._stream.sequence.finish_reason
            self._end(finished=True)
        return tokens

    def _end(self, finished: bool = False) -> None:
        """No more reading: forget a finished request, abort any other (on the client's loop); a
        later read of an aborted one raises rather than wait for tokens that never come."""
        if self._abandoned is not None:
            self._abandoned.detach()
        if finished:
            self._client.requester.forget(self.request_id)
        else:
            self._client.requester.abort_soon(self.request_id)
            self._stream.fail(RuntimeError(f"request {self.request_id} was aborted: its stream was left"))

    @property
    def _running(self) -> bool:
        """Submitted and not finished, on a client still open (closing one ends its requests)."""
        return self._stream is not None and self.finish_reason is None and not self._client._closed

    async def _close(self) -> None:
        if self._running:
            self._end()

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted (at once, not at its max_tokens)."""
        if self._client.asynchronous:
            raise TypeError("with an asynchronous Dask client use `await stream.aclose()`")
        if self._running:  # else nothing to do, and the client's loop may be gone
            self._client._client.sync(self._close)

    async def aclose(self) -> None:
        if self._running:
            await self._client._on_loop(self._close)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if not self._buffer:
            if self._client.asynchronous:
                raise TypeError("with an asynchronous Dask client iterate with `async for`")
            self._buffer = self._client._client.sync(self._next_tokens)
            if not self._buffer:
                raise StopIteration
        return self._buffer.pop(0)

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        if not self._buffer:
            self._buffer = await self._client._on_loop(self._next_tokens)
            if not self._buffer:
                raise StopAsyncIteration
        return self._buffer.pop(0)


def _abort_dropped(loop: Any, requester: Requester, request_id: str) -> None:
    """A stream dropped unfinished: abort its request from the client's loop (the collector may
    run on any thread), unless that loop is gone (the client closed, and its requests with it)."""
    try:
        loop.add_callback(requester.abort_soon, request_id)
    except RuntimeError:
        pass


class TextIterator(_Closing):
    """Text deltas of one request as they arrive (`for` or `async for`), stop strings applied;
    `token_ids` holds the tokens received so far. A stop string aborts the request."""

    def __init__(self, tokens: TokenIterator, text: IncrementalText, vocab_size: int) -> None:
        self._tokens = tokens
        self._text = text
        self._vocab_size = vocab_size
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._done = False

    @property
    def request_id(self) -> str:
        return self._tokens.request_id

    @property
    def instance(self) -> str | None:
        return self._tokens.instance

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """Log probabilities of `token_ids` (None unless the request asked for them)."""
        logprobs = self._tokens.logprobs
        return None if logprobs is None else logprobs[:len(self.token_ids)]

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        return self._tokens.prompt_logprobs

    async def _next_delta(self) -> str | None:
        """The next non-empty text (None at the end), on the client's loop."""
        while not self._done:
            batch = await self._tokens._next_tokens()
            if not batch:
                self._done = True
                rest = self._text.finish()
                self.finish_reason = FinishReason.STOP if rest.stopped else self._tokens.finish_reason
                return rest.text or None
            if (largest := max(batch)) >= self._vocab_size:
                self._done = True
                await self._tokens._client.requester.abort(self.request_id)
                raise ValueError(f"{self.instance} sent token id {largest}, outside the tokenizer's vocabulary of "
                                 f"{self._vocab_size}: it serves another model (sim instances take the tokenizer's "
                                 "vocabulary as sim-engine.vocab-size)")
            delta = self._text.add(batch)
            # The tokens after the one completing a stop string are not the answer's (as the gateway's).
            self.token_ids += batch if delta.kept is None else batch[:delta.kept]
            if delta.stopped:  # the engine still runs it
                self._done = True
                self.finish_reason = FinishReason.STOP
                await self._tokens._client.requester.abort(self.request_id)
            if delta.text:
                return delta.text
        return None

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted (at once, not at its max_tokens)."""
        self._tokens.close()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        client = self._tokens._client
        if client.asynchronous:
            raise TypeError("with an asynchronous Dask client iterate with `async for`")
        delta = client._client.sync(self._next_delta)
        if delta is None:
            raise StopIteration
        return delta

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        delta = await self._tokens._client._on_loop(self._next_delta)
        if delta is None:
            raise StopAsyncIteration
        return delta


# A prompt: text, or token ids. Messages: a chat conversation.
Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class _Chat:
    """A conversation as a prompt: the chat template renders it when its request is made."""

    messages: Any

    def __bool__(self) -> bool:
        return bool(self.messages)

    def checked(self) -> list[dict[str, Any]]:
        """The messages as the gateway's chat endpoint checks them; ValueError naming the bad part."""
        messages = list(self.messages) if isinstance(self.messages, (list, tuple)) else self.messages
        try:
            return list(check_messages(messages))
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None


class LlumdaskClient:
    """Talks to a llumdask cluster through a Dask client; see `connect`.

    `requester_options` override the ``llumdask.requester`` settings (listen_host,
    liveness_interval, dispatch_timeout, bypass_period, placement_timeout, rpc_timeout), each
    checked as configuration is: an unknown or bad one is a `ConfigError` naming it.
    """

    def __init__(self, client: Client, *, owns_client: bool = False, model: str | None = None,
                 chat_template: str | None = None, trust_remote_code: bool = False, **requester_options: Any) -> None:
        for name, value in (("model", model), ("chat_template", chat_template)):
            if value is not None and not (isinstance(value, (str, os.PathLike)) and str(value).strip()):
                raise ValueError(f"{name} must be a path or a hub name, got {value!r}")
        if not isinstance(trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be a boolean, got {trust_remote_code!r}")
        self._client = client
        self._owns_client = owns_client
        self._model = None if model is None else str(model)
        self._chat_template = chat_template
        self._trust_remote_code = trust_remote_code
        self.requester = Requester(client, load_config({"requester": requester_options}).requester)
        self._closed = False

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (loaded on first use of text): `model` given to `connect`,
        else llumdask's configured vLLM model with the tokenizer and revisions its engine arguments
        name, else the offline tiny model, as `llumdask serve` picks; the model's own tokenizer code
        runs where `connect` was told to trust it, or the configured engine arguments trust it."""
        engine = load_config().vllm_engine
        model, args = (self._model, {}) if self._model is not None else (engine.model, engine.engine_args)
        if self._trust_remote_code:
            args = {**args, "trust-remote-code": True}
        return served_tokenizer(model_location(model), args.get("tokenizer"), args, self._chat_template).tokenizer

    @property
    def dask_client(self) -> Client:
        return self._client

    @property
    def asynchronous(self) -> bool:
        return self._client.asynchronous

    @property
    def resubmissions(self) -> int:
        """Requests resubmitted because the instance holding them died."""
        return self.requester.resubmissions

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Prompt | Sequence[Prompt], max_tokens: int = 16, *, priority: Priority | str = "normal",
                 timeout: float | None = None, stop: Sequence[str] = (), concurrency: int = 64,
                 progress: bool = True, cache_salt: str | None = None, **sampling: Any) -> Any:
        """Generate to the end; returns a `Generation` (an awaitable with an asynchronous client).

        `prompt` is text (the result has `.text`) or token ids; a list of prompts runs them at
        most `concurrency` at a time with a progress bar (`progress`) and returns their results
        in input order, a failed one as its exception in its place. `stop` strings end a text
        generation (not part of the text). `sampling` takes the `SamplingParams` fields
        (temperature, top_p, seed, stop_token_ids, ignore_eos, top_k, min_p, penalties,
        min_tokens, logit_bias, allowed_token_ids, logprobs, prompt_logprobs: the result's `.logprobs` and
        `.prompt_logprobs`); text prompts stop at the model's
        end-of-sequence token unless `ignore_eos`. `timeout` (seconds) bounds each request; on
        expiry it is aborted and TimeoutError raised (returned, in a list). `cache_salt`: the
        prompt shares cached blocks only with requests given the same salt (vLLM's, for tenants).
        """
        if _is_messages(prompt):
            raise ValueError("generate takes text or token ids: a conversation (messages) goes to chat()")
        if _is_batch(prompt):
            return self.generate_batch(prompt, max_tokens, priority=priority, timeout=timeout, stop=stop,
                                       concurrency=concurrency, progress=progress, cache_salt=cache_salt, **sampling)
        _positive("concurrency", concurrency)  # unused for one prompt, but a bad value is still an error
        return self._sync(self._generate, *self._job(prompt, max_tokens, priority, stop, sampling, cache_salt),
                          _timeout(timeout))

    def generate_batch(self, prompts: Sequence[Any], max_tokens: int = 16, *, priority: Priority | str = "normal",
                       timeout: float | None = None, stop: Sequence[str] = (), concurrency: int = 64,
                       progress: bool = True, cache_salt: str | None = None, **sampling: Any) -> Any:
        """`generate` on each element of `prompts` as a prompt of its own (a list of token ids too,
        and a single id: an invalid prompt), its result in its place: a prompt that fails, its
        checks included, as its exception, the others run. The options are checked first, for all."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        concurrency = self._check_options(max_tokens, priority, timeout, stop, concurrency, cache_salt, sampling)
        jobs = [_attempt(self._job, p, max_tokens, priority, stop, sampling, cache_salt) for p in prompts]
        return self._sync(self._generate_many, jobs, _timeout(timeout), concurrency, progress)

    def chat(self, messages: Messages | Sequence[Messages], max_tokens: int = 16, **options: Any) -> Any:
        """`generate` on the prompt the model's chat template makes of `messages` (a list of
        {"role", "content"} dicts, or a list of such conversations for a batch)."""
        if _is_conversation_batch(messages):
            return self.generate_batch([_Chat(m) for m in messages], max_tokens, **options)
        return self.generate(_Chat(messages), max_tokens, **options)

    def map(self, prompts: "dask.bag.Bag | dask.dataframe.Series", max_tokens: int = 16, *,
            priority: Priority | str = "normal", timeout: float | None = None, stop: Sequence[str] = (),
            concurrency: int = 64, cache_salt: str | None = None,
            **sampling: Any) -> "dask.bag.Bag | dask.dataframe.DataFrame":
        """Batch inference over a Dask collection of prompts, lazily, each partition an ordinary
        Dask task on the cluster that submits through its worker process's requester (made once,
        kept for later partitions), at most `concurrency` at once. A bag (texts or token-id
        lists) gives a bag of `Generation`s in the same order (a failed prompt: its exception);
        a dataframe column of texts gives a frame with its index and the columns of
        `llumdask.api.batch.COLUMNS` (text, finish_reason, prompt_tokens, completion_tokens,
        error). The options are `generate`'s, checked here before anything runs."""
        import dask.bag

        from llumdask.api.batch import Served, generate_bag, generate_column

        concurrency = self._check_options(max_tokens, priority, timeout, stop, concurrency, cache_salt, sampling)
        options = dict(max_tokens=max_tokens, priority=priority, timeout=timeout, stop=stop,
                       concurrency=concurrency, cache_salt=cache_salt, **sampling)
        served = Served(self._model, self._chat_template, self._trust_remote_code)
        if isinstance(prompts, dask.bag.Bag):
            return generate_bag(prompts, served=served, options=options)
        try:
            import dask.dataframe
        except ImportError:  # pandas is an extra: pip install 'dask[dataframe]'
            series = ()
        else:
            series = dask.dataframe.Series
        if isinstance(prompts, series):
            return generate_column(prompts, served=served, options=options)
        raise TypeError(f"map() takes a dask.bag.Bag or a dask.dataframe Series of prompts, not {type(prompts).__name__}")

    def stream(self, prompt: Prompt, max_tokens: int = 16, *, priority: Priority | str = "normal",
               stop: Sequence[str] = (), cache_salt: str | None = None, **sampling: Any) -> TokenIterator | TextIterator:
        """Text deltas for a text prompt (`TextIterator`), token ids for token ids (`TokenIterator`),
        both sync and async; `.request_id` names the request for `migrate`."""
        request, text = self._job(prompt, max_tokens, priority, stop, sampling, cache_salt)
        tokens = TokenIterator(self, request)
        return tokens if text is None else TextIterator(tokens, text, self.tokenizer.vocab_size)

    def instances(self) -> InstanceTable | Awaitable[InstanceTable]:
        return self._sync(self._instances)

    def migrations(self, limit: int = 50) -> MigrationTable | Awaitable[MigrationTable]:
        """The scheduler's latest `limit` migration outcomes (committed and aborted), newest last."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        return self._sync(self._migrations, limit)

    def migrate(self, request_id: str, to: str, *, source: str | None = None) -> str | Awaitable[str]:
        """Operator-forced live migration of a running request; returns the migration id.

        `source` defaults to the instance streaming the request to this client; for a request
        this client did not submit (one served by the gateway: its response id is
        `cmpl-<request id>`) the scheduler finds the instance running it. Refused with
        `MigrationPinned` for a request whose sampling options cannot move exactly, with
        `MigrationNotStarted` otherwise.
        """
        return self._sync(self._migrate, request_id, to, source)

    def drain(self, instance: str) -> None | Awaitable[None]:
        """Stop dispatching to `instance` and migrate its requests away."""
        return self._sync(self._drain, instance)

    def close(self) -> None | Awaitable[None]:
        return self._sync(self._close)

    def __enter__(self) -> "LlumdaskClient":
        if self.asynchronous:  # its close is a coroutine, which a plain `with` never awaits
            raise TypeError("with an asynchronous Dask client use `async with`")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "LlumdaskClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._on_loop(self._close)

    # ------------------------------------------------------------------ on the client's loop
    async def _generate(self, request: Request, text: IncrementalText | None, timeout: float | None = None) -> Generation:
        try:
            return await asyncio.wait_for(self._run_to_end(request, text), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {request.request_id} did not finish within {timeout} s") from None
        finally:
            # Still open only if it did not finish (timeout, cancellation, error); the caller does
            # not wait for an instance that may be dead.
            self.requester.abort_soon(request.request_id)

    async def _run_to_end(self, request: Request, text: IncrementalText | None) -> Generation:
        tokens = TokenIterator(self, request)
        prompt_tokens = len(request.prompt_token_ids)
        if text is None:
            ids: list[int] = []
            while chunk := await tokens._next_tokens():
                ids += chunk
            return Generation(request.request_id, ids, tokens.finish_reason, tokens.instance,
                              num_prompt_tokens=prompt_tokens, logprobs=tokens.logprobs,
                              prompt_logprobs=tokens.prompt_logprobs, cached_tokens=tokens.cached_tokens)
        deltas = TextIterator(tokens, text, self.tokenizer.vocab_size)
        parts = []
        while (delta := await deltas._next_delta()) is not None:
            parts.append(delta)
        return Generation(request.request_id, deltas.token_ids, deltas.finish_reason, deltas.instance,
                          "".join(parts), prompt_tokens, deltas.logprobs, deltas.prompt_logprobs,
                          tokens.cached_tokens)

    async def _generate_many(self, jobs: list[tuple[Request, IncrementalText | None] | ValueError],
                             timeout: float | None, concurrency: int, progress: bool) -> list[Generation | BaseException]:
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(jobs), unit="req", disable=not progress)

        async def one(job: tuple[Request, IncrementalText | None] | ValueError) -> Generation:
            async with gate:
                try:
                    if isinstance(job, ValueError):  # the prompt's checks failed: its result
                        raise job
                    return await self._generate(*job, timeout)
                finally:
                    bar.update(1)

        try:
            return await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)
        finally:
            bar.close()

    async def _instances(self) -> InstanceTable:
        reply = await self.requester.status()
        return InstanceTable(tuple(dict(row) for row in reply["instances"]), dict(reply["migrations"]),
                             dict(reply.get("held", {})))

    async def _migrations(self, limit: int) -> MigrationTable:
        events = await call(self._client.scheduler, Op.MIGRATIONS, limit=limit)
        rows = tuple({**e, "time": time.strftime("%H:%M:%S", time.localtime(e["time"])),
                      "downtime_ms": round(1000.0 * e.get("downtime", 0.0), 1)} for e in events)
        return MigrationTable(rows)

    async def _migrate(self, request_id: str, to: str, source: str | None) -> str:
        source = source or self.requester.holder(request_id)
        started = await call(self._client.scheduler, Op.MIGRATE, request_id=request_id, source=source, destination=to)
        return started.migration_id

    async def _drain(self, instance: str) -> None:
        await call(self._client.scheduler, Op.DRAIN, instance=instance)

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.requester.close()
        if self._owns_client:
            await self._client.close()

    # ------------------------------------------------------------------ plumbing
    def _check_open(self, fn: Callable[..., Any]) -> None:
        """Anything but closing again needs the client open (its requester and loop may be gone)."""
        if self._closed and fn != self._close:
            raise RuntimeError("this LlumdaskClient is closed")

    def _check_options(self, max_tokens: int, priority: Priority | str, timeout: float | None, stop: Sequence[str],
                       concurrency: int, cache_salt: str | None, sampling: dict[str, Any]) -> int:
        """A batch's options, checked once before any prompt is: a ValueError naming the first
        bad one; the concurrency."""
        Priority.parse(priority)
        check_cache_salt(cache_salt)
        SamplingParams(max_tokens=max_tokens, **sampling)
        _timeout(timeout)
        if stops := _stop_strings(stop):  # stop strings mean text: their rules are the detokenizer's
            IncrementalText(self.tokenizer, stops)
        return _positive("concurrency", concurrency)

    def _job(self, prompt: Prompt, max_tokens: int, priority: Priority | str, stop: Sequence[str],
             sampling: dict[str, Any], cache_salt: str | None) -> tuple[Request, IncrementalText | None]:
        """The request for one prompt, and for text its detokenizer (stop strings applied)."""
        stop = _stop_strings(stop)
        if isinstance(prompt, (str, _Chat)):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt, str) and not is_text(prompt):
                raise ValueError("prompt must be text (it holds a lone surrogate, which no tokenizer reads)")
            tokenizer = self.tokenizer
            # A rendered template carries its own special tokens, as the gateway encodes it.
            ids = (tokenizer.encode(prompt) if isinstance(prompt, str)
                   else tokenizer.encode(tokenizer.render_chat(prompt.checked()), add_special_tokens=False))
            asked = SamplingParams(max_tokens=max_tokens, **sampling)  # checked before the model's EOS joins
            sampling = {**sampling, "stop_token_ids": stop_token_ids(tokenizer, asked.stop_token_ids, asked.ignore_eos)}
            request = self._make_request(ids, max_tokens, priority, sampling, cache_salt)
            # The gateway's detokenizer rules: a stop token's text is left out, and a stop string
            # counts only past min_tokens.
            return request, IncrementalText(tokenizer, stop, stop_token_ids=request.sampling.stop_token_ids,
                                            min_tokens=request.sampling.min_tokens)
        if stop:
            raise ValueError("stop strings need a text prompt; with token ids pass stop_token_ids")
        return self._make_request(prompt, max_tokens, priority, sampling, cache_salt), None

    def _make_request(self, prompt: Any, max_tokens: int, priority: Priority | str,
                      sampling: dict[str, Any], cache_salt: str | None) -> Request:
        try:
            ids = token_ids(prompt, "prompt")
        except ValueError:
            ids = ()
        if not ids:
            raise ValueError(f"prompt must be text or a non-empty list of token ids (integers >= 0), "
                             f"got {prompt!r:.80}")
        return Request.arriving(new_request_id(), list(ids), SamplingParams(max_tokens=max_tokens, **sampling),
                                priority, time.time(), cache_salt)

    def _sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T | Awaitable[T]:
        """Blocking with a synchronous Dask client, an awaitable with an asynchronous one."""
        self._check_open(fn)
        return self._client.sync(fn, *args)

    async def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await `fn(*args)` on the client's loop from whatever loop we are on."""
        self._check_open(fn)
        loop = self._client.loop.asyncio_loop
        if asyncio.get_running_loop() is loop:
            return await fn(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args), loop))


def connect(target: "Cluster | Client | str", *, model: str | None = None, chat_template: str | None = None,
            trust_remote_code: bool = False, **requester_options: Any) -> LlumdaskClient:
    """A `LlumdaskClient` for a cluster object, an existing Dask client, or a scheduler address.

    For a cluster or an address a synchronous Dask client is made (and closed by `close()`); for
    asyncio, pass an asynchronous `Client` you awaited. `model` (a directory or hub name) and
    `chat_template` (a file, the template, or one of the model's by name) are the served model's, for text prompts, as
    `llumdask serve` takes them; `trust_remote_code`: the model's own tokenizer code runs, as with
    vLLM's flag. `requester_options`: see `LlumdaskClient`.
    """
    served = {"model": model, "chat_template": chat_template, "trust_remote_code": trust_remote_code}
    if isinstance(target, Client):
        return LlumdaskClient(target, **served, **requester_options)
    if isinstance(target, (Cluster, str)):
        client = Client(target)
        try:
            return LlumdaskClient(client, owns_client=True, **served, **requester_options)
        except BaseException:
            client.close()
            raise
    raise TypeError(f"connect() takes a Dask cluster, a Client or a scheduler address, not {type(target).__name__}")


def _is_batch(prompt: Any) -> bool:
    """A list of prompts (texts or token-id lists) rather than one prompt."""
    if isinstance(prompt, (str, _Chat)):
        return False
    if not isinstance(prompt, Sequence) or not prompt:
        raise ValueError("prompt must be text, a non-empty list of token ids, or a non-empty list of prompts")
    return not isinstance(prompt[0], numbers.Integral)


def _is_messages(prompt: Any) -> bool:
    """Whether `prompt` is a chat conversation (a list of message dicts), given where a prompt goes."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) \
        and isinstance(prompt[0], Mapping)


def _is_conversation_batch(messages: Any) -> bool:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
    return not isinstance(messages[0], Mapping)


def _stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """`stop` as OpenAI clients give it: one string or several (None: none), within the detokenizer's bounds."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r:.80}")
    return check_stop(stops)


def _attempt(fn: Callable[..., T], *args: Any) -> T | ValueError:
    """`fn(*args)`, or the ValueError it raised."""
    try:
        return fn(*args)
    except ValueError as exc:
        return exc


def _timeout(timeout: Any) -> float | None:
    """A request's bound in seconds: None (none), or a finite number > 0 (numpy's too)."""
    if timeout is None:
        return None
    try:
        seconds = float(timeout) if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) else math.nan
    except OverflowError:  # an integer past a float's range
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be None or a number of seconds > 0, got {timeout!r}")
    return seconds


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value
