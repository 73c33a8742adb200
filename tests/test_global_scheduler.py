"""The global scheduler: instance table, dispatch accounting, pairing and scaling on plain data."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llumdask.config import DispatchConfig, LlumdaskConfig, MigrationConfig, ScalingConfig
from llumdask.global_scheduler import (
    ClusterOverloaded,
    DispatchInfo,
    GlobalScheduler,
    MigrationPair,
    NoInstanceAvailable,
    ScaleDecision,
    UnknownInstance,
)
from llumdask.load import InstanceLoad, dispatch_freeness, headroom_blocks
from llumdask.prefix import PrefixEvents
from llumdask.load import migration_freeness as freeness
from llumdask.request import Priority

BLOCKS, BLOCK_SIZE = 100, 16
SCALING = ScalingConfig(enabled=True, band=(10.0, 60.0), scale_out_period=30.0, scale_in_period=30.0, min_instances=1, max_instances=4)


def scheduler(n: int = 0, *, policy: str = "llumnix", interference_freeness: float | None = None, **config) -> GlobalScheduler:
    """A scheduler with `n` ready, empty instances i0..i{n-1} of BLOCKS blocks; Llumnix dispatch
    by memory alone unless `interference_freeness` is given, placing at once (holding past
    capacity is tests/test_holding.py's)."""
    dispatch = DispatchConfig(policy=policy, interference_freeness=interference_freeness, hold_freeness=None)
    gs = GlobalScheduler(LlumdaskConfig(dispatch=dispatch, **config))
    for k in range(n):
        gs.register_instance(f"i{k}", BLOCKS, BLOCK_SIZE, 0.0)
        gs.mark_ready(f"i{k}", 0.0)
    return gs


def load(instance_id: str, *, used: int = 0, running: int | None = None, waiting: int = 0, head: int = 0,
         received: int = 0, out: int = 0, into: int = 0, terminating: bool = False, order: int = 0) -> InstanceLoad:
    """`order`: the drain order the instance had heard (the first drain is order 1, a take-back after it 2)."""
    running = (1 if used else 0) if running is None else running
    return InstanceLoad(
        instance_id, BLOCKS, BLOCK_SIZE, BLOCKS - used, running, waiting,
        running_blocks={Priority.NORMAL: used}, running_count={Priority.NORMAL: running},
        head_of_line_demand=head, waiting_demand=head, num_received=received,
        num_migrating_out=out, num_migrating_in=into, terminating=terminating, drain_order=order,
    )


def info(k: int | str = 0, tokens: int = 16 * 5) -> DispatchInfo:
    return DispatchInfo(f"r{k}", tokens, 10)


# ---------------------------------------------------------------- admission by load


@pytest.mark.parametrize("policy", ["llumnix", "infaas", "round_robin"])
def test_admission_refuses_what_every_instance_would_queue_but_never_a_resubmission(policy):
    gs = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(policy=policy, admission_freeness=0.0, hold_freeness=None)))
    for k in range(2):
        gs.register_instance(f"i{k}", BLOCKS, BLOCK_SIZE, 0.0)
        gs.mark_ready(f"i{k}", 0.0)
    gs.report(load("i0", used=96, running=3), 0.0)
    gs.report(load("i1", used=60, running=2, waiting=1, head=35, received=1), 0.0)
    assert gs.dispatch(info(0, 16 * 5), 1.0) in ("i0", "i1")  # i1 keeps 100 - 60 - 35 - 5 = 0 blocks: admitted
    gs.report(load("i1", used=61, running=2, waiting=1, head=35, received=1), 1.0)
    with pytest.raises(ClusterOverloaded, match="every instance would queue request r1"):
        gs.dispatch(info(1, 16 * 5), 2.0)  # now nowhere is there room for 5 more blocks
    assert gs.dispatch(DispatchInfo("r2", 16 * 5, 10, admitted=True), 2.0) in ("i0", "i1")
    # Off by default: the same cluster queues it.
    assert scheduler(2, policy=policy).dispatch(info(3, 16 * 500), 1.0) in ("i0", "i1")


def test_a_refusal_for_load_says_when_to_come_back_from_the_pace_requests_leave():
    gs = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(admission_freeness=0.0, hold_freeness=None)))
    gs.register_instance("i0", BLOCKS, BLOCK_SIZE, 0.0)
    gs.mark_ready("i0", 0.0)
    gs.report(load("i0", used=100, running=20, received=20), 0.0)
    with pytest.raises(ClusterOverloaded) as refused:
        gs.dispatch(info(0), 0.5)
    assert refused.value.retry_after is None  # nothing has left yet: no estimate
    for second in range(1, 31):  # one request finishes and one more is received every second
        gs.report(load("i0", used=100, running=20, received=20 + second), float(second))
    waits = []
    for k in range(3):
        with pytest.raises(ClusterOverloaded) as refused:
            gs.dispatch(info(k + 1), 30.0)
        waits.append(refused.value.retry_after)
    assert waits == pytest.approx([1.0, 2.0, 3.0], rel=0.1)  # one slot per departure, in order


# ---------------------------------------------------------------- instance table and input checks


def test_an_instance_takes_requests_only_once_ready():
    gs = scheduler()
    gs.register_instance("a", BLOCKS, BLOCK_SIZE, 0.0)
    with pytest.raises(NoInstanceAvailable):
        gs.dispatch(info(), 0.0)
    gs.mark_ready("a", 1.0)
    assert gs.dispatch(info(), 1.0) == "a"


def test_no_instance_at_all():
    with pytest.raises(NoInstanceAvailable, match="0 registered"):
        scheduler().dispatch(info(), 0.0)


@pytest.mark.parametrize("call", [
    lambda gs: gs.report(load("ghost"), 0.0),
    lambda gs: gs.mark_ready("ghost", 0.0),
    lambda gs: gs.set_terminating("ghost", 0.0),
    lambda gs: gs.remove_instance("ghost"),
    lambda gs: gs.freeness("ghost"),
])
def test_unknown_instances_are_rejected_by_name(call):
    with pytest.raises(UnknownInstance, match="unknown instance 'ghost': never registered"):
        call(scheduler(1))
    assert issubclass(UnknownInstance, KeyError)


def test_a_removed_instance_cannot_come_back_through_a_late_report():
    gs = scheduler(2)
    gs.remove_instance("i1")
    with pytest.raises(UnknownInstance):
        gs.report(load("i1"), 1.0)
    assert [v.instance_id for v in gs.instances()] == ["i0"]


@pytest.mark.parametrize(("args", "match"), [
    (("i0", BLOCKS, BLOCK_SIZE), "already registered"),
    (("", BLOCKS, BLOCK_SIZE), "instance_id"),
    (("x", 0, BLOCK_SIZE), "total_blocks"),
    (("x", BLOCKS, -16), "block_size"),
    (("x", 10.5, BLOCK_SIZE), "total_blocks"),
])
def test_register_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        scheduler(1).register_instance(*args, 0.0)


def test_a_report_must_match_the_registered_capacity():
    gs = scheduler(1)
    with pytest.raises(ValueError, match="registered with 100 blocks"):
        gs.report(InstanceLoad("i0", BLOCKS + 1, BLOCK_SIZE, BLOCKS, 0, 0), 0.0)


def test_num_received_cannot_go_back():
    gs = scheduler(1)
    gs.report(load("i0", received=5), 0.0)
    with pytest.raises(ValueError, match="num_received went back from 5 to 4"):
        gs.report(load("i0", received=4), 1.0)


def test_negative_tokens_are_rejected():
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        scheduler(1).dispatch(DispatchInfo("r", -3, 10), 0.0)


def test_instances_table():
    gs = scheduler(2)
    gs.register_instance("starting", BLOCKS, BLOCK_SIZE, 0.0)
    gs.report(load("i1", used=30, received=0), 2.5)
    gs.dispatch(info(), 3.0)
    gs.set_terminating("i1", 3.0)
    rows = {v.instance_id: v for v in gs.instances()}
    assert list(rows) == ["i0", "i1", "starting"]
    assert rows["starting"].ready is False and rows["starting"].freeness == BLOCKS
    assert rows["i0"].num_pending == 1 and rows["i0"].pending_blocks == 5 and rows["i0"].freeness == BLOCKS - 5
    assert rows["i1"].terminating and rows["i1"].freeness == -math.inf
    assert rows["i1"].load.used_blocks == 30 and rows["i1"].last_report_at == 2.5
    assert rows["i0"].last_report_at is None


# ---------------------------------------------------------------- dispatch and its accounting


def test_dispatch_goes_to_the_freest_and_counts_the_request_there():
    gs = scheduler(3)
    gs.report(load("i0", used=50), 0.0)
    gs.report(load("i2", used=10), 0.0)
    assert gs.dispatch(info(tokens=16 * 30), 0.0) == "i1"
    assert gs.freeness("i1") == BLOCKS - 30
    assert gs.dispatch(info(tokens=16 * 30), 0.0) == "i2"  # (100 - 10) / 1 = 90 > 70


def test_headroom_of_the_config_is_applied():
    gs = scheduler(1, headroom_tokens={Priority.HIGH: 320, Priority.NORMAL: 0})
    report = InstanceLoad("i0", BLOCKS, BLOCK_SIZE, BLOCKS - 10, 1, 0,
                          running_blocks={Priority.HIGH: 10}, running_count={Priority.HIGH: 1})
    gs.report(report, 0.0)
    assert gs.freeness("i0") == BLOCKS - 10 - 20
    assert gs.freeness("i0") == freeness(report, headroom_blocks({Priority.HIGH: 320}, BLOCK_SIZE))


@pytest.mark.parametrize("policy", ["llumnix", "infaas", "lmetric", "round_robin"])
@given(k=st.integers(1, 12), n=st.integers(0, 100))
def test_a_burst_spreads_evenly_before_any_report(policy, k, n):
    gs = scheduler(k, policy=policy)
    counts = Counter(gs.dispatch(info(j), 0.0) for j in range(n))
    per_instance = [counts.get(f"i{i}", 0) for i in range(k)]
    assert max(per_instance) - min(per_instance) <= 1


@given(k=st.integers(2, 8), prompts=st.lists(st.integers(1, 16 * 20), max_size=60))
def test_a_burst_is_spread_by_the_dispatch_load_with_each_request_added(k, prompts):
    # Unreported, a burst is placed by pending demand alone: each request where the dispatch load
    # with it added is the freest (ties: the larger id).
    gs = scheduler(k)
    for j, tokens in enumerate(prompts):
        blocks = -(-tokens // BLOCK_SIZE)
        after = {v.instance_id: dispatch_freeness(v.load, {}, pending_blocks=v.pending_blocks + blocks,
                                                  pending_requests=v.num_pending + 1) for v in gs.instances()}
        target = gs.dispatch(info(j, tokens), 0.0)
        assert after[target] == max(after.values())
        assert target == max((i for i in after if after[i] == after[target]), key=lambda i: int(i[1:]))
    assert sum(v.num_pending for v in gs.instances()) == len(prompts)


def test_with_memory_to_spare_a_burst_alternates_by_interference():
    # Plenty of room everywhere: each request goes where the queued prefill times the batch is
    # least, which counts the requests dispatched but not reported.
    gs = scheduler(2, interference_freeness=2.0)
    targets = [gs.dispatch(info(j, 16), 0.0) for j in range(4)]
    assert targets == ["i0", "i1", "i0", "i1"]


def test_reports_absorb_pending_requests_in_dispatch_order():
    gs = scheduler(1)
    for j, blocks in enumerate([3, 5, 7]):
        gs.dispatch(info(j, 16 * blocks), 0.0)
    assert gs.freeness("i0") == BLOCKS - 15
    gs.report(load("i0", used=3, received=1, head=5, waiting=1), 1.0)  # the first runs, the second waits
    (row,) = gs.instances()
    assert (row.num_pending, row.pending_blocks) == (2, 12)
    assert gs.freeness("i0") == BLOCKS - 3 - 5 - 12
    gs.report(load("i0", used=15, running=3, received=3), 2.0)
    (row,) = gs.instances()
    assert (row.num_pending, row.pending_blocks) == (0, 0)
    assert gs.freeness("i0") == (BLOCKS - 15) / 3


def test_choices_placed_together_go_to_one_instance_and_each_is_pending_there():
    gs = scheduler(2)
    gs.report(load("i1", used=10), 0.0)
    chosen = gs.dispatch(DispatchInfo("r0", 16 * 4, 10, count=3), 0.0)
    assert chosen == "i0"  # where one would go; the other two follow it
    rows = {row.instance_id: row for row in gs.instances()}
    assert (rows["i0"].num_pending, rows["i0"].pending_blocks) == (3, 12) and rows["i1"].num_pending == 0
    gs.report(load("i0", used=6, running=3, received=3), 1.0)  # all three arrived (the prompt shared)
    assert gs.instances()[0].num_pending == 0


def test_incoming_migrations_are_not_received_requests():
    gs = scheduler(1)
    gs.dispatch(info(0, 16 * 4), 0.0)
    gs.report(load("i0", used=40, received=0, into=1), 1.0)  # a migrated request arrived, not ours
    assert gs.instances()[0].pending_blocks == 4


def test_requests_received_before_the_scheduler_started_do_not_swallow_pending_ones():
    gs = scheduler(1)
    gs.report(load("i0", used=20, received=50), 0.0)
    gs.dispatch(info(0, 16 * 4), 1.0)
    gs.report(load("i0", used=20, received=50), 2.0)
    assert gs.instances()[0].num_pending == 1
    gs.report(load("i0", used=24, received=51), 3.0)
    assert gs.instances()[0].num_pending == 0


def test_terminating_instances_take_no_requests():
    gs = scheduler(2)
    gs.set_terminating("i1", 0.0)
    assert gs.freeness("i1") == -math.inf
    assert {gs.dispatch(info(j), 0.0) for j in range(5)} == {"i0"}
    gs.set_terminating("i0", 0.0)
    with pytest.raises(NoInstanceAvailable):
        gs.dispatch(info(), 0.0)


def test_a_report_that_says_terminating_is_adopted():
    gs = scheduler(2)
    gs.report(load("i1", terminating=True), 0.0)
    assert gs.instances()[1].terminating
    assert {gs.dispatch(info(j), 0.0) for j in range(3)} == {"i0"}


def test_removed_instances_leave_the_candidates():
    gs = scheduler(2)
    gs.remove_instance("i0")
    assert {gs.dispatch(info(j), 0.0) for j in range(3)} == {"i1"}


# ---------------------------------------------------------------- migration pairing


def test_pairs_the_least_free_with_the_freest_ready_instances():
    gs = scheduler(4)
    gs.register_instance("starting", BLOCKS, BLOCK_SIZE, 0.0)  # empty but not ready: no destination
    gs.report(load("i0", used=99, running=1), 0.0)   # F = 1
    gs.report(load("i1", used=100, running=2, head=10), 0.0)  # overloaded
    gs.report(load("i2", used=50, running=1), 0.0)  # F = 50
    assert gs.pair_migrations(0.0) == [MigrationPair("i1", "i3"), MigrationPair("i0", "i2")]


@pytest.mark.parametrize(("hold", "destination"), [(1.0, "i2"), (None, "i1")])
def test_pairing_passes_over_a_destination_without_room_for_its_queue(hold, destination):
    gs = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(hold_freeness=hold)))
    for k in range(3):
        gs.register_instance(f"i{k}", BLOCKS, BLOCK_SIZE, 0.0)
        gs.mark_ready(f"i{k}", 0.0)
    gs.report(load("i0", used=100, running=2), 0.0)
    # F = 70 by the head of its line, but its queue of two (79 blocks) leaves a third of a block per request.
    gs.report(replace(load("i1", used=20, waiting=2, head=10), waiting_demand=79), 0.0)
    gs.report(load("i2", used=50), 0.0)
    assert gs.freeness("i1") > gs.freeness("i2")
    assert gs.pair_migrations(0.0) == [MigrationPair("i0", destination)]


def test_pending_demand_counts_when_pairing():
    gs = scheduler(2)
    gs.report(load("i0", used=100, running=2), 0.0)
    gs.dispatch(info(0, 16 * 90), 0.0)  # lands on i1 and fills it
    assert gs.pair_migrations(0.0) == []


def test_terminating_instances_drain_first():
    gs = scheduler(3)
    gs.report(load("i0", used=100, running=3, head=50), 0.0)
    gs.report(load("i1", used=10, running=1), 0.0)
    gs.set_terminating("i1", 0.0)
    assert gs.pair_migrations(0.0) == [MigrationPair("i1", "i2")]


def test_pairing_respects_in_flight_migrations_and_the_switch():
    gs = scheduler(2)
    gs.report(load("i0", used=100, running=2, out=1), 0.0)
    assert gs.pair_migrations(0.0) == []
    gs.report(load("i0", used=100, running=2), 0.1)
    assert gs.pair_migrations(0.1) == [MigrationPair("i0", "i1")]
    off = scheduler(2, migration=MigrationConfig(enabled=False))
    off.report(load("i0", used=100, running=2), 0.0)
    assert off.pair_migrations(0.0) == []


# ---------------------------------------------------------------- scaling


def run_scale(gs: GlobalScheduler, until: float, step: float = 1.0, start: float = 0.0) -> list[tuple[float, ScaleDecision]]:
    decisions, now = [], start
    while now <= until:
        decision = gs.scale(now)
        if decision:
            decisions.append((now, decision))
        now += step
    return decisions


def busy(gs: GlobalScheduler, instance_id: str, running: int = 10) -> None:
    """Load an instance so that its F is 1 (below the band)."""
    gs.report(load(instance_id, used=BLOCKS - running, running=running), 0.0)


def test_sustained_low_pooled_freeness_adds_the_instances_the_deficit_needs():
    gs = scheduler(2, scaling=SCALING)
    busy(gs, "i0")
    busy(gs, "i1")
    # Pooled: 20 free blocks for 20 requests, F = 1; F >= 10 needs 200 - 20 more free blocks: 2 instances.
    assert gs.pooled_load().freeness == 1
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(add=2))]


def test_scale_out_is_bounded_by_the_maximum():
    gs = scheduler(3, scaling=SCALING)
    for k in range(3):
        busy(gs, f"i{k}", running=30)  # F = 70 / 30 per instance: 6 instances short, room for 1
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(add=1))]


def test_one_idle_instance_does_not_lift_the_pool_over_the_band():
    gs = scheduler(4, scaling=SCALING)
    for k in range(3):
        busy(gs, f"i{k}")
    # A mean of per-instance F would be (1 + 1 + 1 + 100) / 4, inside the band; pooled it is 130 / 30.
    assert gs.pooled_load().freeness == pytest.approx(130 / 30)
    gs5 = scheduler(4, scaling=ScalingConfig(enabled=True, band=(10.0, 60.0), max_instances=8, scale_out_period=30.0))
    for k in range(3):
        busy(gs5, f"i{k}")
    assert run_scale(gs5, 30.0) == [(30.0, ScaleDecision(add=2))]


def test_starting_instances_count_as_capacity_on_its_way():
    gs = scheduler(2, scaling=ScalingConfig(enabled=True, band=(10.0, 60.0), max_instances=8, scale_out_period=30.0))
    busy(gs, "i0")
    busy(gs, "i1")
    gs.register_instance("new", BLOCKS, BLOCK_SIZE, 0.0)
    # 120 free blocks for 20 requests: still 80 short, one more instance.
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(add=1))]
    gs.register_instance("new2", BLOCKS, BLOCK_SIZE, 30.0)
    assert run_scale(gs, 100.0, start=31.0) == []  # 220 / 20 = 11: inside the band
    full = scheduler(4, scaling=SCALING)
    for k in range(4):
        busy(full, f"i{k}")
    assert run_scale(full, 100.0) == []


def test_instances_asked_for_are_counted_until_they_register():
    gs = scheduler(2, scaling=ScalingConfig(enabled=True, band=(10.0, 60.0), max_instances=8, scale_out_period=5.0))
    busy(gs, "i0")
    busy(gs, "i1")
    assert run_scale(gs, 5.0) == [(5.0, ScaleDecision(add=2))]
    assert gs.requested == 2
    assert run_scale(gs, 60.0, start=6.0) == []  # still short, but two are on their way
    gs.register_instance("new0", BLOCKS, BLOCK_SIZE, 60.0)
    assert gs.requested == 1
    assert run_scale(gs, 120.0, start=61.0) == []
    gs.register_instance("new1", BLOCKS, BLOCK_SIZE, 120.0)
    assert gs.requested == 0


def test_scale_out_is_quick_and_scale_in_slow():
    default = ScalingConfig(enabled=True, band=(10.0, 60.0), max_instances=8)
    assert (default.scale_out_period, default.scale_in_period) == (5.0, 30.0)
    busy_cluster = scheduler(2, scaling=default)
    busy(busy_cluster, "i0")
    busy(busy_cluster, "i1")
    assert run_scale(busy_cluster, 5.0) == [(5.0, ScaleDecision(add=2))]
    idle_cluster = scheduler(3, scaling=default)
    assert run_scale(idle_cluster, 29.0) == []
    # Idle, one instance is enough: the two others go at once, the last in natural id order first in a tie.
    assert run_scale(idle_cluster, 30.0, start=30.0) == [(30.0, ScaleDecision(terminate=("i2", "i1")))]


def test_scale_in_drains_as_many_as_the_surplus_allows():
    gs = scheduler(5, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), max_instances=8))
    for k, running in enumerate((2, 1, 3, 1, 3)):
        gs.report(load(f"i{k}", used=4 * running, running=running), 0.0)
    pool = gs.pooled_load()  # 500 - 40 free blocks for 10 requests: F = 46, above the band
    assert pool.freeness == 46.0 and not pool.keeps(40.0, 100)  # one fewer would leave F = 36
    gs.report(load("i4", used=4, running=1), 0.0)
    pool = gs.pooled_load()  # 500 - 32 for 8: F = 58.5; one fewer leaves 368 / 8 = 46, two 268 / 8
    assert pool.keeps(40.0, 100) and not pool.keeps(40.0, 200)
    gs.report(load("i2", used=2, running=1), 0.0)  # 500 - 22 for 6: two fewer leave 278 / 6, three 178 / 6
    assert gs.pooled_load().keeps(40.0, 200) and not gs.pooled_load().keeps(40.0, 300)
    # Fewest running first (i1 .. i4 run one each), then the freest: i2 (F = 98), then i1, i3 and
    # i4 (F = 96 each), the last in natural id order first.
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2", "i4")))]
    assert [i.instance_id for i in gs.instances() if i.terminating] == ["i2", "i4"]


def test_scale_in_counts_each_victims_own_capacity():
    def cluster(used: dict[str, tuple[int, int]]) -> GlobalScheduler:
        """i0 and i1 of 100 blocks, i2 of 400 (the mean 200), with `used` (blocks, requests)."""
        gs = GlobalScheduler(LlumdaskConfig(scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), max_instances=8)))
        for instance_id, blocks in (("i0", 100), ("i1", 100), ("i2", 400)):
            gs.register_instance(instance_id, blocks, BLOCK_SIZE, 0.0)
            gs.mark_ready(instance_id, 0.0)
            n, running = used.get(instance_id, (0, 0))
            gs.report(InstanceLoad(instance_id, blocks, BLOCK_SIZE, blocks - n, running, 0,
                                   running_blocks={Priority.NORMAL: n}, running_count={Priority.NORMAL: running}), 0.0)
        return gs

    # 600 - 124 free blocks for 4 requests: 316 may leave with F >= 40. The two small idle
    # instances (200) may both go, where instances of the mean capacity would let one.
    assert run_scale(cluster({"i2": (124, 4)}), 30.0) == [(30.0, ScaleDecision(terminate=("i1", "i0")))]
    # 600 - 16 for 4: 424 may leave. The large idle one goes first (fewest running), and one more
    # would make 500: it goes alone, where the mean capacity would let two.
    assert run_scale(cluster({"i0": (8, 2), "i1": (8, 2)}), 30.0) == [(30.0, ScaleDecision(terminate=("i2",)))]


def test_sustained_high_terminates_the_instance_with_fewest_running_requests():
    gs = scheduler(3, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), max_instances=4))
    gs.report(load("i0", used=2, running=2), 0.0)
    gs.report(load("i1", used=2, running=1), 0.0)
    gs.report(load("i2", used=4, running=2), 0.0)  # pooled F = 292 / 5, above the band
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i1",)))]
    assert gs.instances()[1].terminating
    assert gs.freeness("i1") == -math.inf


def test_an_instance_that_just_joined_is_never_drained():
    gs = scheduler(2, scaling=SCALING)
    gs.report(load("i0", used=2, running=2), 0.0)
    gs.report(load("i1", used=2, running=2), 0.0)
    gs.register_instance("new", BLOCKS, BLOCK_SIZE, 10.0)
    gs.mark_ready("new", 20.0)  # empty: the fewest running, but it joined 10 s before the decision
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i1",)))]
    fresh = scheduler(0, scaling=SCALING)
    for k in range(2):
        fresh.register_instance(f"j{k}", BLOCKS, BLOCK_SIZE, 0.0)
        fresh.mark_ready(f"j{k}", 25.0)
    assert run_scale(fresh, 54.0) == []  # idle from 0 s, but none has been here a whole period
    assert run_scale(fresh, 55.0, start=55.0) == [(55.0, ScaleDecision(terminate=("j1",)))]


def test_terminate_counts_unreported_requests_as_running():
    gs = scheduler(2, scaling=SCALING)
    gs.report(load("i0", used=2, running=1), 0.0)
    gs.dispatch(info(0, 16), 0.0)  # lands on i1, which is empty
    gs.dispatch(info(1, 16), 0.0)
    assert run_scale(gs, 30.0)[0][1].terminate == ("i0",)


def test_terminate_respects_the_minimum():
    gs = scheduler(2, scaling=ScalingConfig(enabled=True, min_instances=2, max_instances=4))
    assert run_scale(gs, 100.0) == []
    gs = scheduler(3, scaling=ScalingConfig(enabled=True, min_instances=2, max_instances=4))
    decisions = run_scale(gs, 100.0)
    assert [d.terminate for _, d in decisions] == [("i2",)]


def test_a_load_step_does_not_flap():
    gs = scheduler(2, scaling=SCALING)
    # Idle (F = 100, above the band) for 20 s, then busy (below it): neither lasts a period.
    assert run_scale(gs, 20.0) == []
    busy(gs, "i0")
    busy(gs, "i1")
    assert run_scale(gs, 45.0, start=21.0) == []
    assert run_scale(gs, 60.0, start=46.0) == [(51.0, ScaleDecision(add=2))]


def test_oscillating_load_around_the_band_edge_yields_no_decision():
    gs = scheduler(1, scaling=SCALING)
    for t in range(300):
        f_target = 9 if (t // 10) % 2 else 11  # F = (100 - used) / 1
        gs.report(load("i0", used=BLOCKS - f_target, running=1), float(t))
        assert not gs.scale(float(t))


def test_pooled_freeness_ignores_priority_headroom():
    # i0 runs one high-priority request: its F = 100 - 10 - 100 (headroom) = -10. Pooled with the
    # headroom, (200 - 30 - 100) / 2 would be inside the band; without it, 170 / 2 is above it.
    gs = scheduler(2, scaling=SCALING, headroom_tokens={Priority.HIGH: 1600, Priority.NORMAL: 0})
    high = InstanceLoad("i0", BLOCKS, BLOCK_SIZE, BLOCKS - 10, 1, 0,
                        running_blocks={Priority.HIGH: 10}, running_count={Priority.HIGH: 1})
    gs.report(high, 0.0)
    gs.report(load("i1", used=20, running=1), 0.0)
    assert gs.freeness("i0") == -10
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i1",)))]


@pytest.mark.parametrize(("max_instances", "add"), [(3, 0), (8, 1)])
def test_a_due_scale_out_takes_back_an_instance_a_scale_in_is_draining(max_instances, add):
    gs = scheduler(3, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), scale_out_period=5.0, scale_in_period=30.0,
                                            max_instances=max_instances))
    gs.report(load("i0", used=4, running=2), 0.0)
    gs.report(load("i1", used=2, running=1), 0.0)
    gs.report(load("i2", used=2, running=1), 0.0)  # pooled F = 292 / 4 = 73; without one 192 / 4, two 92 / 4
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2",)))]
    gs.report(load("i2", used=2, running=1, terminating=True, order=1), 31.0)  # its request cannot move
    busy(gs, "i0")
    busy(gs, "i1")  # pooled 20 free blocks for 20 requests
    # With i2 back, 118 / 21 is still short of 10 by 92 blocks: one instance of the mean 100,
    # asked for where there is room.
    assert run_scale(gs, 36.0, start=31.0) == [(36.0, ScaleDecision(add=add, resume=("i2",)))]
    assert gs.members()[1] == ["i0", "i1", "i2"] and gs.freeness("i2") == 98
    # A report made before the instance heard it was taken back still says it drains: stale.
    gs.report(load("i2", used=2, running=1, terminating=True, order=1), 36.1)
    assert gs.freeness("i2") == 98 and gs.dispatch(info(), 36.1) == "i2"
    gs.report(load("i2", used=2, running=1, order=2), 36.2)
    assert not gs.instances()[2].terminating and gs.drained() == []


def test_take_back_only_what_scaling_drained_and_only_as_much_as_the_deficit_needs():
    gs = scheduler(5, scaling=ScalingConfig(enabled=True, band=(10.0, 20.0), scale_out_period=5.0, scale_in_period=30.0,
                                            max_instances=8))
    for instance_id, running in (("i0", 3), ("i1", 3), ("i2", 3), ("i3", 1), ("i4", 2)):
        gs.report(load(instance_id, used=2 * running, running=running), 0.0)
    # Pooled 476 / 12 = 39.7; without two instances, 276 / 12 = 23: i3 (fewest running), then i4.
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i3", "i4")))]
    gs.report(load("i3", terminating=True, order=1), 31.0)  # drained: it closes
    gs.report(load("i4", used=4, running=2, terminating=True, order=1), 31.0)
    gs.set_terminating("i2", 31.0)  # an operator's drain is the operator's
    gs.report(load("i2", used=6, running=3, terminating=True, order=1), 31.0)
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=80, running=5), 31.0)  # pooled 40 / 10
    # i4 back makes 136 / 12, inside the band: nothing more, and no new instance though there is room.
    assert run_scale(gs, 36.0, start=31.0) == [(31.0, ScaleDecision(remove=("i3",))), (36.0, ScaleDecision(resume=("i4",)))]
    assert gs.members()[1] == ["i0", "i1", "i4"]


@pytest.mark.parametrize(("busy_used", "taken"), [(80, ("i3",)), (90, ("i3", "i2"))])
def test_take_back_the_instance_holding_the_most_requests_first_and_stop_at_the_deficit(busy_used, taken):
    gs = scheduler(4, scaling=ScalingConfig(enabled=True, band=(10.0, 20.0), scale_out_period=5.0, scale_in_period=30.0,
                                            max_instances=8))
    for instance_id, running in (("i0", 3), ("i1", 3), ("i2", 1), ("i3", 2)):
        gs.report(load(instance_id, used=running, running=running), 0.0)
    # Pooled 391 / 9; without i2 291 / 9, without i3 too 191 / 9 >= 20, without i0 too 91 / 9.
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2", "i3")))]
    gs.report(load("i2", used=1, running=1, terminating=True, order=1), 31.0)
    gs.report(load("i3", used=2, running=2, terminating=True, order=1), 31.0)
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=busy_used, running=5), 31.0)
    # i3 (two requests) comes back before i2 (one). 80 used: 40 / 10, with i3 138 / 12, in the band.
    # 90 used: 20 / 10, with i3 118 / 12 still short, with i2 too 217 / 13; no new instance either way.
    assert run_scale(gs, 36.0, start=31.0) == [(36.0, ScaleDecision(resume=taken))]
    assert sorted(gs.members()[1]) == sorted(("i0", "i1") + taken)


def test_scale_in_drains_a_batch_job_whole_and_only_one_whose_instances_all_settled():
    """A job of several instances closes only once all are drained: one drained alone would sit
    idle while its job-mates serve."""
    gs = scheduler(5, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), max_instances=8))
    gs.set_jobs({"i0": "a", "i1": "a", "i2": "b", "i3": "b", "nobody": "c"})
    for instance_id, running in (("i0", 1), ("i1", 3), ("i2", 1), ("i3", 1), ("i4", 3)):
        gs.report(load(instance_id, used=2 * running, running=running), 0.0)
    # Pooled 482 / 9: job b (2 requests) is the cheapest unit, then job a and i4 (4 and 3).
    # Without b 282 / 9 >= 40; without i4 too 182 / 9 < 40.
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2", "i3")))]
    fresh = scheduler(3, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), max_instances=8))
    fresh.register_instance("i3", BLOCKS, BLOCK_SIZE, 0.0)
    fresh.mark_ready("i3", 20.0)  # joined 10 s before the decision: its job waits with it
    fresh.set_jobs({"i0": "a", "i3": "a"})
    for instance_id, running in (("i0", 1), ("i1", 2), ("i2", 3), ("i3", 0)):
        fresh.report(load(instance_id, used=running, running=running), 0.0)
    assert run_scale(fresh, 30.0) == [(30.0, ScaleDecision(terminate=("i1",)))]


@pytest.mark.parametrize(("jobs", "drained"), [({}, ("i3",)), ({"i0": "a", "i1": "a", "i2": "b", "i3": "b"}, ())])
def test_a_batch_job_is_drained_only_where_the_rest_keeps_the_band(jobs, drained):
    """Draining a whole job takes several instances' memory at once: where that would leave the
    pool below the band's low, the next scale-out would start one again."""
    gs = scheduler(4, scaling=ScalingConfig(enabled=True, band=(10.0, 20.0), max_instances=8))
    gs.set_jobs(jobs)
    for instance_id in ("i0", "i1", "i2", "i3"):
        gs.report(load(instance_id, used=30, running=3), 0.0)
    # Pooled 280 / 12 = 23.3, above the band; one instance fewer 180 / 12 = 15, inside it; a job of
    # two fewer 80 / 12 = 6.7, below it.
    assert run_scale(gs, 30.0) == ([(30.0, ScaleDecision(terminate=drained))] if drained else [])
    assert [i.instance_id for i in gs.instances() if i.terminating] == list(drained)


def with_job_b() -> GlobalScheduler:
    """i0 .. i3, job b of i2 and i3, its members the cheapest to drain: pooled 388 / 6; without
    job b 188 / 6 >= 10 (the band's low), not much above 40."""
    gs = scheduler(4, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), scale_out_period=5.0, scale_in_period=30.0,
                                            max_instances=4))
    gs.set_jobs({"i2": "b", "i3": "b"})
    for instance_id, running in (("i0", 2), ("i1", 2), ("i2", 1), ("i3", 1)):
        gs.report(load(instance_id, used=2 * running, running=running), 0.0)
    return gs


def test_a_due_scale_out_takes_back_a_draining_batch_job_whole():
    gs = with_job_b()
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2", "i3")))]
    gs.report(load("i2", used=2, running=1, terminating=True, order=1), 31.0)
    gs.report(load("i3", used=2, running=1, terminating=True, order=1), 31.0)
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=80, running=5), 31.0)  # pooled 40 / 10, below the band
    # i2 alone would do (138 / 11 inside the band), but it comes back with its job-mate.
    assert run_scale(gs, 36.0, start=31.0) == [(36.0, ScaleDecision(resume=("i2", "i3")))]
    assert gs.members()[1] == ["i0", "i1", "i2", "i3"]


def test_a_job_member_found_drained_comes_back_with_its_job_mate():
    """A job drains whole but empties member by member: one found drained (its removal decided,
    the job not closing) comes back with the mate still draining, or it would sit idle for good."""
    gs = with_job_b()
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i2", "i3")))]
    gs.report(load("i2", used=2, running=1, terminating=True, order=1), 31.0)
    gs.report(load("i3", terminating=True, order=1), 31.0)  # emptied: found drained
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=80, running=5), 31.0)
    assert run_scale(gs, 36.0, start=31.0) == [(31.0, ScaleDecision(remove=("i3",))),
                                                (36.0, ScaleDecision(resume=("i2", "i3")))]
    assert gs.members()[1] == ["i0", "i1", "i2", "i3"] and gs.drained() == []
    # Once more, i3 found drained in the very call that takes its job back: it stays, so it is
    # not among those to close.
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=4, running=2), 36.5)
    gs.report(load("i2", used=2, running=1, order=2), 36.5)
    gs.report(load("i3", order=2), 36.5)
    assert run_scale(gs, 67.0, start=37.0) == [(67.0, ScaleDecision(terminate=("i2", "i3")))]
    gs.report(load("i2", used=2, running=1, terminating=True, order=3), 67.5)
    for instance_id in ("i0", "i1"):
        gs.report(load(instance_id, used=80, running=5), 67.5)
    assert run_scale(gs, 72.0, start=68.0) == []  # the scale-out is due at 73
    gs.report(load("i3", terminating=True, order=3), 72.5)
    assert gs.scale(73.0) == ScaleDecision(resume=("i2", "i3"))
    assert gs.drained() == []


def test_a_job_with_a_member_still_starting_is_not_drained_and_the_scale_in_waits_for_what_may_go():
    """Its ready members alone are not the job. With nothing else that may go yet, the scale-in's
    timer runs on: the next instance to settle goes at once, not a whole period after a try that
    drained nothing."""
    gs = scheduler(1, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), scale_in_period=30.0, max_instances=8))
    for instance_id in ("i1", "i3"):
        gs.register_instance(instance_id, BLOCKS, BLOCK_SIZE, 0.0)
    gs.mark_ready("i1", 20.0)
    gs.mark_ready("i3", 40.0)  # still starting at 30
    gs.set_jobs({"i0": "a", "i3": "a"})
    gs.report(load("i0", used=1, running=1), 0.0)
    gs.report(load("i1", used=20, running=2), 0.0)  # pooled 279 / 3 from the start, above the band
    # At 30 only i0 has been here a period, and its job-mate is starting; i1 settles at 50.
    assert run_scale(gs, 50.0) == [(50.0, ScaleDecision(terminate=("i1",)))]


def test_drained_terminating_instances_are_removed_once():
    gs = scheduler(2)  # scaling disabled: removal still happens
    gs.report(load("i1", used=10, running=1), 0.0)
    gs.set_terminating("i1", 1.0)
    assert gs.scale(1.0) == ScaleDecision()  # no report since it was marked
    gs.report(load("i1", used=10, running=1, out=1, terminating=True, order=1), 2.0)
    assert gs.scale(2.0) == ScaleDecision()  # still migrating its request out
    gs.report(load("i1", into=1, terminating=True, order=1), 3.0)
    assert gs.scale(3.0) == ScaleDecision()  # something still on its way in
    gs.report(load("i1", terminating=True, order=1), 4.0)
    assert gs.scale(4.0) == ScaleDecision(remove=("i1",))
    assert gs.scale(5.0) == ScaleDecision()
    assert gs.drained() == ["i1"]  # until its host has closed it
    # Work that reached it since (a requester cut off from the scheduler hands requests to the
    # instances it knew) keeps it from closing until that work has moved away.
    gs.report(load("i1", used=10, running=1, terminating=True, order=1), 6.0)
    assert gs.drained() == [] and gs.scale(6.0) == ScaleDecision()
    gs.report(load("i1", terminating=True, order=1), 7.0)
    assert gs.drained() == ["i1"] and gs.scale(7.0) == ScaleDecision()  # listed in a remove once only
    gs.remove_instance("i1")
    assert [v.instance_id for v in gs.instances()] == ["i0"] and gs.drained() == []


def test_instances_asked_for_that_never_register_are_no_longer_waited_for():
    """One that failed to start (its job died, its engine did not load) would keep scaling from
    ever adding again: after `scaling.startup-timeout` it no longer counts."""
    config = ScalingConfig(enabled=True, band=(10.0, 60.0), max_instances=8, scale_out_period=5.0,
                           startup_timeout=100.0)
    gs = scheduler(2, scaling=config)
    busy(gs, "i0")
    busy(gs, "i1")
    assert run_scale(gs, 5.0) == [(5.0, ScaleDecision(add=2))]
    assert run_scale(gs, 105.0, start=6.0) == []  # on their way, within the timeout
    # Given up on; the band, short all along, asks again.
    assert gs.scale(106.0) == ScaleDecision(add=2) and gs.requested == 2


def test_a_terminating_instance_with_unreported_requests_is_not_drained():
    gs = scheduler(1)
    gs.dispatch(info(), 0.0)
    gs.set_terminating("i0", 0.0)
    gs.report(load("i0", terminating=True, order=1), 1.0)  # the request has not arrived yet
    assert gs.scale(1.0) == ScaleDecision()
    gs.report(load("i0", received=1, terminating=True, order=1), 2.0)
    assert gs.scale(2.0) == ScaleDecision(remove=("i0",))


def test_only_a_report_made_knowing_it_drains_can_show_an_instance_drained():
    """A report on its way when the instance was marked (or made before the mark reached it) may
    show it empty while a migration into it is starting: closing it then would lose that request."""
    gs = scheduler(2)
    gs.set_terminating("i1", 1.0)
    gs.report(load("i1"), 1.1)  # empty, but made before it knew
    assert gs.scale(1.1) == ScaleDecision() and gs.drained() == []
    gs.report(load("i1", into=1, terminating=True, order=1), 1.2)  # the migration had started meanwhile
    assert gs.scale(1.2) == ScaleDecision()
    gs.report(load("i1", terminating=True, order=1), 1.3)
    assert gs.scale(1.3) == ScaleDecision(remove=("i1",))


def test_a_drain_right_after_a_take_back_is_not_ended_by_a_report_older_than_it():
    """Each drain and take-back is an order with a number the instance echoes: an operator's drain
    right after a take-back cannot be shown drained by a report from the first drain."""
    gs = scheduler(2, scaling=ScalingConfig(enabled=True, band=(10.0, 40.0), scale_out_period=5.0, scale_in_period=30.0,
                                            max_instances=2))
    gs.report(load("i0", used=2, running=1), 0.0)
    gs.report(load("i1", used=2, running=1), 0.0)
    assert run_scale(gs, 30.0) == [(30.0, ScaleDecision(terminate=("i1",)))]
    assert gs.drain_order("i1") == (True, 1)
    gs.report(load("i1", used=2, running=1, terminating=True, order=1), 31.0)
    busy(gs, "i0")
    assert run_scale(gs, 36.0, start=31.0) == [(36.0, ScaleDecision(resume=("i1",)))]
    assert gs.drain_order("i1") == (False, 2)
    gs.set_terminating("i1", 36.0)
    assert gs.drain_order("i1") == (True, 3)
    gs.report(load("i1", terminating=True, order=1), 36.1)  # empty, but older than both orders
    assert gs.scale(36.1).remove == ()
    gs.report(load("i1", order=2), 36.2)  # made before it heard of the drain: still live there
    assert gs.scale(36.2).remove == () and gs.instances()[1].terminating
    gs.report(load("i1", terminating=True, order=3), 36.3)
    assert gs.scale(36.3).remove == ("i1",)


def test_a_restarted_scheduler_takes_the_orders_its_instances_heard_before():
    gs = scheduler(2)
    gs.report(load("i1", terminating=True, order=5), 0.0)  # drained by the scheduler before this one
    assert gs.instances()[1].terminating and gs.scale(0.0).remove == ("i1",)
    gs.report(load("i0", order=4), 0.0)  # taken back before
    gs.set_terminating("i0", 1.0)
    assert gs.drain_order("i0") == (True, 5)


def test_scaling_disabled_never_adds_or_terminates():
    gs = scheduler(2)
    busy(gs, "i0")
    busy(gs, "i1")
    assert run_scale(gs, 200.0) == []


# ---------------------------------------------------------------- prefix-aware dispatch


def test_reports_feed_the_prefix_index_and_dispatch_follows_it_until_the_instance_leaves():
    gs = scheduler(2, interference_freeness=16.0)
    hashes = tuple(range(1, 6))  # a 40-block prompt, told by its 5 anchors (one block in 8)
    prefixed = DispatchInfo("p", 16 * 40, 10, block_hashes=hashes)
    gs.report(load("i0", used=10, running=2), 1.0, PrefixEvents(stored=hashes))
    gs.report(load("i1"), 1.0)
    assert [v.cached_blocks for v in gs.instances()] == [40, 0]
    assert gs.dispatch(prefixed, 1.0) == "i0"  # no prefill left there, though i1 is idle
    assert gs.dispatch(info("plain"), 1.0) == "i1"
    off = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(interference_freeness=16.0, prefix_aware=False)))
    for k in range(2):
        off.register_instance(f"i{k}", BLOCKS, BLOCK_SIZE, 0.0)
        off.mark_ready(f"i{k}", 0.0)
    off.report(load("i0", used=10, running=2), 1.0, PrefixEvents(stored=hashes))
    assert off.dispatch(prefixed, 1.0) == "i1"
    gs.report(load("i0", used=10, running=2, received=1), 2.0, PrefixEvents(removed=hashes[2:]))
    assert [v.cached_blocks for v in gs.instances()] == [16, 0]
    gs.remove_instance("i0")
    assert gs.prefix.matches(hashes) == {}


def test_the_block_size_is_the_instances():
    gs = scheduler()
    assert gs.block_size is None
    gs.register_instance("a", BLOCKS, 128, 0.0)
    assert gs.block_size == 128
