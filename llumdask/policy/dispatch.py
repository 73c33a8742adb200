"""Dispatch policies: which ready instance receives a new request.

Each policy is a small object whose `choose(candidates, info)` returns an instance id. The
candidates are the global scheduler's per-instance records (read-only here), in natural id
order: the last load report plus the requests dispatched there that the report does not show
yet ("pending"), so that every policy sees a burst that has not been reported and does not pile
it onto one instance. Policies look at each candidate once: O(#instances) per request, the
dispatch load in one numpy pass over the table's columns (`llumdask.policy.candidates`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from llumdask.config import DispatchConfig
from llumdask.policy.candidates import Candidate, CandidateTable
from llumdask.policy.registry import Registry
from llumdask.request import Priority, blocks_for


@dataclass(frozen=True)
class DispatchInfo:
    """What the scheduler knows about a request at dispatch: no tokens, only sizes and priorities."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    execution_priority: Priority = Priority.NORMAL
    # Admitted before (resubmitted after its instance died): never refused for load.
    admitted: bool = False
    # The prompt's anchor-block hashes (`llumdask.prefix.anchors`), for prefix-aware placement;
    # () if unknown.
    block_hashes: tuple[int, ...] = ()
    # Requests placed together, this one and count - 1 like it (the choices of one completion):
    # placed where this one would go, all pending there, their room counted together (each copy
    # its prompt's blocks and one more request), as vLLM runs each choice as a request.
    count: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        for name in ("num_prompt_tokens", "max_tokens", "count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"request {self.request_id}: {name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "execution_priority", Priority.parse(self.execution_priority))
        hashes = self.block_hashes
        if not isinstance(hashes, tuple) or not all(type(h) is int and 0 <= h < 2**64 for h in hashes):
            raise ValueError(f"request {self.request_id}: block_hashes must be a tuple of unsigned 64-bit integers")


class DispatchPolicy:
    """Base of the dispatch policies. `candidates` is never empty (the scheduler checks)."""

    @classmethod
    def from_config(cls, config: DispatchConfig) -> DispatchPolicy:
        return cls()

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        raise NotImplementedError


class LlumnixDispatch(DispatchPolicy):
    """Llumnix: the highest dispatch freeness once this request is added there; but where memory
    is not the constraint, the least interference.

    Every queued and pending demand counts, and the request's own: an instance whose free blocks
    per request look plentiful but cannot hold this prompt is overloaded for it. A high-priority
    request pays its class's headroom where none of its class runs yet, so it joins high-priority
    work already placed. Ties: the larger id.

    Freeness only measures memory. When at least two instances would keep `interference_freeness`
    blocks per request with this request added (room to spare: migration would treat them as
    destinations), memory does not tell them apart, and the request goes to the one of them where
    it waits behind the least prefill work and its own prefill stalls the fewest decodes
    (`CandidateTable.interference`; ties: the smaller id). Memory-blind routers that do only this
    queue and preempt under memory pressure; memory-only ones let short requests share steps with
    long prefills, which is what a decode's P99 is made of when memory is plentiful.
    """

    def __init__(self, interference_freeness: float | None = None, prefix_aware: bool = False) -> None:
        self._roomy = math.inf if interference_freeness is None else interference_freeness
        self._prefix_aware = prefix_aware

    @classmethod
    def from_config(cls, config: DispatchConfig) -> DispatchPolicy:
        return cls(config.interference_freeness, config.prefix_aware)

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        # Prefix-aware: a block an instance caches already is demand it need not pay, and prefill
        # it need not do; load still decides, so a crowded instance loses to a free one.
        cached = candidates.cached_blocks(info.block_hashes) if self._prefix_aware else None
        freeness = candidates.dispatch_freeness(info.num_prompt_tokens, info.execution_priority, cached, info.count)
        roomy = freeness >= self._roomy
        if np.count_nonzero(roomy) > 1:
            interference = np.where(roomy, candidates.interference(info.num_prompt_tokens, cached, info.count), np.inf)
            return candidates[int(np.argmin(interference))].instance_id
        return candidates[_last_max(freeness)].instance_id


class RoundRobinDispatch(DispatchPolicy):
    """Round-robin over instance ids in sorted order.

    It remembers the last id rather than a position, so instances joining or leaving do not
    make it skip or repeat one.
    """

    def __init__(self) -> None:
        self._last: tuple | None = None

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        last = self._last
        later = [c for c in candidates if c.order > last] if last is not None else ()
        chosen = min(later or candidates, key=attrgetter("order"))
        self._last = chosen.order
        return chosen.instance_id


class InfaasDispatch(DispatchPolicy):
    """INFaaS++: least memory load, counting the demand of every queued request.

    load = (used blocks + blocks the whole waiting queue needs + pending blocks) / total blocks;
    ties go to the smaller id.
    """

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        def memory_load(c: Candidate) -> tuple[float, tuple]:
            load = c.load
            demand = load.total_blocks - load.free_blocks + load.waiting_demand + c.pending_blocks
            return (demand / load.total_blocks, c.order)

        return min(candidates, key=memory_load).instance_id


class LMetricDispatch(DispatchPolicy):
    """LMetric: the least (new prefill tokens) x (batch size) after adding this request.

    score = (prompt tokens not yet prefilled on the instance + prompt tokens of the requests
    dispatched there but not reported + this request's prompt tokens) x (running requests + 1).
    The first factor approximates the prefill work this request waits behind, the second the
    decode interference it adds; the product needs no tuning knob. Ties go to the smaller id.
    """

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        prompt = info.num_prompt_tokens

        def score(c: Candidate) -> tuple[int, tuple]:
            load = c.load
            return ((load.pending_prefill_tokens + c.pending_prompt_tokens + prompt) * (load.num_running + 1), c.order)

        return min(candidates, key=score).instance_id


class PowerOfTwoDispatch(DispatchPolicy):
    """Power of two choices: two distinct random candidates (seeded), the freer by dispatch
    freeness with the request added wins."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_config(cls, config: DispatchConfig) -> DispatchPolicy:
        return cls(config.seed)

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        if len(candidates) == 1:
            return candidates[0].instance_id
        pair = sorted(self._rng.sample(range(len(candidates)), 2))
        freeness = candidates.dispatch_freeness(info.num_prompt_tokens, info.execution_priority, copies=info.count)[pair]
        return candidates[pair[_last_max(freeness)]].instance_id


class PrefixAffinityDispatch(DispatchPolicy):
    """Prefix affinity: the longest cached prefix of the prompt wins; ties (no match anywhere
    included) go to the highest dispatch freeness, then the larger id."""

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        freeness = candidates.dispatch_freeness(info.num_prompt_tokens, info.execution_priority, copies=info.count)
        cached = candidates.cached_blocks(info.block_hashes)
        if cached is None:
            return candidates[_last_max(freeness)].instance_id
        longest = cached == cached.max()
        return candidates[_last_max(np.where(longest, freeness, -np.inf))].instance_id


class DynamoKvDispatch(DispatchPolicy):
    """NVIDIA Dynamo's KV router at its defaults (overlap weight 1, temperature 0): the least
    cost = weight x prefill blocks it would compute there (prompt blocks not cached) + active
    blocks there with its own (used, queued and pending blocks, plus its prompt's). Ties: the
    smaller id."""

    OVERLAP_WEIGHT = 1.0

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        prompt = blocks_for(info.num_prompt_tokens, candidates[0].block_size)
        cached = candidates.cached_blocks(info.block_hashes)
        prefill = prompt - (cached if cached is not None else 0)
        active = np.fromiter((_active_blocks(c) for c in candidates), dtype=float, count=len(candidates)) + prompt
        return candidates[int(np.argmin(self.OVERLAP_WEIGHT * prefill + active))].instance_id


class SglangCacheAwareDispatch(DispatchPolicy):
    """SGLang's cache-aware router (sgl-model-gateway) at its documented defaults. Load is the
    requests an instance has (running, waiting, on their way). When load is imbalanced (the
    busiest has more than BALANCE_ABS more than the idlest and more than BALANCE_REL times as
    many) the least loaded takes it. Otherwise the instance caching the largest share of the
    prompt takes it if that share exceeds CACHE_THRESHOLD, else the one caching least (the most
    room to cache a new prefix). Its radix tree is read from the engines' reports here (the
    router approximates it from what it routed): the rule at its best. Ties: the smaller id."""

    CACHE_THRESHOLD = 0.3
    BALANCE_ABS = 64
    BALANCE_REL = 1.5

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        load = np.fromiter((c.dispatch_requests for c in candidates), dtype=float, count=len(candidates))
        busiest, idlest = load.max(), load.min()
        if busiest - idlest > self.BALANCE_ABS and busiest > idlest * self.BALANCE_REL:
            return candidates[int(np.argmin(load))].instance_id
        cached = candidates.cached_blocks(info.block_hashes)
        if cached is not None:
            share = cached * candidates[0].block_size / info.num_prompt_tokens
            best = int(np.argmax(share))
            if share[best] > self.CACHE_THRESHOLD:
                return candidates[best].instance_id
        return candidates[int(np.argmin(candidates.held_blocks()))].instance_id


class PriorityPoolsDispatch(DispatchPolicy):
    """Dedicated pools, the way a fleet serves premium traffic without rescheduling: the first
    `high_instances` instances in id order serve high-priority requests only, the rest normal ones,
    and a request goes to the freest of its pool by the dispatch load (ties: the larger id). A pool
    with no instance sends its requests to every instance. Against priority headroom it shows what
    isolating a class buys and what the capacity kept aside costs the other."""

    def __init__(self, high_instances: int = 0) -> None:
        if not isinstance(high_instances, int) or isinstance(high_instances, bool) or high_instances < 0:
            raise ValueError(f"high_instances must be an integer >= 0, got {high_instances!r}")
        self._high_instances = high_instances

    @classmethod
    def from_config(cls, config: DispatchConfig) -> DispatchPolicy:
        return cls(config.priority_pool_instances)

    def choose(self, candidates: CandidateTable, info: DispatchInfo) -> str:
        freeness = candidates.dispatch_freeness(info.num_prompt_tokens, info.execution_priority, copies=info.count)
        split = min(self._high_instances, len(candidates))
        pool = range(split) if info.execution_priority is Priority.HIGH else range(split, len(candidates))
        if not pool:
            pool = range(len(candidates))
        return candidates[pool.start + _last_max(freeness[pool.start:pool.stop])].instance_id


def _active_blocks(candidate: Candidate) -> int:
    load = candidate.load
    return load.total_blocks - load.free_blocks + load.waiting_demand + candidate.pending_blocks


def _last_max(values: np.ndarray) -> int:
    """Index of the largest value, the last of equal ones (candidates are in id order: the larger id wins)."""
    return len(values) - 1 - int(np.argmax(values[::-1]))


DISPATCH_POLICIES: Registry[type[DispatchPolicy]] = Registry(
    "dispatch policy",
    {
        "llumnix": LlumnixDispatch,
        "round_robin": RoundRobinDispatch,
        "infaas": InfaasDispatch,
        "lmetric": LMetricDispatch,
        "power_of_two": PowerOfTwoDispatch,
        "prefix_affinity": PrefixAffinityDispatch,
        "dynamo_kv": DynamoKvDispatch,
        "sglang_cache_aware": SglangCacheAwareDispatch,
        "priority_pools": PriorityPoolsDispatch,
    },
)


def make_dispatch_policy(config: DispatchConfig) -> DispatchPolicy:
    """The policy `config.policy` names; an unknown name is a ValueError listing the known ones."""
    return DISPATCH_POLICIES[config.policy].from_config(config)
