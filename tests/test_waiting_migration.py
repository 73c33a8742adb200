"""Migrating a waiting request (Llumnix's first-come-waiting rule): a request queued or preempted on
an instance that migration drains moves without KV and computes on its destination; its tokens are
those it would have had without moving, and every refusal or abort leaves it queued at its source."""

from __future__ import annotations

import pytest

from inprocess import InProcessCluster, make_request, reference_tokens, small_config
from llumdask.request import RequestStatus

# Two requests of 16 + 30 tokens outgrow 12 blocks of 4 while decoding: the later one is preempted.
TIGHT = {"total_blocks": 12}


def preempt_the_later_request(cluster: InProcessCluster, **sampling) -> None:
    cluster["i0"].add_request(make_request("old", 16, 30, arrival=0.0))
    cluster["i0"].add_request(make_request("r", 16, 30, arrival=1.0, **sampling))
    for _ in range(60):
        cluster["i0"].step()
        request = cluster["i0"].engine.get_request("r")
        if request.timing.preemptions and request.status is RequestStatus.WAITING:
            return
    raise AssertionError("the later request was never preempted")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 0.8}])
def test_a_preempted_request_moves_while_it_waits_and_its_tokens_stay_exact(sampling):
    config = small_config(**TIGHT)
    cluster = InProcessCluster(2, config)
    preempt_the_later_request(cluster, **sampling)
    produced = len(cluster.log.sequence("r"))
    assert produced > 0
    assert cluster["i0"].choose_migrant(take_waiting=True) == ("r", True)
    assert cluster["i0"].choose_migrant() == ("old", False)
    assert cluster["i0"].migrate_out("i1", take_waiting=True) is not None
    cluster.run_until_idle()
    (event,) = cluster.committed()
    assert event.waiting and event.blocks == 0 and event.bytes == 0 and event.destination == "i1"
    tokens = cluster.log.sequence("r")
    if "temperature" not in sampling or "seed" in sampling:
        assert tokens == reference_tokens(make_request("r", 16, 30, arrival=1.0, **sampling), config)
    assert len(tokens) == 30 and cluster.log.finished == {"old": 1, "r": 1}
    cluster.assert_no_leaks()


def queue_behind_a_big_request(big_tokens: int = 8, **migration) -> InProcessCluster:
    """i0 runs "big" on most of its 10 blocks; "w" (3 blocks) waits behind it."""
    cluster = InProcessCluster(2, small_config(total_blocks=10, **migration))
    cluster["i0"].add_request(make_request("big", 30, big_tokens, arrival=0.0))
    cluster.step_all()
    cluster["i0"].add_request(make_request("w", 12, 6, arrival=1.0))
    cluster.step_all()
    assert cluster["i0"].engine.get_request("w").status is RequestStatus.WAITING
    return cluster


def w_alone(cluster: InProcessCluster) -> list[int]:
    return reference_tokens(make_request("w", 12, 6, arrival=1.0), cluster.config)


def test_a_request_that_never_started_moves_from_a_blocked_queue():
    cluster = queue_behind_a_big_request()
    assert cluster["i0"].migrate_out("i1", take_waiting=True) is not None
    cluster.run_until_idle()
    (event,) = cluster.committed()
    assert event.request_id == "w" and event.waiting
    assert cluster.log.sequence("w") == w_alone(cluster)
    cluster.assert_no_leaks()


def test_a_destination_that_queues_earlier_requests_refuses_and_the_request_stays():
    config = small_config(total_blocks=10)
    cluster = InProcessCluster(2, config)
    for instance, name in (("i0", "big0"), ("i1", "big1")):
        cluster[instance].add_request(make_request(name, 30, 8, arrival=0.0))
    cluster.step_all()
    cluster["i1"].add_request(make_request("early", 12, 6, arrival=0.5))
    cluster["i0"].add_request(make_request("w", 12, 6, arrival=1.0))
    cluster.step_all()
    assert cluster["i0"].migrate_out("i1", take_waiting=True) is not None
    cluster.run_until_idle()
    (aborted,) = cluster.aborted()
    assert aborted.reason == "destination refused: destination queues earlier requests" and aborted.waiting
    assert cluster.log.sequence("w") == w_alone(cluster)
    cluster.assert_no_leaks()


def test_a_waiting_migrant_admitted_at_its_source_meanwhile_stays_there():
    cluster = queue_behind_a_big_request(big_tokens=2)
    assert cluster["i0"].migrate_out("i1", take_waiting=True) is not None
    cluster.transport.deliver_one(("i0", "i1"))  # i1 reserves room; its reply waits
    assert cluster["i1"].engine.snapshot().reserved_blocks == 3
    while cluster["i0"].engine.get_request("w").status is RequestStatus.WAITING:
        cluster["i0"].step()  # "big" finishes and "w" is admitted here
    cluster.run_until_idle()
    (aborted,) = cluster.aborted()
    assert aborted.reason.startswith("source cannot hand it over")
    assert cluster.log.sequence("w") == w_alone(cluster)
    cluster.assert_no_leaks()


def test_a_source_that_gives_up_after_handing_over_keeps_the_request_and_the_copy_goes():
    cluster = queue_behind_a_big_request(handshake_timeout=0.05)
    cluster["i0"].migrate_out("i1", take_waiting=True)
    # Deliver until i1 has queued "w", holding back its Committed.
    while not cluster["i1"].engine.get_request("w"):
        for pair in cluster.transport.pending_pairs():
            cluster.transport.deliver_one(pair)
    cluster.clock.advance(0.1)
    cluster["i0"].tick()  # the source gives up: "w" goes back into its queue, Abort to i1
    cluster.run_until_idle()
    assert cluster.log.sequence("w") == w_alone(cluster)
    assert cluster.log.finished["w"] == 1
    cluster.assert_no_leaks()


def test_a_running_request_is_chosen_when_nothing_waits():
    cluster = InProcessCluster(1)
    cluster["i0"].add_request(make_request("a", 10, 30))
    cluster.step_all()
    assert cluster["i0"].choose_migrant(take_waiting=True) == ("a", False)
