"""Each dispatch policy's choice, migration pairing and the scaling hysteresis, on hand-built clusters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import llumdask
from llumdask.config import DispatchConfig, MigrationConfig, ScalingConfig
from llumdask.load import InstanceLoad, dispatch_freeness, dispatch_usage, freeness_key, instance_order, migration_freeness
from llumdask.policy.candidates import CandidateTable
from llumdask.policy.dispatch import (
    DISPATCH_POLICIES,
    DispatchInfo,
    DynamoKvDispatch,
    InfaasDispatch,
    LlumnixDispatch,
    LMetricDispatch,
    PowerOfTwoDispatch,
    PrefixAffinityDispatch,
    PriorityPoolsDispatch,
    RoundRobinDispatch,
    SglangCacheAwareDispatch,
    make_dispatch_policy,
)
from llumdask.prefix import PrefixEvents, PrefixIndex, anchor_stride
from llumdask.policy.migration import MigrationPair, pair_migrations
from llumdask.policy.scaling import ScaleAction, ScaleDecision, ScalingPolicy
from llumdask.request import Priority

INFO = DispatchInfo("r", num_prompt_tokens=100, max_tokens=10)


@dataclass
class View:
    """A stand-in for the scheduler's per-instance record."""

    instance_id: str
    load: InstanceLoad
    terminating: bool = False
    num_pending: int = 0
    pending_blocks: int = 0
    pending_prompt_tokens: int = 0
    headroom: dict = field(default_factory=dict)
    freeness: float = field(init=False)
    key: tuple = field(init=False)
    order: tuple = field(init=False)
    block_size: int = field(init=False)
    dispatch_surplus: float = field(init=False)
    dispatch_requests: int = field(init=False)
    dispatch_freeness: float = field(init=False)

    def __post_init__(self) -> None:
        self.freeness = -math.inf if self.terminating else migration_freeness(self.load, self.headroom, extra_demand=self.pending_blocks)
        self.key = freeness_key(self.instance_id, self.freeness)
        self.order = instance_order(self.instance_id)
        self.block_size = self.load.block_size
        self.dispatch_surplus = self.load.total_blocks - dispatch_usage(self.load, self.headroom, pending_blocks=self.pending_blocks)
        self.dispatch_requests = self.load.num_running + self.load.num_waiting + self.num_pending
        self.dispatch_freeness = dispatch_freeness(self.load, self.headroom, pending_blocks=self.pending_blocks,
                                                   pending_requests=self.num_pending)

    def absent_charge(self, priority: Priority) -> int:
        return 0 if self.load.running_count.get(priority, 0) else self.headroom.get(priority, 0)


def choose(policy, views, info: DispatchInfo = None) -> str:
    return policy.choose(CandidateTable(views), info or INFO)


def view(
    instance_id: str,
    *,
    total: int = 100,
    used: int = 0,
    running: int | None = None,
    head: int = 0,
    queued: int = 0,
    prefill: int = 0,
    out: int = 0,
    into: int = 0,
    **kwargs,
) -> View:
    running = (1 if used else 0) if running is None else running
    load = InstanceLoad(
        instance_id, total, 16, total - used, running, 1 if queued else 0,
        running_blocks={Priority.NORMAL: used}, running_count={Priority.NORMAL: running},
        head_of_line_demand=head, waiting_demand=queued, pending_prefill_tokens=prefill,
        num_migrating_out=out, num_migrating_in=into,
    )
    return View(instance_id, load, **kwargs)


def with_freeness(instance_id: str, f: float, **kwargs) -> View:
    """A view with one running request on 1000 blocks and freeness `f` (rounded to an integer)."""
    if f == -math.inf:
        return view(instance_id, total=1000, used=10, terminating=True, **kwargs)
    usage = round(1000 - f)
    return view(instance_id, total=1000, used=min(usage, 1000), head=max(usage - 1000, 0), running=1, **kwargs)


# ---------------------------------------------------------------- registry


def test_registry_names_match_the_config_schema():
    schema = yaml.safe_load((Path(llumdask.__file__).parent / "llumdask-schema.yaml").read_text())
    enum = schema["properties"]["llumdask"]["properties"]["dispatch"]["properties"]["policy"]["enum"]
    assert set(DISPATCH_POLICIES.names()) == set(enum)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("llumnix", LlumnixDispatch), ("round_robin", RoundRobinDispatch), ("infaas", InfaasDispatch),
     ("lmetric", LMetricDispatch), ("power_of_two", PowerOfTwoDispatch), ("prefix_affinity", PrefixAffinityDispatch),
     ("dynamo_kv", DynamoKvDispatch), ("sglang_cache_aware", SglangCacheAwareDispatch),
     ("priority_pools", PriorityPoolsDispatch)],
)
def test_registry_builds_each_policy(name, cls):
    assert name in DISPATCH_POLICIES
    assert type(make_dispatch_policy(DispatchConfig(policy=name))) is cls


def test_unknown_policy_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown dispatch policy 'fastest'; registered: dynamo_kv, infaas, llumnix, lmetric"):
        DISPATCH_POLICIES["fastest"]


@pytest.mark.parametrize(
    "kwargs",
    [{"request_id": ""}, {"num_prompt_tokens": 0}, {"num_prompt_tokens": -5}, {"max_tokens": 0}, {"num_prompt_tokens": 1.5},
     {"count": 0}],
)
def test_dispatch_info_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        DispatchInfo(**{"request_id": "r", "num_prompt_tokens": 10, "max_tokens": 10, **kwargs})


def test_dispatch_info_parses_priorities():
    assert DispatchInfo("r", 10, 10, execution_priority="high").execution_priority is Priority.HIGH
    assert DispatchInfo("r", 10, 10, execution_priority=1).execution_priority is Priority.HIGH


# ---------------------------------------------------------------- dispatch policies


def test_llumnix_picks_the_freest_counting_pending_demand():
    cluster = [view("a", used=50), view("b", used=20), view("c", used=30)]
    assert choose(LlumnixDispatch(), cluster) == "b"
    cluster[1] = view("b", used=20, num_pending=1, pending_blocks=60)  # a burst sent there, unreported
    assert choose(LlumnixDispatch(), cluster) == "c"


def test_llumnix_prefers_fewer_running_at_equal_usage():
    # F = (M - V) / B: same blocks in use, smaller batch -> freer.
    cluster = [view("a", used=40, running=4), view("b", used=40, running=2)]
    assert choose(LlumnixDispatch(), cluster) == "b"


def test_llumnix_breaks_ties_by_the_freeness_key():
    cluster = [view("a"), view("c"), view("b")]
    assert choose(LlumnixDispatch(), cluster) == max("abc")


def test_llumnix_counts_the_arriving_request_so_free_per_request_must_hold_its_prompt():
    # a: 10 free blocks for its one request, b: 40 for ten. A 20-block prompt fits only on b.
    a, b = view("a", used=90, running=1), view("b", used=60, running=10)
    assert a.dispatch_freeness > b.dispatch_freeness
    assert choose(LlumnixDispatch(), [a, b], DispatchInfo("r", 16 * 20, 10)) == "b"
    assert choose(LlumnixDispatch(), [a, b], DispatchInfo("r", 16, 10)) == "a"  # one block: still a


def test_llumnix_goes_where_it_interferes_least_when_memory_is_plentiful():
    # Both keep far more than 16 free blocks per request with this one: a's queued prefill (300
    # tokens) would delay it and be stalled by it, b runs more decodes but has nothing queued.
    a = view("a", total=1000, used=50, running=2, prefill=300, queued=20)
    b = view("b", total=1000, used=200, running=4)
    assert a.dispatch_freeness > b.dispatch_freeness
    assert choose(LlumnixDispatch(16.0), [a, b]) == "b"  # (300 + 100) x 3 against (0 + 100) x 5
    assert choose(LlumnixDispatch(None), [a, b]) == "a"  # memory only: the freest
    # Where memory is short, memory decides: b keeps too little for this 720-block prompt.
    assert choose(LlumnixDispatch(16.0), [a, b], DispatchInfo("r", 16 * 720, 10)) == "a"


def test_llumnix_interference_counts_each_choice_placed_together():
    # Memory plentiful: a runs 6 decodes with nothing queued, b runs 4 behind 50 queued prefill tokens.
    a = view("a", total=1000, used=60, running=6)
    b = view("b", total=1000, used=40, running=4, prefill=50, queued=4)
    assert choose(LlumnixDispatch(16.0), [a, b], DispatchInfo("r", 100, 10)) == "a"  # 100 x 7 against 150 x 5
    # Four copies: four prefills, each stalling the decodes and the other copies: 400 x 10 against 450 x 8.
    assert choose(LlumnixDispatch(16.0), [a, b], DispatchInfo("r", 100, 10, count=4)) == "b"


def test_llumnix_interference_choice_counts_unreported_work():
    a, b = view("a", total=1000), view("b", total=1000, num_pending=1, pending_blocks=5, pending_prompt_tokens=80)
    assert choose(LlumnixDispatch(16.0), [a, b]) == "a"


def test_round_robin_cycles_over_sorted_ids_and_survives_membership_changes():
    policy = RoundRobinDispatch()
    cluster = [view("b"), view("a"), view("c")]
    assert [choose(policy, cluster) for _ in range(4)] == ["a", "b", "c", "a"]
    assert choose(policy, [view("a"), view("c")]) == "c"  # b left: no repeat, no skip
    assert choose(policy, [view("a"), view("b"), view("c"), view("d")]) == "d"
    assert choose(policy, [view("a"), view("b")]) == "a"


def test_dispatch_counts_the_whole_queue_where_migration_counts_its_head():
    # a: little in use, a long queue behind a small head; b: more in use, nothing queued.
    a = view("a", used=10, head=5, queued=80)
    b = view("b", used=40)
    assert choose(LlumnixDispatch(), [a, b]) == "b"  # with this request, a: 3 free blocks for 3 requests, b: 53 for 2
    assert choose(InfaasDispatch(), [a, b]) == "b"
    assert a.freeness > b.freeness  # yet a is the freer migration destination: its queue head fits


def test_infaas_normalises_by_capacity_and_counts_pending():
    small, big = view("small", total=100, used=30), view("big", total=400, used=80)
    assert choose(InfaasDispatch(), [small, big]) == "big"
    big = view("big", total=400, used=80, num_pending=2, pending_blocks=60)  # (80 + 60) / 400 > 30 / 100
    assert choose(InfaasDispatch(), [small, big]) == "small"


@pytest.mark.parametrize(("prompt", "expected"), [(200, "queued"), (10, "busy")])
def test_lmetric_multiplies_prefill_tokens_by_batch_size(prompt, expected):
    # queued: (1000 + prompt) x 1; busy: (0 + prompt) x 10.
    queued = view("queued", prefill=1000, running=0)
    busy = view("busy", used=50, running=9)
    assert choose(LMetricDispatch(), [queued, busy], DispatchInfo("r", prompt, 10)) == expected


def test_lmetric_counts_unreported_prompt_tokens():
    a, b = view("a"), view("b", num_pending=1, pending_prompt_tokens=500)
    assert choose(LMetricDispatch(), [a, b]) == "a"


def test_power_of_two_picks_the_freer_of_two_and_never_the_least_free():
    policy = PowerOfTwoDispatch(seed=3)
    pair = [view("a", used=50), view("b", used=10)]
    assert {choose(policy, pair) for _ in range(20)} == {"b"}
    cluster = [view(f"i{k}", used=10 * k) for k in range(6)]
    chosen = [choose(policy, cluster) for _ in range(300)]
    assert "i5" not in chosen
    assert len(set(chosen)) >= 3
    assert choose(policy, [view("only", used=90)]) == "only"


def test_power_of_two_is_seeded_from_the_config():
    cluster = [view(f"i{k}", used=k) for k in range(16)]

    def picks(seed: int) -> list[str]:
        policy = make_dispatch_policy(DispatchConfig(policy="power_of_two", seed=seed))
        return [choose(policy, cluster) for _ in range(40)]

    assert picks(1) == picks(1)
    assert picks(1) != picks(2)


HIGH = DispatchInfo("h", num_prompt_tokens=100, max_tokens=10, execution_priority=Priority.HIGH)


def test_priority_pools_keep_each_class_in_its_own_pool_and_take_its_freest():
    # i0 and i1 (the first two in natural order) are the high-priority pool; i10 is the freest of all.
    cluster = [view("i10", used=0), view("i2", used=60), view("i1", used=40), view("i0", used=50), view("i3", used=30)]
    policy = make_dispatch_policy(DispatchConfig(policy="priority_pools", priority_pool_instances=2))
    assert choose(policy, cluster, HIGH) == "i1"
    assert choose(policy, cluster) == "i10"
    assert choose(policy, [c for c in cluster if c.instance_id != "i10"]) == "i3"


@pytest.mark.parametrize("pool", [0, 5, 9])
def test_priority_pools_send_a_class_without_instances_anywhere(pool):
    cluster = [view(f"i{k}", used=50 - k) for k in range(5)]
    policy = PriorityPoolsDispatch(pool)
    assert choose(policy, cluster, HIGH if pool == 0 else INFO) == "i4"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_priority_pools_reject_a_bad_pool_size(bad):
    with pytest.raises(ValueError, match="high_instances must be an integer >= 0"):
        PriorityPoolsDispatch(bad)


# ---------------------------------------------------------------- prefix-aware dispatch
# A 1,280-token prompt: 80 blocks of 16, told by its 10 anchor blocks (one in 8: 128 tokens), hashes 1..10.
PREFIXED = DispatchInfo("p", num_prompt_tokens=1280, max_tokens=10, block_hashes=tuple(range(1, 11)))


def cached_on(holdings: dict[str, int]) -> PrefixIndex:
    """An index where each instance holds the first n anchors (8 n blocks) of PREFIXED's prompt."""
    index = PrefixIndex()
    for instance, n in holdings.items():
        index.apply(instance, PrefixEvents(stored=tuple(range(1, n + 1))))
    return index


def choose_with(policy, views, index, info=PREFIXED) -> str:
    return policy.choose(CandidateTable(views, index), info)


def test_llumnix_charges_only_the_blocks_an_instance_lacks_but_load_still_wins():
    index = cached_on({"a": 10})
    # Memory decides (no interference branch): "a" lacks none of the 80 prompt blocks, so it is
    # freer for this request (100 blocks left against 60) despite holding 40 more.
    tight = [view("a", total=1000, used=900, running=10), view("b", total=1000, used=860, running=10)]
    assert choose_with(LlumnixDispatch(prefix_aware=True), tight, index) == "a"
    assert choose_with(LlumnixDispatch(prefix_aware=False), tight, index) == "b"
    # Crowded beyond what the cache saves: the free instance wins.
    crowded = [view("a", total=1000, used=990, running=10), view("b", total=1000, used=850, running=10)]
    assert choose_with(LlumnixDispatch(prefix_aware=True), crowded, index) == "b"


def test_llumnix_with_room_everywhere_goes_where_the_least_prefill_remains():
    index = cached_on({"b": 10})
    roomy = [view("a", total=1000), view("b", total=1000, used=100, running=2)]
    assert choose_with(LlumnixDispatch(16.0, prefix_aware=True), roomy, index) == "b"
    assert choose_with(LlumnixDispatch(16.0, prefix_aware=False), roomy, index) == "a"


def test_prefix_affinity_takes_the_longest_match_and_breaks_ties_by_load():
    views = [view("a", used=10), view("b", used=90), view("c", used=50)]
    assert choose_with(PrefixAffinityDispatch(), views, cached_on({"b": 6, "c": 3})) == "b"
    assert choose_with(PrefixAffinityDispatch(), views, cached_on({"b": 4, "c": 4})) == "c"
    assert choose_with(PrefixAffinityDispatch(), views, PrefixIndex()) == "a"


def test_dynamo_kv_weighs_uncached_prefill_blocks_against_active_blocks():
    # cost = (80 - cached) + active + 80: a: 80 + 30 + 80; b: 64 + 35 + 80; c: 80 + 0 + 80 wins.
    views = [view("a", used=30), view("b", used=35), view("c")]
    assert choose_with(DynamoKvDispatch(), views, cached_on({"b": 2})) == "c"
    # With c busier (active 45: cost 205), b's cache decides: 179 against a's 190.
    views[2] = view("c", used=45)
    assert choose_with(DynamoKvDispatch(), views, cached_on({"b": 2})) == "b"


def test_sglang_cache_aware_follows_the_cache_unless_load_is_imbalanced():
    index = cached_on({"b": 4, "c": 2})  # 512 and 256 of 1,280 tokens: shares 0.4 and 0.2
    views = [view("a", running=1, used=1), view("b", running=20, used=20), view("c", running=1, used=1)]
    assert choose_with(SglangCacheAwareDispatch(), views, index) == "b"
    # Below the 0.3 threshold: the instance caching least ("a", nothing) takes it.
    assert choose_with(SglangCacheAwareDispatch(), views, cached_on({"b": 2})) == "a"
    # Imbalanced (80 - 1 > 64 and 80 > 1.5 x 1): the least loaded, whatever it caches.
    views[1] = view("b", total=1000, running=80, used=80)
    assert choose_with(SglangCacheAwareDispatch(), views, index) == "a"


def test_dispatch_info_checks_block_hashes():
    with pytest.raises(ValueError, match="block_hashes"):
        DispatchInfo("r", 10, 10, block_hashes=[1, 2])
    with pytest.raises(ValueError, match="block_hashes"):
        DispatchInfo("r", 10, 10, block_hashes=(-1,))


# ---------------------------------------------------------------- migration pairing

MIGRATION = MigrationConfig(low_threshold=2.0, high_threshold=16.0, max_concurrent=1)


def pairs(views, config=MIGRATION) -> list[tuple[str, str]]:
    return [(p.source, p.destination) for p in pair_migrations(views, config)]


def test_pairs_lowest_with_highest():
    cluster = [
        with_freeness("s1", 0), with_freeness("d1", 20), with_freeness("s2", -3), with_freeness("mid", 8),
        with_freeness("d2", 100), with_freeness("s3", 1), with_freeness("d3", 50),
    ]
    assert pairs(cluster) == [("s2", "d2"), ("s1", "d3"), ("s3", "d1")]
    assert all(isinstance(p, MigrationPair) for p in pair_migrations(cluster, MIGRATION))


def test_thresholds_are_strict():
    assert pairs([with_freeness("s", 2.0), with_freeness("d", 100)]) == []
    assert pairs([with_freeness("s", 1.0), with_freeness("d", 16.0)]) == []
    assert pairs([with_freeness("s", 1.0), with_freeness("d", 17.0)]) == [("s", "d")]


def test_terminating_instances_are_the_first_sources():
    cluster = [with_freeness("overloaded", -500), with_freeness("retiring", -math.inf), with_freeness("d", 100)]
    assert pairs(cluster) == [("retiring", "d")]


def test_a_terminating_instance_is_never_a_destination():
    free_but_retiring = view("r", total=1000, terminating=True)
    assert pairs([with_freeness("s", 0), free_but_retiring]) == []


def test_more_sources_than_destinations_pairs_only_as_many():
    cluster = [with_freeness("s1", 0), with_freeness("s2", 1), with_freeness("d", 30)]
    assert pairs(cluster) == [("s1", "d")]


def test_max_concurrent_from_the_reports():
    busy_source, busy_dest = with_freeness("s", 0, out=1), with_freeness("d", 100, into=1)
    assert pairs([busy_source, with_freeness("d2", 50)]) == []
    assert pairs([with_freeness("s2", 0), busy_dest]) == []
    two = MigrationConfig(low_threshold=2.0, high_threshold=16.0, max_concurrent=2)
    assert pairs([busy_source, busy_dest], two) == [("s", "d")]


def test_a_source_needs_a_request_to_give_and_a_queued_one_counts():
    queued_only = view("q", total=100, head=99, queued=99, running=0)
    assert queued_only.freeness < MIGRATION.low_threshold
    assert pairs([queued_only, with_freeness("d", 100)]) == [("q", "d")]



def test_a_queue_is_handed_over_first_when_draining_or_where_asked_and_the_destination_queues_nothing():
    def take(source, destination, config=MIGRATION) -> bool:
        (pair,) = pair_migrations([source, destination], config)
        return pair.take_waiting

    queued = view("q", total=100, head=99, queued=99, running=0)
    retiring = view("r", total=100, used=10, head=5, queued=5, terminating=True)
    idle, queueing = with_freeness("d", 100), view("dq", total=1000, used=10, queued=5, head=5)
    assert queueing.freeness > MIGRATION.high_threshold
    asked = replace(MIGRATION, hand_over_waiting=True)
    assert not take(queued, idle) and take(queued, idle, asked) and not take(queued, queueing, asked)
    assert take(retiring, idle) and not take(retiring, queueing)
    assert not take(with_freeness("s", 0), idle, asked)  # nothing waits at the source
    nothing = view("n", total=100, used=100, running=0)
    assert nothing.freeness < MIGRATION.low_threshold
    assert pairs([nothing, with_freeness("d", 100)]) == []


def test_a_source_whose_running_requests_are_all_pinned_has_none_to_give():
    def source(pinned: int) -> View:
        low = view("s", total=100, used=99, running=2)
        return View("s", replace(low.load, num_pinned=pinned))

    assert pairs([source(pinned=2), with_freeness("d", 100)]) == []
    assert pairs([source(pinned=1), with_freeness("d", 100)]) == [("s", "d")]


def test_a_destination_without_room_for_its_queue_is_passed_over_where_queue_room_is_set():
    # Free by the head of its line (F = 890), but its queue of two leaves a third of a block per request.
    queued = view("d1", total=1000, used=100, head=10, queued=899)
    crowded, roomy, source = View("d1", replace(queued.load, num_waiting=2)), with_freeness("d2", 50), with_freeness("s", 0)
    assert crowded.freeness > roomy.freeness > MIGRATION.high_threshold and crowded.dispatch_freeness == pytest.approx(1 / 3)
    assert pairs([source, crowded, roomy]) == [("s", "d1")]
    paired = pair_migrations([source, crowded, roomy], MIGRATION, queue_room=1.0)
    assert [(p.source, p.destination) for p in paired] == [("s", "d2")]
    assert pair_migrations([source, crowded], MIGRATION, queue_room=1.0) == []
    assert pair_migrations([source, crowded], MIGRATION, queue_room=0.3) == [MigrationPair("s", "d1")]


def test_disabled_migration_pairs_nothing():
    cluster = [with_freeness("s", -math.inf), with_freeness("d", 100)]
    assert pairs(cluster, MigrationConfig(enabled=False)) == []


freeness_values = st.one_of(st.just(-math.inf), st.floats(-200, 200, allow_nan=False))


@given(st.lists(st.tuples(freeness_values, st.integers(0, 2), st.integers(0, 2)), max_size=20), st.integers(1, 2))
def test_pairing_properties(spec, max_concurrent):
    cluster = [with_freeness(f"i{k:02d}", f, out=o, into=i) for k, (f, o, i) in enumerate(spec)]
    by_id = {v.instance_id: v for v in cluster}
    config = MigrationConfig(low_threshold=2.0, high_threshold=16.0, max_concurrent=max_concurrent)
    result = pair_migrations(cluster, config)
    sources = [by_id[p.source] for p in result]
    destinations = [by_id[p.destination] for p in result]
    ids = [p.source for p in result] + [p.destination for p in result]
    assert len(ids) == len(set(ids))  # an instance appears once per round
    assert all(s.freeness < 2.0 and s.load.num_migrating_out < max_concurrent for s in sources)
    assert all(d.freeness > 16.0 and not d.terminating and d.load.num_migrating_in < max_concurrent for d in destinations)
    assert [s.key for s in sources] == sorted(s.key for s in sources)
    assert [d.key for d in destinations] == sorted((d.key for d in destinations), reverse=True)
    eligible_sources = [v for v in cluster if v.freeness < 2.0 and v.load.num_migrating_out < max_concurrent]
    eligible_destinations = [v for v in cluster if v.freeness > 16.0 and v.load.num_migrating_in < max_concurrent]
    assert len(result) == min(len(eligible_sources), len(eligible_destinations))
    # No unpaired eligible source is less free than a paired one.
    if result:
        assert all(v.key >= sources[-1].key for v in eligible_sources if v not in sources)


# ---------------------------------------------------------------- scaling hysteresis

SCALING = ScalingConfig(enabled=True, band=(10.0, 60.0), scale_out_period=30.0, scale_in_period=30.0)


def feed(policy: ScalingPolicy, observations, *, can_add=True, can_terminate=True) -> list[tuple[float, ScaleAction]]:
    decisions = []
    for now, mean in observations:
        action = policy.observe(now, mean, can_add=can_add, can_terminate=can_terminate)
        if action is not None:
            decisions.append((now, action))
    return decisions


def test_oscillating_around_a_band_edge_never_decides():
    lower_edge = [(t, 9.0 if (t // 10) % 2 else 11.0) for t in range(0, 600)]
    upper_edge = [(t, 59.0 if (t // 25) % 2 else 61.0) for t in range(0, 600)]
    assert feed(ScalingPolicy(SCALING), lower_edge) == []
    assert feed(ScalingPolicy(SCALING), upper_edge) == []


def test_sustained_low_adds_after_the_period_then_waits_another():
    decisions = feed(ScalingPolicy(SCALING), [(t / 2, 5.0) for t in range(0, 200)])
    assert decisions == [(30.0, ScaleAction.ADD), (60.0, ScaleAction.ADD), (90.0, ScaleAction.ADD)]


def test_sustained_high_terminates():
    assert feed(ScalingPolicy(SCALING), [(t, 80.0) for t in range(0, 31)]) == [(30, ScaleAction.TERMINATE)]


def test_a_break_restarts_the_timer():
    observations = [(t, 5.0) for t in range(0, 21)] + [(25, 30.0)] + [(t, 5.0) for t in range(26, 60)]
    assert feed(ScalingPolicy(SCALING), observations) == [(56, ScaleAction.ADD)]


def test_a_load_step_restarts_the_timer_for_the_new_condition():
    observations = [(t, 5.0) for t in range(0, 20)] + [(t, 80.0) for t in range(20, 51)]
    assert feed(ScalingPolicy(SCALING), observations) == [(50, ScaleAction.TERMINATE)]


def test_no_instance_to_measure_is_no_condition():
    observations = [(0, 5.0), (20, None), (31, 5.0), (50, 5.0)]
    assert feed(ScalingPolicy(SCALING), observations) == []


def test_an_action_not_possible_waits_without_restarting_the_timer():
    policy = ScalingPolicy(SCALING)
    assert feed(policy, [(t, 5.0) for t in range(0, 40)], can_add=False) == []
    assert policy.observe(40, 5.0, can_add=True, can_terminate=True) is ScaleAction.ADD
    assert policy.observe(41, 5.0, can_add=True, can_terminate=True) is None


def test_zero_period_decides_at_once():
    policy = ScalingPolicy(ScalingConfig(enabled=True, scale_out_period=0.0, scale_in_period=0.0))
    assert policy.observe(0.0, 5.0, can_add=True, can_terminate=True) is ScaleAction.ADD


def test_scale_decision_is_falsy_when_empty():
    assert not ScaleDecision()
    assert ScaleDecision(add=1) and ScaleDecision(remove=("a",))


means = st.one_of(st.none(), st.floats(0, 100, allow_nan=False))


@given(st.lists(st.tuples(st.floats(0, 5, allow_nan=False), means), max_size=80))
def test_every_decision_follows_a_full_period_of_its_condition(steps):
    policy = ScalingPolicy(SCALING)
    now, observed, decisions = 0.0, [], []
    for dt, mean in steps:
        now += dt
        condition = None if mean is None else ScaleAction.ADD if mean < 10 else ScaleAction.TERMINATE if mean > 60 else None
        observed.append((now, condition))
        action = policy.observe(now, mean, can_add=True, can_terminate=True)
        if action is not None:
            decisions.append((now, action, len(observed)))
    for now, action, count in decisions:
        # The streak of this condition up to the decision started at least a period earlier...
        streak = observed[:count]
        start = count
        while start > 0 and streak[start - 1][1] is action:
            start -= 1
        assert now - streak[start][0] >= SCALING.scale_in_period
    # ...and decisions are a full period apart.
    times = [t for t, _, _ in decisions]
    assert all(b - a >= SCALING.scale_in_period for a, b in zip(times, times[1:]))


def test_the_candidate_table_follows_a_class_arriving_and_leaving_after_it_was_built():
    headroom = {Priority.HIGH: 30, Priority.NORMAL: 0}

    def loaded(k: int, high: bool) -> View:
        cls = Priority.HIGH if high else Priority.NORMAL
        load = InstanceLoad(f"i{k}", 100, 16, 80, 1, 0, running_blocks={cls: 20}, running_count={cls: 1})
        return View(f"i{k}", load, headroom=headroom)

    table = CandidateTable([loaded(0, True), loaded(1, True)])  # no charge anywhere
    for high in (False, True, False):
        table.update(loaded(1, high))
        expected = [dispatch_freeness(v.load, headroom, pending_blocks=1, pending_requests=1, classes=(Priority.HIGH,))
                    for v in (loaded(0, True), loaded(1, high))]
        assert list(table.dispatch_freeness(16, Priority.HIGH)) == pytest.approx(expected)


@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 8), st.integers(0, 3), st.integers(0, 60), st.integers(0, 3),
                       st.booleans()), min_size=1, max_size=6),
    st.integers(1, 2000),
    st.sampled_from(list(Priority)),
    st.integers(1, 4),
)
def test_the_candidate_table_computes_what_the_dispatch_load_says(specs, prompt, priority, copies):
    headroom = {Priority.HIGH: 30, Priority.NORMAL: 0}
    views = []
    for k, (used, running, waiting, pending_blocks, pending, high) in enumerate(specs):
        running = max(running, 1 if used else 0)
        cls = Priority.HIGH if high else Priority.NORMAL
        load = InstanceLoad(f"i{k}", 100, 16, 100 - used, running, waiting, running_blocks={cls: used},
                            running_count={cls: running}, waiting_demand=3 * waiting)
        views.append(View(f"i{k}", load, num_pending=pending, pending_blocks=pending_blocks, headroom=headroom))
    table = CandidateTable(views)
    got = table.dispatch_freeness(prompt, priority, copies=copies)
    demand = -(-prompt // 16)
    for value, v in zip(got, table):
        expected = dispatch_freeness(v.load, headroom, pending_blocks=v.pending_blocks + copies * demand,
                                     pending_requests=v.num_pending + copies, classes=(priority,))
        assert value == pytest.approx(expected)


_SPEC = st.tuples(st.integers(0, 100), st.integers(0, 8), st.integers(0, 3), st.integers(0, 60), st.integers(0, 3),
                  st.booleans(), st.sampled_from([16, 32]))


def _spec_view(k: int, spec: tuple) -> View:
    used, running, waiting, pending_blocks, pending, high, block_size = spec
    cls = Priority.HIGH if high else Priority.NORMAL
    load = InstanceLoad(f"i{k}", 100, block_size, 100 - used, max(running, 1 if used else 0), waiting,
                        running_blocks={cls: used}, running_count={cls: max(running, 1 if used else 0)},
                        waiting_demand=3 * waiting)
    return View(f"i{k}", load, num_pending=pending, pending_blocks=pending_blocks,
                headroom={Priority.HIGH: 30, Priority.NORMAL: 0})


@given(
    st.lists(_SPEC, min_size=1, max_size=5),
    st.lists(st.one_of(st.tuples(st.just("update"), st.integers(0, 4), _SPEC),
                       st.tuples(st.just("reserve"), st.one_of(st.none(), st.integers(0, 4)))), max_size=12),
    st.integers(1, 2000),
    st.sampled_from(list(Priority)),
    st.booleans(),
    st.integers(1, 3),
)
def test_the_candidate_tables_kept_answer_is_a_fresh_tables_after_every_change(specs, changes, prompt, priority, with_cache,
                                                                               copies):
    """The table keeps its last answer up to date as candidates change and slots are reserved,
    instead of computing it again: bit for bit what a table built now answers, freest slot too."""
    views = [_spec_view(k, spec) for k, spec in enumerate(specs)]
    cached = np.arange(len(views), dtype=float) if with_cache else None
    table = CandidateTable(views)
    reserved = None
    for change in [None, *changes]:
        if change is not None and change[0] == "update":
            k = change[1] % len(views)
            views[k] = _spec_view(k, (*change[2][:-1], specs[k][-1]))  # an instance keeps its block size
            table.update(views[k])
        elif change is not None:
            reserved = None if change[1] is None else change[1] % len(views)
            table.reserve(reserved)
        fresh = CandidateTable(views)
        fresh.reserve(reserved)
        expected = fresh.dispatch_freeness(prompt, priority, cached)
        assert table.dispatch_freeness(prompt, priority, cached).tolist() == expected.tolist()
        assert table.freest(prompt, priority, cached) == int(np.argmax(expected))
        # The same question with the request's copies is another question (its own kept answer),
        # here against a table asked nothing else.
        alone = CandidateTable(views)
        alone.reserve(reserved)
        together = alone.dispatch_freeness(prompt, priority, cached, copies)
        assert table.dispatch_freeness(prompt, priority, cached, copies).tolist() == together.tolist()
        assert table.freest(prompt, priority, cached, copies) == int(np.argmax(together))
        if fresh._uniform_block_size:  # the held queue's bound, kept between changes, is a fresh table's too
            assert table.could_keep(1.0, prompt, priority) == fresh.could_keep(1.0, prompt, priority)


@given(st.lists(_SPEC, min_size=1, max_size=5), st.integers(1, 3000), st.sampled_from(list(Priority)),
       st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.25]), st.one_of(st.none(), st.integers(0, 4)), st.integers(0, 12),
       st.randoms(use_true_random=False), st.integers(1, 3))
def test_spare_tokens_bound_every_candidate_that_keeps_the_freeness_at_its_own_block_size(
        specs, prompt, priority, hold, reserved, anchors, rng, copies):
    """The held queue's floors are read against `spare_tokens`: where a candidate not reserved
    keeps `hold` with the request's copies, holding some prefix of its anchors, the prompt less
    every anchor at the most tokens one stands for there, once per copy, fits, whatever the block
    sizes."""
    table = CandidateTable([_spec_view(k, spec) for k, spec in enumerate(specs)])
    table.reserve(None if reserved is None else reserved % len(specs))
    cached = np.array([rng.randint(0, anchors) * anchor_stride(spec[-1]) for spec in specs], dtype=float)
    if table.dispatch_freeness(prompt, priority, cached, copies).max() >= hold:
        assert copies * (prompt - anchors * table.most_anchor_tokens) <= table.spare_tokens(hold, priority)
    assert table.most_anchor_tokens == max(anchor_stride(spec[-1]) * spec[-1] for spec in specs)


def test_could_keep_counts_each_copy_as_a_request_sharing_the_room():
    table = CandidateTable([_spec_view(0, (80, 2, 0, 0, 0, False, 16))])  # 20 blocks free, 2 requests
    # One copy of 4 blocks keeps (20 - 4) / 3 = 5.3 blocks per request; four keep (20 - 16) / 6 = 0.7, though
    # their blocks alone (16) would fit in what one more request could take keeping 1 (20 - 3).
    assert table.could_keep(1.0, 64, Priority.NORMAL) and table.dispatch_freeness(64, Priority.NORMAL).max() >= 1
    assert not table.could_keep(1.0, 64, Priority.NORMAL, copies=4)
    assert table.dispatch_freeness(64, Priority.NORMAL, copies=4).max() < 1


@given(st.lists(_SPEC, min_size=1, max_size=5), st.integers(1, 3000), st.sampled_from(list(Priority)),
       st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 7.25]), st.one_of(st.none(), st.integers(0, 4)),
       st.integers(0, 40), st.randoms(use_true_random=False), st.integers(1, 3))
def test_could_keep_turns_away_only_requests_no_candidate_keeps_the_freeness_for(specs, prompt, priority, hold, reserved,
                                                                                 most_cached, rng, copies):
    """The held queue's cheap bound: never False where some unreserved candidate would keep `hold`
    with the request's copies (uniform block sizes: the bound's case), none caching more than
    `most_cached` blocks of the prompt; where it says True with each caching that much, one keeps
    nearly as much."""
    views = [_spec_view(k, (*spec[:-1], 16)) for k, spec in enumerate(specs)]
    table = CandidateTable(views)
    table.reserve(None if reserved is None else reserved % len(views))
    cached = np.array([rng.randint(0, most_cached) for _ in views], dtype=float)
    if not table.could_keep(hold, prompt, priority, most_cached, copies):
        assert table.dispatch_freeness(prompt, priority, cached, copies).max() < hold
    freeness = table.dispatch_freeness(prompt, priority, np.full(len(views), float(most_cached)), copies)
    if table.could_keep(hold, prompt, priority, most_cached, copies):
        assert freeness.max() >= hold * (1 - 1e-6) - 1e-6
    else:
        assert freeness.max() < hold
    assert not table.could_keep(hold, 100 * 16 + 1, priority)  # more than any candidate's memory
