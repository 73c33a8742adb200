"""The notebook client: `llumdask.connect(...)` -> generate, stream, instances, migrate.

A thin synchronous/asynchronous face over `llumdask.plugins.requester.Requester`, which places
requests (scheduler dispatch, or bypass mode when the scheduler does not answer), receives their
tokens on a listener, and resubmits a request whose instance died.

Works with a synchronous Dask client (methods block; `async for` also works from another event
loop, e.g. Jupyter's) and with an asynchronous one (methods return awaitables).
"""

from __future__ import annotations

import asyncio
import html
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

from distributed import Client
from distributed.deploy.cluster import Cluster

from llumdask.plugins.requester import NoLlumdaskScheduler, RequestRejected, Requester
from llumdask.plugins.streams import TokenStream
from llumdask.request import FinishReason, Priority, Request, SamplingParams, new_request_id

__all__ = ["Generation", "InstanceTable", "LlumdaskClient", "MigrationNotStarted", "MigrationTable",
           "NoLlumdaskScheduler", "RequestRejected", "TokenIterator", "connect"]

T = TypeVar("T")


class MigrationNotStarted(RuntimeError):
    """An operator migration was refused; the message says why."""


@dataclass(frozen=True)
class Generation:
    """A finished request as the requester saw it."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    # The instance that produced the last tokens (the owner at the end).
    instance: str | None


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

    COLUMNS = ("instance", "state", "freeness", "free_blocks", "total_blocks", "num_running",
               "num_waiting", "num_pending", "num_migrating_out", "num_migrating_in", "num_preemptions")

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


class TokenIterator:
    """Tokens of one request, in order, as they arrive; iterate with `for` or `async for`.

    The request is submitted on first iteration; `request_id` is known before that, so an
    operator can migrate it while it streams.
    """

    def __init__(self, client: "LlumdaskClient", request: Request) -> None:
        self._client = client
        self.request = request
        self._stream: TokenStream | None = None
        self._buffer: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def instance(self) -> str | None:
        """The instance that sent the latest tokens (changes when a migration commits)."""
        return None if self._stream is None else self._stream.sequence.owner

    async def _next_tokens(self) -> list[int]:
        """On the client's loop."""
        if self._stream is None:
            self._stream = await self._client.requester.submit(self.request)
        tokens = await self._stream.next_tokens()
        if not tokens:
            self.finish_reason = self._stream.sequence.finish_reason
            self._client.requester.forget(self.request_id)
        return tokens

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


class LlumdaskClient:
    """Talks to a llumdask cluster through a Dask client; see `connect`.

    `requester_options` go to `Requester` (listen_host, liveness_interval, dispatch_timeout,
    bypass_period, placement_timeout, rpc_timeout).
    """

    def __init__(self, client: Client, *, owns_client: bool = False, **requester_options: Any) -> None:
        self._client = client
        self._owns_client = owns_client
        self.requester = Requester(client, **requester_options)

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
    def generate(self, prompt: Sequence[int], max_tokens: int = 16, *, priority: Priority | str = "normal",
                 timeout: float | None = None, **sampling: Any) -> Generation | Awaitable[Generation]:
        """Generate to the end; returns a `Generation` (an awaitable with an asynchronous client).

        `sampling` takes the `SamplingParams` fields (temperature, seed, stop_token_ids, ...).
        `timeout` (seconds) bounds the whole request; on expiry it is aborted and TimeoutError raised.
        """
        request = self._make_request(prompt, max_tokens, priority, sampling)
        return self._sync(self._generate, request, timeout)

    def stream(self, prompt: Sequence[int], max_tokens: int = 16, *, priority: Priority | str = "normal",
               **sampling: Any) -> TokenIterator:
        """A token iterator (sync and async); `.request_id` names the request for `migrate`."""
        return TokenIterator(self, self._make_request(prompt, max_tokens, priority, sampling))

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
        `cmpl-<request id>`) the scheduler finds the instance running it.
        """
        return self._sync(self._migrate, request_id, to, source)

    def drain(self, instance: str) -> None | Awaitable[None]:
        """Stop dispatching to `instance` and migrate its requests away."""
        return self._sync(self._drain, instance)

    def close(self) -> None | Awaitable[None]:
        return self._sync(self._close)

    def __enter__(self) -> "LlumdaskClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "LlumdaskClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._on_loop(self._close)

    # ------------------------------------------------------------------ on the client's loop
    async def _generate(self, request: Request, timeout: float | None = None) -> Generation:
        try:
            return await asyncio.wait_for(self._run_to_end(request), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {request.request_id} did not finish within {timeout} s") from None
        finally:
            # Still open only if it did not finish (timeout, cancellation, error).
            await self.requester.abort(request.request_id)

    async def _run_to_end(self, request: Request) -> Generation:
        stream: TokenStream = await self.requester.submit(request)
        tokens: list[int] = []
        while chunk := await stream.next_tokens():
            tokens += chunk
        self.requester.forget(request.request_id)
        return Generation(request.request_id, tokens, stream.sequence.finish_reason, stream.sequence.owner)

    async def _instances(self) -> InstanceTable:
        reply = await self.requester.status()
        return InstanceTable(tuple(dict(row) for row in reply["instances"]), dict(reply["migrations"]))

    async def _migrations(self, limit: int) -> MigrationTable:
        events = await self._client.scheduler.llumnix_migrations(limit=limit)
        if events is None:
            raise NoLlumdaskScheduler("the scheduler runs no llumdask plugin")
        rows = tuple({**e, "time": time.strftime("%H:%M:%S", time.localtime(e["time"])),
                      "downtime_ms": round(1000.0 * e.get("downtime", 0.0), 1)} for e in events)
        return MigrationTable(rows)

    async def _migrate(self, request_id: str, to: str, source: str | None) -> str:
        source = source or self.requester.holder(request_id)
        reply = await self._client.scheduler.llumnix_migrate(request_id=request_id, source=source, destination=to)
        if reply["migration_id"] is None:
            raise MigrationNotStarted(reply["reason"])
        return reply["migration_id"]

    async def _drain(self, instance: str) -> None:
        reply = await self._client.scheduler.llumnix_drain(instance=instance)
        if not reply["draining"]:
            raise KeyError(reply["reason"])

    async def _close(self) -> None:
        await self.requester.close()
        if self._owns_client:
            await self._client.close()

    # ------------------------------------------------------------------ plumbing
    def _make_request(self, prompt: Sequence[int], max_tokens: int, priority: Priority | str,
                      sampling: dict[str, Any]) -> Request:
        if isinstance(prompt, str):
            raise TypeError("prompt must be a list of token ids; tokenize text first (the gateway does)")
        level = Priority.parse(priority)
        return Request(
            request_id=new_request_id(),
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(max_tokens=max_tokens, **sampling),
            scheduling_priority=level,
            execution_priority=level,
            arrival_time=time.time(),
        )

    def _sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T | Awaitable[T]:
        """Blocking with a synchronous Dask client, an awaitable with an asynchronous one."""
        return self._client.sync(fn, *args)

    async def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await `fn(*args)` on the client's loop from whatever loop we are on."""
        loop = self._client.loop.asyncio_loop
        if asyncio.get_running_loop() is loop:
            return await fn(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args), loop))


def connect(target: "Cluster | Client | str", **requester_options: Any) -> LlumdaskClient:
    """A `LlumdaskClient` for a cluster object, an existing Dask client, or a scheduler address.

    For a cluster or an address a synchronous Dask client is made (and closed by `close()`); for
    asyncio, pass an asynchronous `Client` you awaited. `requester_options`: see `LlumdaskClient`.
    """
    if isinstance(target, Client):
        return LlumdaskClient(target, **requester_options)
    if isinstance(target, (Cluster, str)):
        client = Client(target)
        try:
            return LlumdaskClient(client, owns_client=True, **requester_options)
        except BaseException:
            client.close()
            raise
    raise TypeError(f"connect() takes a Dask cluster, a Client or a scheduler address, not {type(target).__name__}")
