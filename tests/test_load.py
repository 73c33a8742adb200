"""Virtual usage (paper Algorithm 1) case by case, and the properties freeness must have.

The reports are built from a request-level model (`Instance`), the same sums a llumlet reports,
so each case reads as Algorithm 1 does: per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llumdask.load import (
    InstanceLoad,
    PooledLoad,
    dispatch_freeness,
    freeness_key,
    headroom_blocks,
    instance_order,
    virtual_usage,
)
from llumdask.load import migration_freeness as freeness
from llumdask.request import Priority

HIGH, NORMAL = Priority.HIGH, Priority.NORMAL
HEADROOM = {HIGH: 100, NORMAL: 0}  # blocks


@dataclass
class Instance:
    """Requests on one instance: running (blocks, execution priority), waiting (demand, scheduling
    priority) in arrival order."""

    total_blocks: int = 1000
    running: list[tuple[int, Priority]] = field(default_factory=list)
    waiting: list[tuple[int, Priority]] = field(default_factory=list)
    reserved_blocks: int = 0
    terminating: bool = False

    def load(self) -> InstanceLoad:
        blocks: dict[Priority, int] = {}
        count: dict[Priority, int] = {}
        for b, p in self.running:
            blocks[p] = blocks.get(p, 0) + b
            count[p] = count.get(p, 0) + 1
        # Waiting order: scheduling priority, then arrival (the list order).
        queue = sorted(self.waiting, key=lambda w: -int(w[1]))
        used = sum(blocks.values()) + self.reserved_blocks
        return InstanceLoad(
            "i", self.total_blocks, 16, max(self.total_blocks - used, 0), len(self.running), len(queue),
            running_blocks=blocks, running_count=count,
            head_of_line_demand=queue[0][0] if queue else 0,
            waiting_demand=sum(d for d, _ in queue),
            reserved_blocks=self.reserved_blocks,
            terminating=self.terminating,
        )

    def usage(self, **kwargs) -> float:
        return virtual_usage(self.load(), HEADROOM, **kwargs)

    def freeness(self, **kwargs) -> float:
        return freeness(self.load(), HEADROOM, **kwargs)

    def dispatch(self, pending_blocks: int = 0, pending_requests: int = 0, arriving: Priority = NORMAL) -> float:
        return dispatch_freeness(self.load(), HEADROOM, pending_blocks=pending_blocks,
                                 pending_requests=pending_requests, classes=(arriving,))


# ---------------------------------------------------------------- Algorithm 1, case by case


def test_empty_instance_has_no_usage():
    assert Instance().usage() == 0


def test_waiting_head_of_line_counts_its_demand_and_the_others_nothing():
    assert Instance(waiting=[(5, NORMAL)]).usage() == 5
    assert Instance(waiting=[(5, NORMAL), (7, NORMAL), (90, NORMAL)]).usage() == 5


def test_head_of_line_is_the_highest_scheduling_priority():
    assert Instance(waiting=[(5, NORMAL), (7, HIGH)]).usage() == 7


def test_running_normal_counts_its_physical_blocks():
    assert Instance(running=[(10, NORMAL), (4, NORMAL)]).usage() == 14


@pytest.mark.parametrize("n_high", [1, 2, 3, 4, 7])
def test_running_high_gets_the_headroom_split_over_its_class(n_high):
    # Each of the n_p high-priority requests carries headroom / n_p: the class carries it once.
    running = [(3, HIGH)] * n_high
    assert Instance(running=running).usage() == 3 * n_high + HEADROOM[HIGH]
    assert Instance(running=running + [(10, NORMAL)]).usage() == 3 * n_high + HEADROOM[HIGH] + 10


def test_headroom_is_per_execution_priority():
    headroom = {HIGH: 100, NORMAL: 8}
    load = Instance(running=[(3, HIGH), (4, NORMAL), (5, NORMAL)]).load()
    assert virtual_usage(load, headroom) == 3 + 4 + 5 + 100 + 8


def test_scaling_view_ignores_the_headroom():
    assert Instance(running=[(3, HIGH), (4, NORMAL)]).usage(normal_only=True) == 7


def test_waiting_and_running_add_up():
    instance = Instance(running=[(10, NORMAL), (2, HIGH)], waiting=[(6, NORMAL), (50, NORMAL)])
    assert instance.usage() == 10 + 2 + HEADROOM[HIGH] + 6


def test_reserved_blocks_for_an_incoming_migration_count():
    assert Instance(running=[(10, NORMAL)], reserved_blocks=4).usage() == 14


def test_dispatched_but_unreported_demand_counts():
    assert Instance(running=[(10, NORMAL)]).usage(extra_demand=3) == 13


def test_terminating_instance_is_infinitely_used_and_least_free():
    instance = Instance(terminating=True)
    assert instance.usage() == math.inf
    assert instance.freeness() == -math.inf


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (1600, 100), (1601, 101)])
def test_headroom_tokens_round_up_to_blocks(tokens, blocks):
    assert headroom_blocks({HIGH: tokens}, 16) == {HIGH: blocks}


def test_freeness_divides_the_surplus_by_the_batch():
    assert Instance(total_blocks=100, running=[(10, NORMAL)] * 3).freeness() == pytest.approx(70 / 3)


def test_freeness_of_an_idle_instance_is_its_surplus():
    assert Instance(total_blocks=100).freeness() == 100
    assert Instance(total_blocks=100, waiting=[(30, NORMAL)]).freeness() == 70


def test_overloaded_freeness_grows_more_negative_with_the_batch():
    one = Instance(total_blocks=10, running=[(8, NORMAL)], waiting=[(8, NORMAL)])
    two = Instance(total_blocks=10, running=[(4, NORMAL), (4, NORMAL)], waiting=[(8, NORMAL)])
    assert one.freeness() == -6
    assert two.freeness() == -12


def test_report_rejects_negative_counters():
    with pytest.raises(ValueError, match="num_waiting"):
        InstanceLoad("i", 10, 16, 10, 0, -1)
    with pytest.raises(ValueError, match="running_blocks"):
        InstanceLoad("i", 10, 16, 10, 0, 0, running_blocks={NORMAL: -2})
    with pytest.raises(ValueError, match="free_blocks"):
        InstanceLoad("i", 10, 16, 11, 0, 0)


def test_report_survives_its_dict_form():
    load = Instance(running=[(3, HIGH), (4, NORMAL)], waiting=[(5, NORMAL)], reserved_blocks=2).load()
    assert InstanceLoad.from_dict(load.to_dict()) == load


# ---------------------------------------------------------------- freeness properties

priorities = st.sampled_from([NORMAL, HIGH])
requests = st.tuples(st.integers(1, 60), priorities)


@st.composite
def instances(draw, total_blocks: int | None = None) -> Instance:
    running = draw(st.lists(requests, max_size=12))
    waiting = draw(st.lists(requests, max_size=6))
    reserved = draw(st.integers(0, 20))
    if total_blocks is None:
        # Enough room for what runs (a report never shows more), sometimes not for the headroom.
        total_blocks = sum(b for b, _ in running) + reserved + draw(st.integers(1, 400))
    return Instance(total_blocks, running, waiting, reserved, terminating=draw(st.integers(0, 4)) == 0)


@given(instances(), instances(), st.text(min_size=1, max_size=3), st.text(min_size=1, max_size=3))
def test_infinite_usage_is_always_the_least_free(a, b, id_a, id_b):
    a.terminating, b.terminating = True, False
    fa, fb = a.freeness(), b.freeness()
    assert fa < fb
    assert freeness_key(id_a, fa) < freeness_key(id_b, fb)


@given(st.data(), st.integers(1, 2000))
def test_an_empty_instance_is_the_freest_of_its_capacity(data, total_blocks):
    other = data.draw(instances(total_blocks))
    assert Instance(total_blocks).freeness() >= other.freeness()
    if other.running or other.waiting or other.reserved_blocks or other.terminating:
        assert Instance(total_blocks).freeness() > other.freeness()


@given(instances(), requests, st.integers(0, 50))
def test_adding_a_running_request_never_raises_freeness(instance, request, extra_demand):
    instance.total_blocks += request[0]  # room for its blocks: a report never shows more
    before = instance.freeness(extra_demand=extra_demand)
    grown = replace(instance, running=instance.running + [request])
    assert grown.freeness(extra_demand=extra_demand) <= before


@given(instances(), requests, st.integers(0, 50))
def test_appending_a_same_priority_waiting_request_never_raises_freeness(instance, request, extra_demand):
    demand, priority = request
    # The head's priority: arriving last, it queues behind the head (or is the head of an empty queue).
    priority = max((p for _, p in instance.waiting), default=priority)
    before = instance.freeness(extra_demand=extra_demand)
    instance.waiting.append((demand, priority))
    assert instance.freeness(extra_demand=extra_demand) <= before


@given(instances(), st.integers(0, 50), st.integers(1, 50))
def test_more_unreported_demand_never_raises_freeness(instance, extra_demand, more):
    assert instance.freeness(extra_demand=extra_demand + more) <= instance.freeness(extra_demand=extra_demand)


@given(st.lists(st.tuples(st.text(max_size=3), instances()), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_freeness_key_is_a_strict_total_order_consistent_with_freeness(cluster):
    keyed = [(freeness_key(i, inst.freeness()), inst.freeness()) for i, inst in cluster]
    for _key, f in keyed:
        assert not math.isnan(f)
    for (ka, fa) in keyed:
        for (kb, fb) in keyed:
            assert (ka < kb) + (kb < ka) + (ka == kb) == 1
            if fa < fb:
                assert ka < kb
    assert len({k for k, _ in keyed}) == len(keyed)
    ordered = sorted(k for k, _ in keyed)
    assert all(x < y for x, y in zip(ordered, ordered[1:]))


# ---------------------------------------------------------------- the dispatch load


def test_dispatch_counts_every_waiting_request_and_divides_by_all_requests():
    instance = Instance(total_blocks=100, running=[(10, NORMAL)], waiting=[(5, NORMAL), (30, NORMAL)])
    assert instance.dispatch() == pytest.approx((100 - 10 - 35) / 3)
    assert instance.freeness() == pytest.approx(100 - 10 - 5)  # migration: the head only, per running request


def test_a_long_prefill_does_not_make_an_instance_look_free_to_dispatch():
    # One running request, a long queue behind a short head: free by Algorithm 1, not to dispatch.
    queued = Instance(total_blocks=100, running=[(5, NORMAL)], waiting=[(2, NORMAL), (60, NORMAL), (20, NORMAL)])
    busy = Instance(total_blocks=100, running=[(30, NORMAL)] * 2)
    assert queued.freeness() > busy.freeness()
    assert queued.dispatch() < busy.dispatch()


def test_dispatch_counts_pending_demand_and_requests():
    instance = Instance(total_blocks=100, running=[(10, NORMAL)])
    assert instance.dispatch(pending_blocks=20, pending_requests=2) == pytest.approx(70 / 3)


def test_an_arriving_high_priority_request_pays_its_headroom_only_where_its_class_is_absent():
    empty, with_high = Instance(total_blocks=1000), Instance(total_blocks=1000, running=[(10, HIGH)])
    assert empty.dispatch(arriving=HIGH) == 1000 - HEADROOM[HIGH]
    assert with_high.dispatch(arriving=HIGH) == with_high.dispatch(arriving=NORMAL) == 1000 - 10 - HEADROOM[HIGH]
    # A normal request sees the headroom where high-priority work runs, and goes elsewhere.
    assert with_high.dispatch(arriving=NORMAL) < empty.dispatch(arriving=NORMAL) - HEADROOM[HIGH]


def test_overloaded_dispatch_deficit_grows_with_the_requests():
    one = Instance(total_blocks=10, running=[(8, NORMAL)], waiting=[(8, NORMAL)])
    two = Instance(total_blocks=10, running=[(8, NORMAL)], waiting=[(4, NORMAL), (4, NORMAL)])
    assert one.dispatch() == -6 * 2
    assert two.dispatch() == -6 * 3


def test_pooled_load_sums_instances_without_headroom():
    a = Instance(total_blocks=100, running=[(10, HIGH)]).load()
    b = Instance(total_blocks=100, running=[(20, NORMAL)], waiting=[(30, NORMAL)]).load()
    pool = PooledLoad.of([(a, 0, 0), (b, 5, 1)])
    assert (pool.total_blocks, pool.surplus, pool.requests, pool.instances) == (200, 200 - 10 - 20 - 30 - 5, 4, 2)
    assert pool.freeness == pytest.approx(135 / 4)
    assert pool.instances_short(10.0) == 0
    assert pool.instances_short(60.0) == 2  # 240 free blocks needed, 105 missing: two of 100
    assert not pool.keeps(10.0, 100)  # one instance fewer: 35 free blocks for 4 requests
    assert pool.keeps(8.0, 103) and not pool.keeps(8.0, 104)  # 32 / 4 = 8, 31 / 4 below


@given(st.integers(-10_000, 10_000), st.integers(0, 500), st.floats(0, 100), st.integers(0, 5_000), st.integers(0, 5_000))
def test_more_capacity_leaving_never_keeps_more(surplus, requests, high, fewer, more):
    pool = PooledLoad(10_000, float(surplus), requests, 10)
    fewer, more = sorted((fewer, more))
    assert pool.keeps(high, more) <= pool.keeps(high, fewer)


@given(instances(), instances(), st.text(min_size=1, max_size=3), st.text(min_size=1, max_size=3))
def test_terminating_is_the_least_free_to_dispatch(a, b, id_a, id_b):
    a.terminating, b.terminating = True, False
    assert a.dispatch() == -math.inf < b.dispatch()


@given(st.data(), st.integers(1, 2000))
def test_an_empty_instance_is_the_freest_to_dispatch(data, total_blocks):
    other = data.draw(instances(total_blocks))
    assert Instance(total_blocks).dispatch() >= other.dispatch()


@given(instances(), requests, st.integers(0, 50), st.integers(0, 5), priorities)
def test_adding_load_never_raises_dispatch_freeness(instance, request, pending_blocks, pending_requests, arriving):
    before = instance.dispatch(pending_blocks, pending_requests, arriving)
    queued = replace(instance, waiting=instance.waiting + [request])
    assert queued.dispatch(pending_blocks, pending_requests, arriving) <= before
    assert instance.dispatch(pending_blocks + request[0], pending_requests + 1, arriving) <= before
    roomy = replace(instance, total_blocks=instance.total_blocks + request[0])
    assert replace(roomy, running=roomy.running + [request]).dispatch(pending_blocks, pending_requests, arriving) <= (
        roomy.dispatch(pending_blocks, pending_requests, arriving)
    )


@given(st.lists(st.tuples(st.text(max_size=3), instances()), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_dispatch_keys_are_a_strict_total_order(cluster):
    keyed = [(inst.dispatch(), instance_order(i)) for i, inst in cluster]
    assert all(not math.isnan(f) for f, _ in keyed)
    assert len(set(keyed)) == len(keyed)
    ordered = sorted(keyed)
    assert all(x < y for x, y in zip(ordered, ordered[1:]))


def test_ids_tie_break_in_natural_order():
    ids = ["instance-10", "instance-2", "tcp://10.0.0.1:40001", "tcp://10.0.0.1:9999", "instance-1"]
    assert sorted(ids, key=instance_order) == ["instance-1", "instance-2", "instance-10", "tcp://10.0.0.1:9999",
                                                "tcp://10.0.0.1:40001"]
    assert instance_order("01") != instance_order("1")
