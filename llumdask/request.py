"""Requests as the core sees them: identity, prompt, sampling, priorities, status and timing.

The same `Request` object travels through dispatch, an engine's queues, migration and metrics,
so every timestamp the paper reports is recorded on it (by whoever owns the clock).
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Integers cross comms as 64-bit ones (msgpack); seeds are vLLM's 64-bit range.
INT64 = 2**63


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


# The most alternatives per position an engine reports (OpenAI's limit, and vLLM's default).
MAX_LOGPROBS = 20


# Token ids an allow-list or a logit bias may name: vLLM's GPU sampler keeps a row of this width per
# request and fails the whole step past it, so a longer list is refused up front on every engine.
MAX_TOKEN_LIST = 1024
# Stop tokens it masks while min_tokens holds them back: the same sampler's bound.
MAX_MASKED_STOPS = 128
# The SamplingParams fields that ask for a structured output, one kind each.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """What an engine needs to generate; validated here so that every entry point shares it.

    The defaults change nothing: top_k 0 and min_p 0 filter no token, penalties 0 (1 for the
    multiplicative repetition penalty) and an empty `logit_bias` leave the logits as they are,
    min_tokens 0 lets a stop token end the request at once. `logit_bias` is (token id, bias)
    pairs, sorted by token id, so that the parameters stay hashable and cross comms as lists;
    `allowed_token_ids` the only tokens that may be generated (empty: any), a mask on each step's
    logits, so it moves exactly with the request."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # Words the output must not contain (vLLM tokenizes them with and without a leading space and
    # bans a word's last token where the request's own output spells the rest).
    bad_words: tuple[str, ...] = ()
    # Log probabilities of each generated (prompt) token and of this many alternatives; None: none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output, one kind at most: JSON text of a JSON schema the output must satisfy, any
    # JSON object, a regular expression it must match, one of `choice`, a grammar (EBNF / Lark), or
    # JSON text of a structural tag (xgrammar's: free text and constrained parts, such as a model's
    # own tool-call markup around a JSON schema).
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None
    structural_tag: str | None = None
    # With a structured output on an engine that reads reasoning (vLLM's reasoning parser): whether
    # the thinking ended before the first token, so the grammar applies from it; False: from the
    # end of the thinking the output writes; None: the engine reads the prompt.
    reasoning_ended: bool | None = None
    # With it, JSON text of the chat template kwargs the request was rendered with: the engine's
    # reasoning parser reads whether thinking is on there (vLLM's reasoning_parser_kwargs).
    reasoning_kwargs: str | None = None
    # The most tokens the thinking may take before the engine writes its end (vLLM's
    # thinking_token_budget, on an engine started with a reasoning parser); None (or -1): no limit.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (is_number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and -INT64 <= self.seed < INT64):
            raise ValueError(f"seed must be a 64-bit integer or None (vLLM's range), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", token_ids(self.stop_token_ids, "stop_token_ids"))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: no limit), got {self.top_k!r}")
        if not (is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (is_number(self.repetition_penalty) and self.repetition_penalty > 0):  # vLLM's range
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (is_number(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", token_ids(self.allowed_token_ids, "allowed_token_ids"))
        for name in ("logit_bias", "allowed_token_ids"):
            if len(getattr(self, name)) > MAX_TOKEN_LIST:
                raise ValueError(f"{name} may name at most {MAX_TOKEN_LIST} tokens, got {len(getattr(self, name))}")
        if not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() and is_text(w) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of words (non-empty text), got {self.bad_words!r:.80}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.min_tokens and len(self.stop_token_ids) > MAX_MASKED_STOPS:
            raise ValueError(f"with min_tokens, stop_token_ids may name at most {MAX_MASKED_STOPS} tokens, "
                             f"got {len(self.stop_token_ids)}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str) or not isinstance(_json_or_none(self.json_schema), dict):
                raise ValueError(f"json_schema must be the JSON text of a schema object, got {self.json_schema!r:.80}")
        if self.structural_tag is not None and not (isinstance(self.structural_tag, str) and is_text(self.structural_tag)
                                                    and isinstance(_json_or_none(self.structural_tag), dict)):
            raise ValueError(f"structural_tag must be the JSON text of a structural tag object, got "
                             f"{self.structural_tag!r:.80}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        if self.reasoning_ended is not None and not isinstance(self.reasoning_ended, bool):
            raise ValueError(f"reasoning_ended must be a boolean or None, got {self.reasoning_ended!r}")
        if self.reasoning_kwargs is not None and not isinstance(self.reasoning_kwargs, str):
            raise ValueError(f"reasoning_kwargs must be JSON text or None, got {self.reasoning_kwargs!r}")
        if _is_int(self.thinking_token_budget) and self.thinking_token_budget == -1:  # vLLM's "no limit"
            object.__setattr__(self, "thinking_token_budget", None)
        if self.thinking_token_budget is not None and not (_is_int(self.thinking_token_budget)
                                                           and self.thinking_token_budget >= 0):
            raise ValueError("thinking_token_budget must be an integer >= 0, or -1 for no limit, got "
                             f"{self.thinking_token_budget!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value and is_text(value)):
                raise ValueError(f"{name} must be a non-empty string of text, got {value!r:.80}")
        if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) and is_text(c) for c in self.choice):
            raise ValueError(f"choice must be a list of strings of text, got {self.choice!r:.80}")
        object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.structured_kinds
        if len(kinds) > 1:
            raise ValueError(f"{' and '.join(kinds)} exclude each other: a structured output has one kind")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded_random(self) -> bool:
        """Random sampling from a seed: its generator's state is per request and per engine."""
        return not self.greedy and self.seed is not None

    @property
    def structured_kinds(self) -> tuple[str, ...]:
        """The structured-output kinds asked for (one at most in valid parameters)."""
        return tuple(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False, ()))

    @property
    def resume_breaks(self) -> str:
        """Why this request cannot go on from its output so far on another engine ("" when it can):
        a structured output's grammar starts over there, so it would begin a second document."""
        if self.structured_kinds:
            return "a structured output's grammar would start over"
        return ""

    @property
    def counts_own_output(self) -> str:
        """Which option depends on what this request generated rather than on its whole sequence
        ("" when none): resumed with its output as prompt, such a request would sample differently."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.bad_words:
            return "bad_words"
        return ""


def token_ids(values: object, name: str) -> tuple[int, ...]:
    """Token ids (integers >= 0) from any iterable of them but text or a mapping."""
    ids = None if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable) else tuple(values)
    if ids is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and is_token_id(int(t))
                              for t in ids):
        raise ValueError(f"{name} must be a list of token ids (integers >= 0), got {values!r:.80}")
    return tuple(int(t) for t in ids)  # numpy's integers as Python's, which comms carry


def is_token_id(value: object) -> bool:
    """An integer >= 0 that comms carry."""
    return _is_int(value) and 0 <= value < INT64


def are_token_ids(values: Sequence[object]) -> bool:
    """`is_token_id` of every value; in C for plain integers, the usual case (prompts run to
    thousands of tokens, and every request is checked)."""
    if values and set(map(type, values)) == {int}:
        return 0 <= min(values) and max(values) < INT64  # type: ignore[type-var]
    return all(is_token_id(v) for v in values)


def is_text(value: str) -> bool:
    """Encodable as UTF-8 (no lone surrogate), as every string that crosses comms must be."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite JSON number (an integer past a float's range is none: vLLM reads floats)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _logit_bias(pairs: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias in [-100, 100]) pairs from pairs or a {token id: bias} mapping (ids may be
    decimal strings, as JSON object keys are), sorted by id; a repeated id: the last wins."""
    items = pairs.items() if isinstance(pairs, dict) else pairs
    out: dict[int, float] = {}
    try:
        for token, bias in items:
            if isinstance(token, str) and token.isdecimal():
                token = int(token)
            if not (_is_int(token) and token >= 0 and is_number(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: {token!r} -> {bias!r}")
            out[token] = float(bias)
    except (TypeError, ValueError):
        raise ValueError("logit_bias must map token ids (integers >= 0) to biases in [-100, 100], "
                         f"got {pairs!r}") from None
    return tuple(sorted(out.items()))


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
    # Times the request moved to another instance (its KV, or its place in a queue).
    migrations: int = 0
    # Prompt tokens found in the engine's prefix cache when first scheduled (None: not reported).
    cached_tokens: int | None = None

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
    # vLLM's `cache_salt`: only requests with the same salt share cached prompt blocks, so one
    # tenant cannot time another's prompts through the prefix cache. None: shared by all unsalted.
    cache_salt: str | None = None
    timing: RequestTiming = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if not are_token_ids(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: prompt tokens must be non-negative 64-bit integers")
        self.prompt_token_ids = list(self.prompt_token_ids)
        check_cache_salt(self.cache_salt)
        self.scheduling_priority = Priority.parse(self.scheduling_priority)
        self.execution_priority = Priority.parse(self.execution_priority)
        self.timing = RequestTiming(arrival=self.arrival_time)

    @classmethod
    def arriving(cls, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                 priority: Priority | str | int, now: float, cache_salt: str | None) -> "Request":
        """A request a client submits now: one priority for queueing and execution alike."""
        return cls(request_id, list(prompt_token_ids), sampling, scheduling_priority=priority,
                   execution_priority=priority, arrival_time=now, cache_salt=cache_salt)

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


# vLLM's server's bounds on a cache salt (`validate_cache_salt`): it keys cache backends with it.
MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


def check_cache_salt(cache_salt: Any) -> None:
    """A cache salt is None or, as vLLM's server takes it, a non-empty string of at most 128
    characters without '@', '/', '\\' or NUL (and text UTF-8 can carry)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string when given, got {cache_salt!r:.80}")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH or not _CACHE_SALT_FORBIDDEN.isdisjoint(cache_salt):
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters and must not contain "
                         "'@', '/', '\\' or NUL")
    if not is_text(cache_salt):
        raise ValueError("cache_salt must be valid Unicode text (it has a lone surrogate)")


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)
