import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llumdask.llumlet import MigrationEvent, MigrationEventKind
from llumdask.load import InstanceLoad
from llumdask.request import Priority, Request, RequestStatus, SamplingParams
from llumdask.sim.metrics import ClusterSample, InstanceSample, churn, mean_and_p99, mean_instances, summarize

STARTED, COMMITTED, ABORTED = MigrationEventKind.STARTED, MigrationEventKind.COMMITTED, MigrationEventKind.ABORTED


def finished_request(
    rid, arrival, first, last, done, n_out, *, priority=Priority.NORMAL, preemptions=0, loss=0.0, status=RequestStatus.FINISHED
):
    request = Request(
        rid,
        [1, 2, 3],
        SamplingParams(max_tokens=max(n_out, 1)),
        scheduling_priority=priority,
        execution_priority=priority,
        arrival_time=arrival,
    )
    request.output_token_ids = list(range(n_out))
    request.status = status
    t = request.timing
    t.first_token, t.last_token, t.finished = first, last, done
    t.preemptions, t.preemption_loss = preemptions, loss
    return request


def instance(iid, total, free, hol=0, migrating=False):
    return InstanceSample(iid, total, free, head_of_line_demand=hol, num_waiting=int(hol > 0), migrating=migrating)


def event(kind, mid, rid, source, destination, time, nbytes=0, downtime=0.0, waiting=False):
    return MigrationEvent(kind, mid, rid, source, destination, time, bytes=nbytes, downtime=downtime, waiting=waiting)


# ------------------------------------------------------------------------------ percentiles
def test_mean_and_p99_interpolate_linearly():
    assert mean_and_p99(range(1, 101)) == pytest.approx((50.5, 99.01))
    assert mean_and_p99([4.0]) == (4.0, 4.0)
    mean, p99 = mean_and_p99([])
    assert math.isnan(mean) and math.isnan(p99)


# ------------------------------------------------------------------------- request latencies
def timeline():
    """Worked by hand:
    r1: arrives 0, first token 1, last 3, done 3, 5 tokens -> prefill 1, decode 2/4 = 0.5, e2e 3; 2 preemptions, 0.4 s lost
    r2: arrives 1, first 1.5, one token, done 1.5            -> prefill 0.5, no decode, e2e 0.5
    r3: aborted                                             -> ignored
    """
    return [
        finished_request("r1", 0.0, 1.0, 3.0, 3.0, 5, preemptions=2, loss=0.4),
        finished_request("r2", 1.0, 1.5, 1.5, 1.5, 1),
        finished_request("r3", 0.0, 0.2, 9.0, 9.0, 7, status=RequestStatus.ABORTED, preemptions=5, loss=3.0),
    ]


def test_latency_formulas_on_a_hand_worked_timeline():
    result = summarize(timeline(), [], [], duration=3.0)
    assert result["requests"] == 2
    assert result["prefill_mean"] == pytest.approx(0.75)
    assert result["prefill_p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert result["decode_mean"] == pytest.approx(0.5)
    assert result["decode_p99"] == pytest.approx(0.5)
    assert result["e2e_mean"] == pytest.approx(1.75)
    assert result["e2e_p99"] == pytest.approx(0.5 + 0.99 * 2.5)
    assert result["preemption_count"] == 2
    assert result["preemption_loss_mean"] == pytest.approx(0.2)


def test_priority_breakdown_appears_only_when_both_priorities_finished():
    requests = [
        finished_request("h1", 0.0, 0.1, 1.1, 1.1, 11, priority=Priority.HIGH),
        finished_request("n1", 0.0, 0.5, 2.5, 2.5, 11),
        finished_request("n2", 1.0, 2.0, 4.0, 4.0, 5),
    ]
    result = summarize(requests, [], [], duration=4.0)
    assert result["high_prefill_mean"] == pytest.approx(0.1)
    assert result["high_decode_mean"] == pytest.approx(0.1)
    assert result["high_e2e_p99"] == pytest.approx(1.1)
    assert result["normal_prefill_mean"] == pytest.approx(0.75)
    assert result["normal_decode_mean"] == pytest.approx((0.2 + 0.5) / 2)
    assert result["normal_e2e_mean"] == pytest.approx((2.5 + 3.0) / 2)
    only_normal = summarize(requests[1:], [], [], duration=4.0)
    assert not any(key.startswith(("high_", "normal_")) for key in only_normal)


# ----------------------------------------------------------------------------- fragmentation
@pytest.mark.parametrize(
    "instances, fragmented",
    [
        # Waits for 40 blocks with 30 free, 20 free next door: pooled 50 >= 40 -> 40 fragmented.
        ((instance("a", 100, 30, hol=40), instance("b", 100, 20)), 40),
        # Pooled 35 < 40: free memory could not serve it even as one pool.
        ((instance("a", 100, 30, hol=40), instance("b", 100, 5)), 0),
        # Blocked demands 10, 20, 50 with 60 free in all: smallest first, 10 + 20 fit, 50 does not.
        ((instance("a", 100, 5, hol=10), instance("b", 100, 15, hol=20), instance("c", 100, 0, hol=50), instance("d", 100, 40)), 30),
        # The head of line fits where it waits: it is not blocked by memory.
        ((instance("a", 100, 30, hol=10), instance("b", 100, 60)), 0),
        # One instance cannot scatter its memory.
        ((instance("a", 100, 30, hol=40),), 0),
        # Nothing waits.
        ((instance("a", 100, 0), instance("b", 100, 100)), 0),
        ((), 0),
    ],
)
def test_fragmentation_by_hand(instances, fragmented):
    sample = ClusterSample(0.0, instances)
    assert sample.fragmented_blocks() == fragmented
    total = sum(i.total_blocks for i in instances)
    assert sample.fragmentation() == (fragmented / total if total else 0.0)


def test_the_first_request_held_at_the_scheduler_is_blocked_only_where_no_instance_could_take_it():
    free = (instance("a", 100, 30), instance("b", 100, 25))
    assert ClusterSample(0.0, free).fragmented_blocks() == 0
    assert ClusterSample(0.0, free, held_demand=20).fragmented_blocks() == 0  # a could take it: held for room to spare
    assert ClusterSample(0.0, free, held_demand=30).fragmented_blocks() == 0
    assert ClusterSample(0.0, free, held_demand=40).fragmented_blocks() == 40  # 55 free, scattered
    assert ClusterSample(0.0, free, held_demand=80).fragmented_blocks() == 0  # not even the pool holds it


@given(
    st.lists(
        st.tuples(st.integers(1, 500), st.integers(0, 500), st.integers(0, 600)).map(
            lambda t: instance("i", t[0], min(t[1], t[0]), hol=t[2])
        ),
        max_size=12,
    )
)
def test_fragmentation_is_a_share_of_free_memory(instances):
    sample = ClusterSample(0.0, tuple(instances))
    assert 0 <= sample.fragmented_blocks() <= sample.free_blocks
    assert 0.0 <= sample.fragmentation() <= 1.0
    if not any(i.head_of_line_demand > i.free_blocks for i in instances):
        assert sample.fragmented_blocks() == 0


def test_cluster_sample_from_loads():
    loads = [
        InstanceLoad("a", 100, 16, free_blocks=40, num_running=3, num_waiting=2, head_of_line_demand=50, num_migrating_in=1),
        InstanceLoad("b", 80, 16, free_blocks=80, num_running=0, num_waiting=0),
    ]
    sample = ClusterSample.from_loads(2.5, loads)
    assert sample.time == 2.5
    assert sample.instances == (
        InstanceSample("a", 100, 40, head_of_line_demand=50, num_running=3, num_waiting=2, migrating=True),
        InstanceSample("b", 80, 80, head_of_line_demand=0, num_running=0, num_waiting=0, migrating=False),
    )
    assert (sample.total_blocks, sample.free_blocks, sample.fragmented_blocks()) == (180, 120, 50)


# ------------------------------------------------------------------------- time-weighted samples
def test_sampled_quantities_are_time_weighted():
    samples = [
        # t = 0..10: 2 instances, one migrating, 40 of 200 blocks fragmented (0.2).
        ClusterSample(0.0, (instance("a", 100, 30, hol=40, migrating=True), instance("b", 100, 20))),
        # t = 10..40: 4 instances, none migrating, no fragmentation.
        ClusterSample(10.0, tuple(instance(x, 100, 100) for x in "abcd")),
    ]
    result = summarize([], samples, [], duration=40.0)
    assert result["instances_mean"] == pytest.approx((2 * 10 + 4 * 30) / 40)
    assert result["fragmentation_mean"] == pytest.approx(0.2 * 10 / 40)
    assert result["migrating_time_share"] == pytest.approx((1 * 10) / (2 * 10 + 4 * 30))


def test_samples_at_one_instant_weigh_equally_and_order_is_checked():
    samples = [ClusterSample(5.0, (instance("a", 10, 10),)), ClusterSample(5.0, tuple(instance(x, 10, 10) for x in "abc"))]
    assert summarize([], samples, [], duration=5.0)["instances_mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="time order"):
        summarize([], samples[::-1] + [ClusterSample(1.0)], [], duration=5.0)


# ---------------------------------------------------------------------------------- migrations
def test_migration_counts_bytes_downtime_and_churn_by_hand():
    events = [
        event(STARTED, "m1", "r1", "A", "B", 1.0),
        event(COMMITTED, "m1", "r1", "A", "B", 2.0, nbytes=1000, downtime=0.02),
        event(STARTED, "m2", "r1", "B", "A", 4.0),
        event(COMMITTED, "m2", "r1", "B", "A", 5.0, nbytes=500, downtime=0.04),  # r1 moved twice, back to A
        event(STARTED, "m3", "r2", "A", "C", 1.0),
        event(ABORTED, "m3", "r2", "A", "C", 1.5, nbytes=200),  # partial copy still crossed the network
        event(STARTED, "m4", "r3", "A", "B", 3.0),
        event(COMMITTED, "m4", "r3", "A", "B", 3.5, nbytes=300, downtime=0.03),
        event(STARTED, "m5", "r4", "C", "D", 6.0),  # still in flight when the run ended
        event(STARTED, "m6", "r5", "C", "D", 2.0),
        event(COMMITTED, "m6", "r5", "C", "D", 2.1, waiting=True),  # handed over from a queue
    ]
    result = summarize([], [], events, duration=6.0)
    assert result["migrations"] == 4 and result["migrations_waiting"] == 1
    assert result["migrations_aborted"] == 1
    assert result["migration_bytes"] == 2000
    assert result["migration_downtime_mean"] == pytest.approx(0.03)
    assert (result["churn"], result["churn_returns"]) == (1, 1)


def test_churn_tells_repeated_moves_from_moves_back():
    onward = [event(COMMITTED, "m1", "r", "A", "B", 1.0), event(COMMITTED, "m2", "r", "B", "C", 2.0)]
    assert churn(onward) == (1, 0)
    # Events may arrive out of time order; the path is ordered by time. A -> B -> C -> A returns.
    loop = [event(COMMITTED, "m3", "r", "C", "A", 3.0), *onward]
    assert churn(loop) == (1, 1)
    assert churn([event(COMMITTED, "m1", "r", "A", "B", 1.0), event(ABORTED, "m2", "r", "B", "A", 2.0)]) == (0, 0)


# ------------------------------------------------------------------------------- empty inputs
def test_empty_run_gives_nan_statistics_and_zero_counts():
    result = summarize([], [], [], duration=0.0)
    for key in (
        "prefill_mean", "prefill_p99", "decode_mean", "decode_p99", "e2e_mean", "e2e_p99",
        "preemption_loss_mean", "fragmentation_mean", "instances_mean", "migrating_time_share",
        "migration_downtime_mean",
    ):
        assert math.isnan(result[key]), key
    for key in ("requests", "preemption_count", "migrations", "migrations_waiting", "migrations_aborted", "migration_bytes",
                "churn", "churn_returns"):
        assert result[key] == 0, key


def test_bad_duration_is_refused():
    with pytest.raises(ValueError, match="duration"):
        summarize([], [], [], duration=-1.0)
    with pytest.raises(ValueError, match="duration"):
        summarize([], [], [], duration=float("nan"))


def test_mean_instances_over_a_window_ignores_what_comes_after():
    samples = [ClusterSample(0.0, (instance("a", 10, 10), instance("b", 10, 10))), ClusterSample(10.0, (instance("a", 10, 10),)),
               ClusterSample(30.0, (instance("a", 10, 10),))]
    assert mean_instances(samples, 20.0) == pytest.approx((2 * 10 + 1 * 10) / 20)
    assert mean_instances(samples, 5.0) == 2.0
