"""What the HTTP layer needs from the cluster, and its Dask implementation.

The routes speak only this protocol: submit token ids, iterate token batches, abort. That keeps
HTTP concerns (validation, SSE, errors) testable without a cluster, and the cluster side free
of HTTP. `DaskBackend` implements it over the notebook client (`llumdask.api.client`), so the
gateway gets dispatch, ordered token streams and failover from the same code a notebook uses.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llumdask.engine.base import TokenLogprob
from llumdask.request import FinishReason, Priority, SamplingParams


class BackendUnavailable(Exception):
    """No instance can take the request now (none ready, or the cluster is unreachable)."""


class BackendOverloaded(Exception):
    """The cluster refuses new work for load now (every instance would queue it): 429, retry later,
    after `retry_after` seconds where the cluster estimated them."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BackendRejected(Exception):
    """The instance refused the request for good (it can never fit); the message says why."""


@dataclass(frozen=True)
class ModelInfo:
    """The one model this gateway serves."""

    name: str
    # Prompt plus completion tokens one request may hold.
    max_context: int
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "llumdask"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("the served model name must be non-empty")
        if not isinstance(self.max_context, int) or self.max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")


class TokenBatches(Protocol):
    """One submitted request's output: token batches in order, then `finish_reason` is set."""

    @property
    def request_id(self) -> str: ...

    @property
    def finish_reason(self) -> FinishReason | None: ...

    def __aiter__(self) -> AsyncIterator[list[int]]: ...

    def logprobs(self, start: int, end: int) -> Sequence[TokenLogprob]:
        """Log probabilities of output tokens [start, end) received so far (the request asked for them)."""
        ...

    @property
    def prompt_logprobs(self) -> Sequence[TokenLogprob | None] | None:
        """The prompt's, once the first batch came (the request asked for them), else None."""
        ...

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine found in its prefix cache, once the first batch came (None:
        not yet, or the engine does not say)."""
        ...


class Backend(Protocol):
    model: ModelInfo

    async def submit(self, choices: Sequence[tuple[str, SamplingParams]], prompt_token_ids: list[int],
                     priority: Priority, cache_salt: str | None) -> list[TokenBatches]:
        """Dispatch the choices of one completion, each a request named by its (cluster-unique) id
        with its own sampling, together (they share the prompt and its `cache_salt`); returns
        once instances accepted them all, their batches in the same order.

        Raises BackendUnavailable (no instance now), BackendOverloaded (every instance would queue
        them) or BackendRejected (never fits); then none of them runs. Cancelled (the client left
        while they wait for room or are being handed over), none of them runs either, nor keeps
        a place.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it runs and free its blocks; a finished or unknown id is a no-op."""
        ...

    async def ready_instances(self) -> int: ...
