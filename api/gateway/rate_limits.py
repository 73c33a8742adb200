"""Per-API-key rate limits, as OpenAI's: requests per minute and tokens per minute.

Each key (all unauthenticated requests share one) has two token buckets, refilled continuously
at their per-minute rate up to one minute's worth. A request takes one request and the tokens it
may use (prompt plus max_tokens for every choice) when it is admitted; what its choices did not
generate goes back when it ends. A request that finds a bucket short is answered 429
(`rate_limit_exceeded`) with the seconds until it would fit as retry-after, and takes nothing.
Keys are held by their digest, never as given.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from llumdask.api.gateway.errors import TooManyRequests

ANONYMOUS = "anonymous"


class RateLimited(TooManyRequests):
    code = "rate_limit_exceeded"


def key_id(api_key: str | None) -> str:
    """What the limits are kept by: a digest of the key (never the key itself)."""
    return ANONYMOUS if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()[:16]


@dataclass
class _Bucket:
    per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def wait(self, amount: float) -> float:
        """Seconds until `amount` fits (0: now; inf: never, more than a minute's worth)."""
        if amount > self.per_minute:
            return math.inf
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)


@dataclass(frozen=True)
class Charge:
    """What one admitted request took from its key's buckets."""

    key: str
    tokens: int


class RateLimits:
    """The buckets of every key seen; `admit` and `refund` run on the gateway's event loop."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = {"requests": requests_per_minute, "tokens": tokens_per_minute}
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def __bool__(self) -> bool:
        return any(limit is not None for limit in self._limits.values())

    def admit(self, key: str, tokens: int) -> Charge:
        """Take one request and `tokens` for `key`, or raise RateLimited (taking nothing)."""
        now = self._clock()
        wanted = {"requests": 1, "tokens": tokens}
        buckets = {kind: self._bucket(key, kind, now) for kind in wanted if self._limits[kind] is not None}
        for kind, bucket in buckets.items():
            wait = bucket.wait(wanted[kind])
            if math.isinf(wait):
                raise RateLimited(f"This request needs {wanted[kind]} {kind}, more than the {bucket.per_minute:g} "
                                  f"{kind} per minute this key may use", 60.0)
            if wait > 0:
                raise RateLimited(f"Rate limit reached: {bucket.per_minute:g} {kind} per minute; "
                                  f"retry after {wait:.1f} s", wait)
        for kind, bucket in buckets.items():
            bucket.level -= wanted[kind]
        return Charge(key, tokens)

    def refund(self, charge: Charge, unused_tokens: int) -> None:
        """Give back the tokens an admitted request did not use."""
        bucket = self._buckets.get((charge.key, "tokens"))
        if bucket is not None and unused_tokens > 0:
            bucket.refill(self._clock())
            bucket.level = min(bucket.per_minute, bucket.level + unused_tokens)

    def _bucket(self, key: str, kind: str, now: float) -> _Bucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            limit = float(self._limits[kind])  # type: ignore[arg-type]
            bucket = self._buckets[(key, kind)] = _Bucket(limit, limit, now)
        bucket.refill(now)
        return bucket
