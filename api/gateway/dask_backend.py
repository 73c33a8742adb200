"""The gateway's Backend over a llumdask cluster: a requester on an asynchronous Dask client.

`DaskBackend.connect` opens an asynchronous Dask client on the running loop (the server's) and a
`Requester` on it, which places requests, receives their token batches on its own listener and
resubmits requests whose instance died. Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from distributed import Client

from llumdask.api.gateway.backend import BackendOverloaded, BackendRejected, BackendUnavailable, ModelInfo
from llumdask.config import load_config
from llumdask.engine.base import TokenLogprob
from llumdask.global_scheduler import ClusterOverloaded, NoInstanceAvailable
from llumdask.plugins.control import InstanceState, NoLlumdaskScheduler, RequestRejected
from llumdask.plugins.requester import Requester
from llumdask.plugins.streams import TokenStream
from llumdask.request import FinishReason, Priority, Request, SamplingParams


class DaskTokenBatches:
    """One request's token batches from the requester's stream."""

    def __init__(self, requester: Requester, request_id: str, stream: TokenStream) -> None:
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._requester = requester
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        try:
            while tokens := await self._stream.next_tokens():
                yield tokens
        except RuntimeError as exc:  # the stream failed: not placed again after its instance died, or refused
            raise BackendUnavailable(str(exc)) from None
        self.finish_reason = self._stream.sequence.finish_reason
        # Finished: nothing to abort. An unfinished request stays known so that abort finds its instance.
        self._requester.forget(self.request_id)

    def logprobs(self, start: int, end: int) -> list[TokenLogprob]:
        return self._stream.sequence.logprobs(start, end)

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        return self._stream.sequence.prompt_logprobs

    @property
    def cached_tokens(self) -> int | None:
        return self._stream.sequence.cached_tokens


class DaskBackend:
    def __init__(self, requester: Requester, model: ModelInfo) -> None:
        self.model = model
        self.requester = requester

    @classmethod
    @asynccontextmanager
    async def connect(cls, scheduler_address: str, model: ModelInfo, *, connect_timeout: float = 30.0,
                      **requester_options: Any) -> AsyncIterator["DaskBackend"]:
        """Open on the running event loop; `requester_options` override ``llumdask.requester``."""
        config = load_config({"requester": requester_options}).requester
        dask_client = await Client(scheduler_address, asynchronous=True, timeout=connect_timeout)
        requester = Requester(dask_client, config)
        try:
            yield cls(requester, model)
        finally:
            await requester.close()
            await dask_client.close()

    async def submit(self, choices: Sequence[tuple[str, SamplingParams]], prompt_token_ids: list[int],
                     priority: Priority, cache_salt: str | None) -> list[DaskTokenBatches]:
        now = time.time()
        requests = [Request.arriving(request_id, prompt_token_ids, sampling, priority, now, cache_salt)
                    for request_id, sampling in choices]
        try:
            streams = await self.requester.submit_together(requests)
        except RequestRejected as exc:
            raise BackendRejected(str(exc)) from None
        except ClusterOverloaded as exc:
            raise BackendOverloaded(str(exc), exc.retry_after) from None
        except (NoInstanceAvailable, NoLlumdaskScheduler, OSError, asyncio.TimeoutError) as exc:
            raise BackendUnavailable(str(exc) or type(exc).__name__) from None
        return [DaskTokenBatches(self.requester, r.request_id, stream) for r, stream in zip(requests, streams)]

    async def abort(self, request_id: str) -> None:
        await self.requester.abort(request_id)

    async def ready_instances(self) -> int:
        reply = await self.requester.status()
        return sum(1 for row in reply["instances"] if row["ready"] and row["state"] != InstanceState.TERMINATING)
