"""Requests as the core sees them: identity, prompt, sampling, priorities, status and timing.

The same `Request` object travels through dispatch, an engine's queues, migration and metrics,
so every timestamp the paper reports is recorded on it (by whoever owns the clock).
"""

from __future__ import annotations

import enum
import math
import uuid
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    """Scheduling priority orders queues; execution priority sets headroom (paper section 4.4.1)."""

    NORMAL = 0
    HIGH = 1

    @classmethod
    def parse(cls, value: "Priority | str | int") -> "Priority":
        """Accept the enum, its name ("high"), or its number; anything else is a clear error."""
        if isinstance(value, Priority):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(f"unknown priority {value!r}; expected 'normal' or 'high'") from None
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"unknown priority {value!r}; expected 0 (normal) or 1 (high)") from None
        raise TypeError(f"priority must be 'normal', 'high' or 0/1, not {type(value).__name__}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """What an engine needs to generate; validated here so that every entry point shares it."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestTiming:
    """Timestamps (seconds on the owner's clock) and counters behind every metric the paper reports."""

    arrival: float
    dispatched: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    preemptions: int = 0
    preemption_loss: float = 0.0
    preempted_at: float | None = None
    migrations: int = 0
    migration_downtime: float = 0.0

    @property
    def prefill_latency(self) -> float | None:
        """Arrival to first token, queueing included."""
        return None if self.first_token is None else self.first_token - self.arrival

    def decode_latency(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first: (last - first) / output tokens."""
        if self.first_token is None or self.last_token is None or num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_output_tokens - 1)

    @property
    def end_to_end(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


def new_request_id() -> str:
    """Cluster-unique without coordination."""
    return uuid.uuid4().hex


@dataclass
class Request:
    """One generation request. `output_token_ids` grows as tokens are produced, wherever it runs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    scheduling_priority: Priority = Priority.NORMAL
    execution_priority: Priority = Priority.NORMAL
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    timing: RequestTiming = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: prompt tokens must be non-negative integers")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.scheduling_priority = Priority.parse(self.scheduling_priority)
        self.execution_priority = Priority.parse(self.execution_priority)
        self.timing = RequestTiming(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Sequence length: prompt plus output so far (what occupies KV blocks)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.output_token_ids)

    def queue_key(self) -> tuple[int, float, str]:
        """Waiting order: higher scheduling priority first, then arrival (FCFS), then id (total order)."""
        return (-int(self.scheduling_priority), self.arrival_time, self.request_id)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)
