"""An instance's load, computed from a constant-size load report: the two loads of Llumnix.

An instance reports sums, not per-request lists, so the global scheduler's work per report and
per decision is O(1) in the number of requests. Two loads are read from the same sums, each for
one decision (Llumnix's own implementation keeps them apart the same way):

- the *migration load* (paper Algorithm 1 as written) drives pairing and scaling's drain. Its
  virtual usage counts, besides physical blocks, only the head-of-line waiting request's demand,
  and it is divided by the running requests: an instance with a queue looks crowded, which is
  what makes it give requests away (de-fragmentation);
  - waiting requests: only the head of the line counts, with its demand (the blocks it still
    needs: its tokens' less those it holds);
  - running normal-priority requests: their physical blocks;
  - running high-priority requests: physical blocks + headroom[p] / n_p each, which sums to
    headroom[p] for the whole class whenever n_p > 0;
  - a terminating instance: +inf (a fake request that drains it by migration);
  - blocks reserved for an incoming migration: counted as used (the request is on its way).
- the *dispatch load* places new requests: free blocks minus the demand of **every** waiting
  request and of every request dispatched but not yet reported, divided by all of them (running,
  waiting and pending). Counting only the head of the line would make an instance busy with one
  long prefill look free, so it would collect a queue and prefill it in one big step later.
  Priority headroom counts for every class present on the instance and for the arriving
  request's class, so high-priority work concentrates where its headroom is already paid.

In both, an overloaded instance's deficit is multiplied by its request count, never divided.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from llumdask.request import Priority


_DIGITS = re.compile(r"(\d+)")

# The counters of a report; none can be negative.
_COUNTS = (
    "num_running", "num_waiting", "head_of_line_demand", "waiting_demand", "pending_prefill_tokens",
    "reserved_blocks", "num_migrating_out", "num_migrating_in", "num_preemptions", "num_received", "num_pinned",
    "drain_order",
)
_counts = operator.attrgetter(*_COUNTS)


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load report. Plain data: it crosses process boundaries as a dict."""

    instance_id: str
    total_blocks: int
    block_size: int
    free_blocks: int
    num_running: int
    num_waiting: int
    # Physical blocks held by running requests, and how many running requests, per execution priority.
    running_blocks: Mapping[Priority, int] = field(default_factory=dict)
    running_count: Mapping[Priority, int] = field(default_factory=dict)
    # Blocks the head-of-line waiting request still needs for its tokens (0 when nothing waits).
    head_of_line_demand: int = 0
    # Blocks every waiting request still needs (INFaaS++ counts the whole queue).
    waiting_demand: int = 0
    # Tokens of waiting requests that the blocks they hold do not cover: prefill work not yet done
    # (LMetric's signal).
    pending_prefill_tokens: int = 0
    reserved_blocks: int = 0
    num_migrating_out: int = 0
    num_migrating_in: int = 0
    num_preemptions: int = 0
    # Requests this instance has ever been handed (dispatch accounting on the scheduler side).
    num_received: int = 0
    # Running requests that never migrate (their sampling cannot move exactly).
    num_pinned: int = 0
    terminating: bool = False
    # The number of the last drain order (drain or take back) the instance had heard when it made
    # the report: a report made before the latest one reached it carries a stale `terminating`.
    drain_order: int = 0
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        # Checked on every report (the simulator builds hundreds of thousands): one cheap test
        # for the common case, the message only when something is wrong.
        if self.total_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"{self.instance_id}: total_blocks and block_size must be positive")
        if not 0 <= self.free_blocks <= self.total_blocks:
            raise ValueError(f"{self.instance_id}: free_blocks {self.free_blocks} outside [0, {self.total_blocks}]")
        if min(_counts(self)) < 0:
            name = next(n for n in _COUNTS if getattr(self, n) < 0)
            raise ValueError(f"{self.instance_id}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("running_blocks", "running_count"):
            values = _per_priority(getattr(self, name))
            object.__setattr__(self, name, values)
            if values and min(values.values()) < 0:
                raise ValueError(f"{self.instance_id}: {name} must be >= 0 for every priority, got {values}")

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    def to_dict(self) -> dict:
        """msgpack-native form (enum keys become ints) for scheduler comms."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["running_blocks"] = {int(p): b for p, b in self.running_blocks.items()}
        d["running_count"] = {int(p): c for p, c in self.running_count.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "InstanceLoad":
        d = dict(d)
        d["running_blocks"] = {Priority(int(p)): b for p, b in d.get("running_blocks", {}).items()}
        d["running_count"] = {Priority(int(p)): c for p, c in d.get("running_count", {}).items()}
        return cls(**d)


def _per_priority(values: Mapping) -> dict[Priority, int]:
    """A copy keyed by `Priority` with int values (the wire's int keys converted)."""
    for priority, value in values.items():
        if type(priority) is not Priority or type(value) is not int:
            return {Priority(p): int(v) for p, v in values.items()}
    return dict(values)


def headroom_blocks(headroom_tokens: Mapping[Priority, int], block_size: int) -> dict[Priority, int]:
    """Convert per-priority headroom from tokens (the config's unit) to blocks."""
    return {Priority(p): -(-int(t) // block_size) for p, t in headroom_tokens.items()}


def virtual_usage(
    load: InstanceLoad,
    headroom: Mapping[Priority, int],
    *,
    extra_demand: int = 0,
    normal_only: bool = False,
) -> float:
    """Sum of the virtual usages of an instance's requests, in blocks (Algorithm 1).

    `headroom` is in blocks per execution priority. `extra_demand` adds the demand of requests
    dispatched to the instance but not yet in its report. `normal_only` ignores the priority
    headroom (the scaling policy measures normal-priority load only).
    """
    if load.terminating:
        return math.inf
    # Blocks reserved for incoming migrations are spoken for: count them like a running request's.
    usage = float(sum(load.running_blocks.values()) + load.reserved_blocks + load.head_of_line_demand + extra_demand)
    if not normal_only:
        for priority, count in load.running_count.items():
            if count > 0:
                usage += headroom.get(priority, 0)
    return usage


def migration_freeness(
    load: InstanceLoad, headroom: Mapping[Priority, int], *, extra_demand: int = 0, normal_only: bool = False
) -> float:
    """The migration load as freeness: F = (M - ΣV) / B over running requests; higher is freer.

    Two definitions the paper leaves open, chosen so that F is a total order that adding load
    never raises:
    - B = 0 divides by 1, so an empty instance has F = M, the largest value any instance of that
      capacity can reach (F <= M - ΣV <= M whenever B >= 1).
    - When the instance is overloaded (M - ΣV < 0) the deficit is multiplied by B instead of
      divided: the paper's division would make a more crowded overloaded instance look freer.
    A terminating instance has F = -inf. F is never NaN.
    """
    usage = virtual_usage(load, headroom, extra_demand=extra_demand, normal_only=normal_only)
    if math.isinf(usage):
        return -math.inf
    return per_request(load.total_blocks - usage, load.num_running)


def dispatch_usage(
    load: InstanceLoad,
    headroom: Mapping[Priority, int],
    *,
    pending_blocks: int = 0,
    classes: Iterable[Priority] = (),
) -> float:
    """Blocks spoken for, as dispatch sees them: physical and reserved blocks, the demand of the
    whole waiting queue and of `pending_blocks` dispatched but unreported, and the headroom of
    each execution priority running there or named in `classes` (pending ones, the arriving one)."""
    if load.terminating:
        return math.inf
    usage = float(sum(load.running_blocks.values()) + load.reserved_blocks + load.waiting_demand + pending_blocks)
    present = {p for p, n in load.running_count.items() if n > 0}.union(classes)
    return usage + sum(headroom.get(p, 0) for p in present)


def dispatch_freeness(
    load: InstanceLoad,
    headroom: Mapping[Priority, int],
    *,
    pending_blocks: int = 0,
    pending_requests: int = 0,
    classes: Iterable[Priority] = (),
) -> float:
    """The dispatch load as freeness: free blocks after every queued demand, per request (running,
    waiting and pending). Same conventions as `migration_freeness`: an empty instance has F = M,
    an overloaded one its deficit times its requests, a terminating one -inf."""
    usage = dispatch_usage(load, headroom, pending_blocks=pending_blocks, classes=classes)
    if math.isinf(usage):
        return -math.inf
    return per_request(load.total_blocks - usage, load.num_running + load.num_waiting + pending_requests)


def per_request(surplus: float, requests: int) -> float:
    """Surplus blocks per request; a deficit is multiplied by the requests (more of them: less free),
    and no request counts as one (an empty instance's F is its surplus)."""
    n = max(requests, 1)
    return surplus / n if surplus >= 0 else surplus * n


@dataclass(frozen=True)
class PooledLoad:
    """The cluster as one instance, for scaling: sums over instances of normal-priority dispatch
    usage (headroom is a placement choice, not demand). A mean of per-instance freeness would let
    one idle instance (F = M) lift the mean over any band."""

    total_blocks: int
    surplus: float
    requests: int
    instances: int

    @classmethod
    def of(cls, instances: Iterable[tuple[InstanceLoad, int, int]]) -> "PooledLoad":
        """From (report, pending blocks, pending requests) of every instance counted."""
        total = requests = count = 0
        surplus = 0.0
        for load, pending_blocks, pending_requests in instances:
            total += load.total_blocks
            surplus += load.total_blocks - dispatch_usage(load, {}, pending_blocks=pending_blocks)
            requests += load.num_running + load.num_waiting + pending_requests
            count += 1
        return cls(total, surplus, requests, count)

    def __add__(self, other: "PooledLoad") -> "PooledLoad":
        return PooledLoad(self.total_blocks + other.total_blocks, self.surplus + other.surplus,
                          self.requests + other.requests, self.instances + other.instances)

    @property
    def freeness(self) -> float:
        return per_request(self.surplus, self.requests)

    def instances_short(self, low: float) -> int:
        """Instances of the mean capacity to add to bring the pooled freeness up to `low` (0 if none)."""
        if self.instances == 0:
            return 1
        capacity = self.total_blocks / self.instances
        missing = low * max(self.requests, 1) - self.surplus
        return max(0, math.ceil(missing / capacity)) if missing > 0 else 0

    def keeps(self, high: float, leaving_blocks: int) -> bool:
        """Whether the pooled freeness stays at least `high` once instances of `leaving_blocks`
        in all leave (their requests moving to the rest): how far scaling in by the surplus, the
        mirror of `instances_short`, may go."""
        return per_request(self.surplus - leaving_blocks, self.requests) >= high


@functools.lru_cache(maxsize=65536)
def instance_order(instance_id: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """Natural order of ids (instance-2 before instance-10, ports by number), then the id itself
    ("01" and "1" differ): every tie-break. Each text part is paired with the number after it."""
    parts = _DIGITS.split(instance_id)
    numbers = [int(n) for n in parts[1::2]] + [-1]
    return tuple(zip(parts[::2], numbers)), instance_id


def freeness_key(instance_id: str, value: float) -> tuple[float, tuple]:
    """Sort key giving a strict total order over instances: freeness, then id (natural order)."""
    return (value, instance_order(instance_id))
