"""Live migration between in-process llumlets: exact tokens, every abort path, no leaked block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inprocess import InProcessCluster, make_request, reference_tokens, small_config
from llumdask.engine.base import MigrationRefused
from llumdask.llumlet import MigrationEventKind
from llumdask.protocol import PreAlloc, StageData
from llumdask.request import Priority, Request, SamplingParams


def run_with_migration(steps_before: int, *, prompt_len: int = 10, max_tokens: int = 40, **sampling) -> InProcessCluster:
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", prompt_len, max_tokens, **sampling))
    for _ in range(steps_before):
        cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    return cluster


@pytest.mark.parametrize("steps_before", [1, 2, 5, 20, 37])
def test_migrated_tokens_identical_at_every_point(steps_before):
    cluster = run_with_migration(steps_before)
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 10, 40))
    assert len(cluster.committed()) == 1
    assert cluster.log.finished == {"r": 1}
    cluster.assert_no_leaks()


@pytest.mark.parametrize("sampling", [{"temperature": 0.8, "seed": 7}, {"temperature": 0.8}])
def test_sampled_tokens_survive_migration(sampling):
    cluster = run_with_migration(6, **sampling)
    migrated = cluster.log.sequence("r")
    if "seed" in sampling:
        assert migrated == reference_tokens(make_request("r", 10, 40, **sampling))
    assert len(migrated) == 40
    cluster.assert_no_leaks()


def test_long_prompt_takes_several_stages_and_short_downtime():
    cluster = run_with_migration(3, prompt_len=120, max_tokens=60)
    (event,) = cluster.committed()
    assert event.stages >= 2
    assert event.blocks >= 120 // 4
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 120, 60))
    cluster.assert_no_leaks()


def test_downtime_splits_into_the_source_the_destination_and_the_transport():
    cluster = InProcessCluster(2)
    source, destination = cluster["i0"].engine, cluster["i1"].engine
    export_later, resume = source.export_later, destination.resume

    def slow_export(*args, **kwargs):  # each stage's export takes 2 ms of the source's clock
        cluster.clock.advance(0.002)
        return export_later(*args, **kwargs)

    def slow_resume(*args, **kwargs):  # resuming takes 5 ms of the destination's
        cluster.clock.advance(0.005)
        return resume(*args, **kwargs)

    source.export_later, destination.resume = slow_export, slow_resume
    cluster["i0"].add_request(make_request("r", 120, 60))
    for _ in range(3):
        cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    (event,) = cluster.committed()
    assert event.downtime_source == pytest.approx(0.002)  # the last stage's export, after the pause
    assert event.downtime_destination == pytest.approx(0.005)
    assert event.downtime >= event.downtime_source + event.downtime_destination - 1e-12
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 120, 60))
    cluster.assert_no_leaks()


def test_destination_out_of_blocks_refuses_and_request_completes_at_source():
    config = small_config(total_blocks=8)
    cluster = InProcessCluster(2, config)
    cluster["i1"].add_request(make_request("filler", 28, 4))
    cluster.step_all()
    cluster["i0"].add_request(make_request("r", 20, 5))
    cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    (aborted,) = cluster.aborted()
    assert "refused" in aborted.reason
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 20, 5), config)
    cluster.assert_no_leaks()


@pytest.mark.parametrize(
    ("queued", "hold", "priority", "moves"),
    [(True, 1.0, Priority.NORMAL, False), (False, 1.0, Priority.NORMAL, True), (True, None, Priority.NORMAL, True),
     (True, 1.0, Priority.HIGH, True)],
)
def test_a_destination_keeps_the_room_its_queue_needs(queued, hold, priority, moves):
    """A normal-priority migrant is let in only where, with its first stage's blocks taken, the
    queue still has its demand and `dispatch.hold-freeness` blocks per request left (as the
    scheduler places a new request; a high-priority one, which dispatch never holds, goes where its
    blocks are free); refused, it goes on at its source, and the queued request starts where it was
    sent."""
    base = small_config()  # 64 blocks of 4 tokens
    config = replace(base, dispatch=replace(base.dispatch, hold_freeness=hold))
    cluster = InProcessCluster(2, config)
    cluster["i0"].add_request(replace(make_request("r", 20, 12), execution_priority=priority))
    cluster["i1"].add_request(make_request("big", 160, 30))  # 40 blocks
    cluster.step_all()
    if queued:
        cluster["i1"].add_request(make_request("queued", 76, 4))  # 19 blocks, waiting until i1 steps
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.transport.deliver_all()  # the destination answers before it steps again
    cluster.run_until_idle()
    assert len(cluster.committed()) == moves
    if not moves:
        (aborted,) = cluster.aborted()
        assert aborted.reason == "destination refused: destination needs its room for its queue"
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 20, 12), config)
    assert cluster.log.finished == {"r": 1, "big": 1} | ({"queued": 1} if queued else {})
    cluster.assert_no_leaks()


def test_a_destination_refusing_for_its_queue_keeps_its_cached_prefixes():
    """The check comes before any block is taken: taking free blocks evicts cached prefixes, which
    a refusal would hand back uncached (and a source asks again every pairing round)."""
    cluster = InProcessCluster(2)  # 64 blocks of 4 tokens
    old = make_request("old", 120, 2)
    cluster["i1"].add_request(old)
    cluster.run_until_idle()  # its 30 full blocks stay cached, free to evict
    cluster["i0"].add_request(make_request("r", 60, 40))
    cluster["i1"].add_request(make_request("big", 100, 60))
    for _ in range(3):
        cluster.step_all()
    cluster["i1"].add_request(make_request("queued", 84, 4))  # waiting until i1 steps
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.transport.deliver_all()
    (aborted,) = cluster.aborted()
    assert aborted.reason == "destination refused: destination needs its room for its queue"
    engine = cluster["i1"].engine
    assert engine.reserve_cached("probe", old.prompt_token_ids) == 30
    engine.release_reservation("probe")
    cluster.run_until_idle()
    cluster.assert_no_leaks()


def test_request_finishing_mid_stage_aborts_and_releases():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 40, 3))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    # Let the source decode to completion before the destination answers anything.
    while cluster["i0"].engine.has_work():
        cluster["i0"].step()
    cluster.run_until_idle()
    assert [e.kind for e in cluster.events] == [MigrationEventKind.STARTED, MigrationEventKind.ABORTED]
    assert cluster.log.finished == {"r": 1}
    cluster.assert_no_leaks()


def test_source_preemption_mid_stage_aborts():
    config = small_config(total_blocks=12)
    cluster = InProcessCluster(2, config)
    cluster["i0"].add_request(make_request("old", 16, 30, arrival=0.0))
    cluster["i0"].add_request(make_request("r", 16, 30, arrival=1.0))
    cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    # Step the source alone until it must preempt the latest arrival ("r") for lack of blocks.
    for _ in range(40):
        cluster["i0"].step()
        if cluster.aborted():
            break
    assert cluster.aborted() and cluster.aborted()[0].reason == "request preempted"
    cluster.run_until_idle()
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 16, 30), config)
    cluster.assert_no_leaks()


def test_destination_killed_mid_stage_source_continues():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 60, 20))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    cluster.transport.deliver_round()  # PreAlloc reaches i1, which reserves and acks
    cluster.transport.deliver_round()  # the ack reaches i0, which sends stage 0
    cluster.kill("i1")
    cluster.run_until_idle()
    assert cluster.aborted() and "lost" in cluster.aborted()[0].reason
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 60, 20))
    cluster.assert_no_leaks()


def test_source_killed_destination_releases_reservation():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 60, 20))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    cluster.transport.deliver_round()
    assert cluster["i1"].engine.snapshot().reserved_blocks > 0
    cluster.kill("i0")
    assert cluster["i1"].engine.snapshot().reserved_blocks == 0
    cluster["i1"].check_integrity()


def test_silent_destination_times_out_and_both_sides_release():
    cluster = InProcessCluster(2, small_config(handshake_timeout=0.05))
    cluster["i0"].add_request(make_request("r", 60, 40))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    cluster.transport.deliver_round()  # i1 reserves and acks
    cluster.transport.deliver_round()  # i0 sends stage 0
    # i1 goes silent: drop everything it would receive from now on.
    cluster.transport.unregister("i1")
    cluster.clock.advance(0.1)
    cluster["i0"].tick()
    cluster["i1"].tick()
    assert cluster.aborted() and "timeout" in cluster.aborted()[0].reason
    assert cluster["i1"].engine.snapshot().reserved_blocks == 0
    cluster.transport.register("i1", cluster["i1"].on_message)
    cluster.run_until_idle()
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 60, 40))
    cluster.assert_no_leaks()


def test_late_abort_after_commit_drops_destination_copy():
    cluster = InProcessCluster(2, small_config(handshake_timeout=0.05))
    cluster["i0"].add_request(make_request("r", 6, 40))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    # Deliver only i0 -> i1 and i1 -> i0 until i1 has committed, but hold back the Committed reply.
    while not cluster["i1"].engine.get_request("r"):
        for pair in cluster.transport.pending_pairs():
            cluster.transport.deliver_one(pair)
    cluster.clock.advance(0.1)
    cluster["i0"].tick()  # source gives up first, unpauses, sends Abort
    cluster.run_until_idle()
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 6, 40))
    assert cluster["i1"].engine.get_request("r") is None or cluster["i1"].engine.get_request("r").status.is_done
    cluster.assert_no_leaks()


def test_a_late_abort_also_stops_the_destinations_own_migration_of_the_copy():
    # i1 has resumed "r" (its Committed not yet back at i0) and already moves it on to i2 when the
    # source's Abort arrives: dropping the copy must end that onward migration too, leak-free.
    cluster = InProcessCluster(3, small_config(handshake_timeout=0.05, max_concurrent=2))
    cluster["i0"].add_request(make_request("r", 6, 40))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    while not cluster["i1"].engine.get_request("r"):
        for pair in [p for p in cluster.transport.pending_pairs() if p in (("i0", "i1"), ("i1", "i0"))]:
            cluster.transport.deliver_one(pair)
    assert cluster["i1"].migrate_out("i2", "r")
    cluster.transport.deliver_one(("i1", "i2"))  # PreAlloc: i2 reserves, its reply waits
    cluster.clock.advance(0.1)
    cluster["i0"].tick()  # the source gives up first: unpauses "r", sends Abort to i1
    cluster.transport.deliver_one(("i0", "i1"))  # i1 drops its copy of "r"...
    assert cluster["i1"].engine.get_request("r") is None
    cluster.run_until_idle()  # ... and i2's reply finds no migration left to continue
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 6, 40))
    assert any(e.source == "i1" and e.reason == "request aborted" for e in cluster.aborted())
    cluster.assert_no_leaks()


def test_terminating_destination_refuses():
    cluster = InProcessCluster(2)
    cluster["i1"].set_terminating(True)
    cluster["i0"].add_request(make_request("r", 10, 10))
    cluster.step_all()
    cluster["i0"].migrate_out("i1", "r")
    cluster.run_until_idle()
    assert "terminating" in cluster.aborted()[0].reason
    cluster.assert_no_leaks()


def test_max_concurrent_and_self_migration_rejected():
    cluster = InProcessCluster(2)
    for name in ("a", "b"):
        cluster["i0"].add_request(make_request(name, 10, 30))
    cluster.step_all()
    assert cluster["i0"].migrate_out("i0") is None
    assert cluster["i0"].migrate_out("i1") is not None
    assert cluster["i0"].migrate_out("i1") is None  # max_concurrent defaults to 1
    cluster.run_until_idle()
    cluster.assert_no_leaks()


def test_choose_migrant_prefers_normal_priority_then_shorter():
    cluster = InProcessCluster(1)
    llumlet = cluster["i0"]
    high = make_request("high", 4, 30)
    high.execution_priority = Priority.HIGH
    llumlet.add_request(high)
    llumlet.add_request(make_request("long", 40, 30))
    llumlet.add_request(make_request("short", 8, 30))
    cluster.step_all()
    assert llumlet.choose_migrant() == ("short", False)


def test_load_report_follows_algorithm_inputs():
    cluster = InProcessCluster(1)
    llumlet = cluster["i0"]
    high = make_request("high", 8, 30)
    high.execution_priority = Priority.HIGH
    llumlet.add_request(high)
    llumlet.add_request(make_request("n", 12, 30))
    cluster.step_all()
    llumlet.add_request(make_request("w", 20, 30))
    report = llumlet.load_report()
    assert report.num_received == 3
    assert report.running_count == {Priority.HIGH: 1, Priority.NORMAL: 1}
    # The token sampled by the prefill gets its KV slot in the next step, as in vLLM.
    assert report.running_blocks[Priority.NORMAL] == 12 // 4
    assert report.num_waiting == 1 and report.head_of_line_demand == 5
    assert report.used_blocks == sum(report.running_blocks.values())
    # Handed over but refused (it could never fit), or refused unseen with it: received all the
    # same, so the scheduler stops counting them as on their way.
    with pytest.raises(ValueError):
        llumlet.add_request(make_request("huge", 4 * llumlet.engine.total_blocks + 1, 1))
    llumlet.received_unadded(2)
    assert llumlet.load_report().num_received == 6


def test_stale_and_foreign_messages_are_dropped():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 10, 10))
    cluster.step_all()
    cluster["i1"].on_message("i0", StageData("nope", 0, 0, 1, b"", None))
    cluster.transport.deliver_all()  # i1 answered Abort for an unknown migration; i0 ignores it
    cluster["i0"].on_message("i1", PreAlloc("x", "i1", "i0", "ghost", 0, 1000))
    cluster.transport.deliver_all()
    cluster.run_until_idle()
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 10, 10))
    cluster.assert_no_leaks()


def _spy_source_messages(cluster: InProcessCluster, request_id: str) -> list[tuple[str, bool]]:
    """Every message i0 sends, with whether `request_id` was paused then (a decoding request
    that cannot move: the sim engine lists paused requests as running but not migratable)."""
    sent: list[tuple[str, bool]] = []
    send = cluster.transport.send

    def spy(sender, receiver, message):
        if sender == "i0":
            movable = {r.request_id for r in cluster["i0"].engine.snapshot().running if r.migratable}
            sent.append((type(message).__name__, request_id not in movable))
        send(sender, receiver, message)

    cluster.transport.send = spy
    return sent


def test_last_stage_reserves_its_tail_before_it_pauses():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 120, 60))
    sent = _spy_source_messages(cluster, "r")
    for _ in range(3):
        cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    (event,) = cluster.committed()
    assert event.stages >= 2
    # Every reservation is asked while the request decodes; paused, the source sends only the last stage.
    assert [name for name, paused in sent if paused] == ["StageData"]
    assert sent[-1] == ("StageData", True) and sent[-2] == ("PreAlloc", False)
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 120, 60))
    cluster.assert_no_leaks()


@pytest.mark.parametrize("slack, steps_in_flight, prealloc_paused", [(1, 3, 0), (0, 4, 1), (1, 8, 1)])
def test_a_tail_that_outgrew_its_reservation_is_reserved_again_while_paused(slack, steps_in_flight, prealloc_paused):
    # The first stage is the last (last-stage-blocks 100); the source decodes `steps_in_flight`
    # tokens (block size 4) before its reservation is answered.
    config = small_config(last_stage_blocks=100, last_stage_slack_blocks=slack)
    cluster = InProcessCluster(2, config)
    cluster["i0"].add_request(make_request("r", 10, 40))
    sent = _spy_source_messages(cluster, "r")
    for _ in range(3):
        cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    for _ in range(steps_in_flight):
        cluster["i0"].step()
    cluster.run_until_idle()
    assert len(cluster.committed()) == 1
    assert sent.count(("PreAlloc", True)) == prealloc_paused
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 10, 40), config)
    cluster.assert_no_leaks()


def test_a_source_that_cannot_pause_aborts_and_keeps_the_request():
    cluster = InProcessCluster(2)
    cluster["i0"].add_request(make_request("r", 10, 30))
    cluster.step_all()

    def refuse(request_id):
        raise MigrationRefused(f"request {request_id!r} is not in the running batch")

    cluster["i0"].engine.pause = refuse
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    (aborted,) = cluster.aborted()
    assert aborted.reason.startswith("source cannot pause")
    assert cluster.log.sequence("r") == reference_tokens(make_request("r", 10, 30))
    cluster.assert_no_leaks()


SHARED = list(range(100, 140))  # ten blocks of 4 tokens


def sharing(request_id: str, own: int, max_tokens: int, cache_salt: str | None = None) -> Request:
    """A request whose prompt starts with SHARED, then `own` tokens of its own."""
    prompt = SHARED + (make_request(request_id, own).prompt_token_ids if own else [])
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=cache_salt)


def migrate_sharing(warm: bool, steps_before: int, own: int, hog: int = 0, *, warm_salt: str | None = None,
                    salt: str | None = None) -> InProcessCluster:
    """Migrate a request sharing SHARED (under cache salt `salt`) to i1, which cached SHARED
    first (`warm`, under `warm_salt`) or not, and has `hog` blocks reserved for another migration."""
    cluster = InProcessCluster(2, small_config(total_blocks=32))
    if warm:
        cluster["i1"].add_request(sharing("warm-up", 3, 2, warm_salt))
        cluster.run_until_idle()
    assert cluster["i1"].engine.reserve_blocks("hog", hog)
    cluster["i0"].add_request(sharing("r", own, 20, salt))
    for _ in range(steps_before):
        cluster.step_all()
    assert cluster["i0"].migrate_out("i1", "r") is not None
    cluster.run_until_idle()
    cluster["i1"].engine.release_reservation("hog")
    return cluster


@pytest.mark.parametrize(("steps_before", "own"), [(1, 5), (1, 0), (4, 5), (15, 5)])
def test_blocks_the_destination_caches_are_reused_not_copied_and_tokens_stay_exact(steps_before, own):
    cold, warm = (migrate_sharing(w, steps_before, own) for w in (False, True))
    (moved,), (reused,) = cold.committed(), warm.committed()
    assert moved.reused_blocks == 0 and reused.reused_blocks == len(SHARED) // 4
    per_block = moved.bytes // moved.blocks
    assert moved.blocks == reused.blocks and reused.bytes == per_block * (reused.blocks - reused.reused_blocks)
    expected = reference_tokens(sharing("r", own, 20))
    assert cold.log.sequence("r") == warm.log.sequence("r") == expected
    warm.assert_no_leaks()


@pytest.mark.parametrize(("warm_salt", "salt", "reused"), [
    ("tenant-a", "tenant-a", len(SHARED) // 4), ("tenant-a", "tenant-b", 0), (None, "tenant-a", 0), ("tenant-a", None, 0),
])
def test_a_migrant_reuses_the_destinations_blocks_only_under_its_own_cache_salt(warm_salt, salt, reused):
    cluster = migrate_sharing(True, 1, 5, warm_salt=warm_salt, salt=salt)
    (committed,) = cluster.committed()
    assert committed.reused_blocks == reused
    assert cluster.log.sequence("r") == reference_tokens(sharing("r", 5, 20))
    cluster.assert_no_leaks()


def test_a_refused_migration_gives_back_the_cached_blocks_it_reused():
    """The destination holds the prefix but no room for the rest: it refuses, and the prefix it
    had taken for the migration is free (and still cached) again."""
    cluster = migrate_sharing(True, 2, 8, hog=21)  # 21 of 32 blocks held: the 11 cached ones are left
    (aborted,) = cluster.aborted()
    assert "out of blocks" in aborted.reason and not cluster.committed()
    assert cluster.log.sequence("r") == reference_tokens(sharing("r", 8, 20))
    cluster.assert_no_leaks()
    engine = cluster["i1"].engine
    assert engine.reserve_cached("probe", SHARED) == len(SHARED) // 4  # the prefix outlived the refusal
    engine.release_reservation("probe")
    cluster.assert_no_leaks()
