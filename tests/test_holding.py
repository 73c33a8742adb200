"""Holding requests at the global scheduler past capacity (`dispatch.hold-freeness`, llumdask/holding.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.config import ConfigError, DispatchConfig, LlumdaskConfig, ScalingConfig, load_config
from llumdask.global_scheduler import PENDING_EXPIRY, DispatchInfo, GlobalScheduler
from llumdask.holding import Held, HeldRequests
from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixEvents
from llumdask.request import Priority

BLOCKS, BLOCK_SIZE = 100, 16


def scheduler(n: int, hold: float | None = 1.0, policy: str = "llumnix", limit: float | None = None) -> GlobalScheduler:
    gs = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(policy=policy, interference_freeness=None,
                                                                hold_freeness=hold, hold_limit=limit)))
    for k in range(n):
        gs.register_instance(f"i{k}", BLOCKS, BLOCK_SIZE, 0.0)
        gs.mark_ready(f"i{k}", 0.0)
    return gs


def load(instance_id: str, used: int, running: int, received: int = 0) -> InstanceLoad:
    return InstanceLoad(instance_id, BLOCKS, BLOCK_SIZE, BLOCKS - used, running, 0,
                        running_blocks={Priority.NORMAL: used}, running_count={Priority.NORMAL: running},
                        num_received=received)


def req(name: str, blocks: int, priority: Priority = Priority.NORMAL, **kw) -> DispatchInfo:
    return DispatchInfo(name, blocks * BLOCK_SIZE, 10, priority, **kw)


def test_a_request_without_room_to_spare_waits_for_the_first_instance_that_has_it():
    gs = scheduler(2)
    gs.report(load("i0", used=90, running=5), 0.0)
    gs.report(load("i1", used=92, running=4), 0.0)
    # i0 would keep (100 - 90 - 5) / 6 = 0.8 free blocks per request with it: under 1.
    assert gs.dispatch(req("r", 5), 1.0) is None
    assert "r" in gs.held and gs.held.oldest(3.0) == 2.0
    assert gs.release(1.5) == []  # nothing changed
    gs.report(load("i1", used=70, running=3), 2.0)  # i1 frees memory first
    placed = gs.release(2.0)
    assert [(i.request_id, target) for i, target in placed] == [("r", "i1")]
    assert not gs.held and gs.instances()[1].num_pending == 1  # counted where it went
    assert gs.release(2.5) == []


def test_with_room_to_spare_a_request_is_placed_at_once_and_off_it_queues():
    gs = scheduler(1)
    gs.report(load("i0", used=50, running=5), 0.0)
    assert gs.dispatch(req("r", 5), 1.0) == "i0"  # (100 - 50 - 5) / 6 = 7.5 >= 1
    off = scheduler(1, hold=None)
    off.report(load("i0", used=99, running=5), 0.0)
    assert off.dispatch(req("r", 50), 1.0) == "i0"  # queues on the instance


def test_past_the_hold_limit_the_first_held_request_needs_only_room_for_its_prompt():
    gs = scheduler(2, limit=2.0)
    gs.report(load("i0", used=90, running=5), 0.0)
    gs.report(load("i1", used=93, running=4), 0.0)
    assert gs.dispatch(req("first", 5), 1.0) is None  # i0 would keep (100 - 90 - 5) / 6 = 0.8: under 1
    assert gs.dispatch(req("second", 5), 1.5) is None
    assert gs.release(2.9) == []  # waited 1.9 s: still for room to spare
    placed = gs.release(3.0)  # waited 2 s: i0 takes its prompt with nothing to spare
    assert [(i.request_id, target) for i, target in placed] == [("first", "i0")]
    # The second, first now, has waited 1.9 s: i1 would keep (100 - 93 - 5) / 5 = 0.4, i0 with
    # the first on its way 0. At 2 s its prompt goes where it fits, the freest.
    assert "second" in gs.held and gs.release(3.4) == []
    assert [(i.request_id, target) for i, target in gs.release(3.5)] == [("second", "i1")]


def test_past_the_hold_limit_only_the_first_held_request_needs_no_room_to_spare():
    gs = scheduler(2, limit=1.0)
    gs.report(load("i0", used=90, running=5), 0.0)
    gs.report(load("i1", used=93, running=4), 0.0)
    # The first's prompt (20 blocks) fits nowhere; the second's (5) would fit with nothing to
    # spare, and a newcomer's too, but both still need room to spare to pass the first.
    assert gs.dispatch(req("big", 20), 1.0) is None
    assert gs.dispatch(req("small", 5), 1.0) is None
    assert gs.release(5.0) == []
    assert gs.dispatch(req("new", 5), 5.0) is None


def test_without_a_hold_limit_or_past_it_with_no_room_for_the_prompt_a_request_waits():
    for gs in (scheduler(1), scheduler(1, limit=0.0)):
        gs.report(load("i0", used=97, running=5), 0.0)
        assert gs.dispatch(req("r", 5), 1.0) is None
        # No limit: room to spare it would need; a limit of 0: the prompt's 5 blocks it needs,
        # and 3 are free.
        assert gs.release(100.0) == []
    unlimited = scheduler(1)
    unlimited.report(load("i0", used=90, running=5), 0.0)
    assert unlimited.dispatch(req("r", 5), 1.0) is None
    assert unlimited.release(1000.0) == []  # 0.8 free blocks a request, under 1, for ever


def test_the_hold_limit_is_off_by_default_and_must_not_be_negative():
    assert load_config().dispatch.hold_limit is DispatchConfig().hold_limit is None
    assert load_config({"dispatch": {"hold-limit": 0.5}}).dispatch.hold_limit == 0.5
    with pytest.raises(ConfigError, match="hold-limit"):
        load_config({"dispatch": {"hold-limit": -1.0}})


# A prompt of 40 blocks told by its anchors (one per 128 tokens: every 8th block of 16 tokens);
# an instance caching its first four anchors holds its first 32 blocks.
PROMPT_ANCHORS = (101, 102, 103, 104, 105)
CACHED = PrefixEvents(stored=PROMPT_ANCHORS[:4])


def test_room_for_a_held_request_is_room_for_what_the_instance_does_not_cache():
    gs = scheduler(2)
    gs.report(load("i0", used=90, running=5), 0.0)
    gs.report(load("i1", used=75, running=4), 0.0, CACHED)
    # i1 has 25 free blocks: not the prompt's 40, but the 8 it lacks, with room to spare.
    assert gs.dispatch(req("shared", 40, block_hashes=PROMPT_ANCHORS), 1.0) == "i1"
    # Without the prefix cached anywhere the same prompt is held.
    assert gs.dispatch(req("unshared", 40, block_hashes=(201, 202, 203, 204, 205)), 1.0) is None


def test_a_held_request_passes_a_larger_one_where_its_prefix_is_cached():
    gs = scheduler(2)
    gs.report(load("i0", used=60, running=4), 0.0)
    gs.report(load("i1", used=95, running=4), 0.0, CACHED)
    assert gs.dispatch(req("big", 80), 1.0) is None  # kept i0, where it comes closest to fitting
    assert gs.dispatch(req("shared", 40, block_hashes=PROMPT_ANCHORS), 1.0) is None  # i1 is full
    # Floors: the whole prompt for "big", the 8 blocks i1 lacks for "shared".
    assert [h.info.request_id for h in gs.held.within(8 * BLOCK_SIZE)] == ["shared"]
    assert [h.info.request_id for h in gs.held.within(80 * BLOCK_SIZE)] == ["big", "shared"]
    gs.report(load("i1", used=75, running=4), 2.0)
    # 25 free blocks on i1: less than the whole prompt, room for the 8 blocks it lacks there.
    assert [(i.request_id, target) for i, target in gs.release(2.0)] == [("shared", "i1")]
    assert [h.info.request_id for h in gs.held] == ["big"]


def test_a_held_request_whose_prefix_is_cached_after_it_was_held_takes_only_what_it_lacks():
    gs = scheduler(2)
    gs.report(load("i0", used=60, running=4), 0.0)
    gs.report(load("i1", used=95, running=4), 0.0)
    assert gs.dispatch(req("big", 80), 1.0) is None
    assert gs.dispatch(req("shared", 40, block_hashes=PROMPT_ANCHORS), 1.0) is None  # cached nowhere
    assert list(gs.held.within(40 * BLOCK_SIZE - 1)) == []
    # i1 frees 20 blocks and caches the prompt's first 32: room for the 8 it lacks, not for 40.
    gs.report(load("i1", used=75, running=4), 2.0, CACHED)
    assert [(i.request_id, target) for i, target in gs.release(2.0)] == [("shared", "i1")]


def test_held_choices_whose_prefix_is_cached_after_they_were_held_take_only_what_each_lacks():
    gs = scheduler(2)
    gs.report(load("i0", used=60, running=4), 0.0)
    gs.report(load("i1", used=95, running=4), 0.0)
    assert gs.dispatch(req("big", 80), 1.0) is None
    assert gs.dispatch(req("shared", 40, block_hashes=PROMPT_ANCHORS, count=2), 1.0) is None
    # i1 frees 20 blocks and caches the prompt's first 32: each copy lacks 8, (25 - 16) / 6 = 1.5 with both.
    gs.report(load("i1", used=75, running=4), 2.0, CACHED)
    assert [(i.request_id, target) for i, target in gs.release(2.0)] == [("shared", "i1")]


def test_floors_follow_what_an_anchor_takes_when_the_instances_change():
    gs = scheduler(1)
    gs.report(load("i0", used=95, running=4), 0.0)
    assert gs.dispatch(req("big", 90), 1.0) is None
    assert gs.dispatch(req("r", 40, block_hashes=(1, 2, 3)), 1.0) is None  # cached nowhere: 640 tokens
    # Instances of 256-token blocks join (an anchor is one block there: 256 tokens, 128 on i0) and
    # cache the prompt's first two anchors: "r" lacks one block there, and the one not kept for
    # "big" has room for it (6 free blocks, 4 requests running).
    for name in ("i1", "i2"):
        gs.register_instance(name, BLOCKS, 256, 2.0)
        gs.mark_ready(name, 2.0)
        gs.report(InstanceLoad(name, BLOCKS, 256, 6, 4, 0, running_blocks={Priority.NORMAL: 94},
                               running_count={Priority.NORMAL: 4}), 2.0, PrefixEvents(stored=(1, 2)))
    assert [i.request_id for i, _ in gs.release(3.0)] == ["r"]


def test_a_resubmitted_request_is_never_held():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=5), 0.0)
    assert gs.dispatch(req("r", 5, admitted=True), 1.0) == "i0"


def test_held_requests_leave_in_arrival_order():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=4), 0.0)
    for name in "abc":
        assert gs.dispatch(req(name, 2), 1.0) is None
    gs.report(load("i0", used=10, running=1), 2.0)  # room for all three
    assert [i.request_id for i, _ in gs.release(2.0)] == ["a", "b", "c"]


def test_the_queue_puts_a_higher_priority_first():
    held = HeldRequests()
    assert held.would_lead(req("n", 2))  # nothing held
    for name, priority in (("a", Priority.NORMAL), ("b", Priority.NORMAL)):
        held.add(req(name, 2, priority), 0.0)
    assert held.would_lead(req("h", 2, Priority.HIGH)) and not held.would_lead(req("n", 2))
    held.add(req("h", 2, Priority.HIGH), 0.0)
    assert [h.info.request_id for h in held] == ["h", "a", "b"]
    assert not held.would_lead(req("h2", 2, Priority.HIGH))  # an equal priority that came later


def test_a_later_request_passes_the_first_only_on_another_instance():
    gs = scheduler(2)
    gs.report(load("i0", used=60, running=2), 0.0)  # closest to fitting the large one
    gs.report(load("i1", used=80, running=2), 0.0)
    assert gs.dispatch(req("large", 50), 1.0) is None  # fits nowhere
    # A small one would fit on both; i0 is kept for "large", so it goes to i1.
    assert gs.dispatch(req("small", 5), 1.0) == "i1"
    gs.report(load("i1", used=97, running=3, received=1), 2.0)
    # Another small one fits only on i0: it waits rather than delay "large".
    assert gs.dispatch(req("small2", 5), 2.0) is None
    assert [h.info.request_id for h in gs.held] == ["large", "small2"]
    gs.report(load("i0", used=20, running=1), 3.0)  # room for both on i0, the first first
    assert [(i.request_id, t) for i, t in gs.release(3.0)] == [("large", "i0"), ("small2", "i0")]


def large_held_beside_a_shrinking_instance(small: str) -> GlobalScheduler:
    """i0 closest to fitting "large" and filling, i1 full: "large" is held, and as the room it
    would wait for on i0 is shrinking, `small`, which fits only on i0, goes there all the same."""
    gs = scheduler(2)
    gs.report(load("i0", used=55, running=2), 0.0)
    gs.report(load("i0", used=60, running=2), 0.5)
    gs.report(load("i1", used=97, running=3), 0.5)
    assert gs.dispatch(req("large", 50), 1.0) is None
    assert gs.dispatch(req(small, 5), 1.0) == "i0"
    return gs


def test_no_instance_is_kept_for_a_held_request_while_its_room_shrinks():
    gs = large_held_beside_a_shrinking_instance("small")
    gs.report(load("i0", used=50, running=2, received=1), 2.0)  # a request finished: growing again
    assert gs.dispatch(req("small2", 5), 2.0) is None  # i0 is kept for "large" now
    assert [h.info.request_id for h in gs.held] == ["large", "small2"]


def test_a_loss_of_room_passes_and_the_prompts_placed_there_are_no_loss():
    gs = large_held_beside_a_shrinking_instance("small")
    # Seconds later: the loss is long past, and the prompt that arrived took the only room lost.
    gs.report(load("i0", used=65, running=3, received=1), 5.0)
    assert gs.dispatch(req("small2", 5), 5.0) is None  # i0 is kept for "large" again
    # Nothing changes for long: the old loss stays past (no leftover of it counts).
    for t in range(6, 200):
        gs.report(load("i0", used=65, running=3, received=1), float(t))
    assert gs.dispatch(req("small3", 5), 200.0) is None
    assert [h.info.request_id for h in gs.held] == ["large", "small2", "small3"]


def test_a_loss_is_read_when_deciding_and_a_prompt_whose_blocks_come_later_is_none():
    gs = large_held_beside_a_shrinking_instance("small")
    # No report from i0 since its loss at 0.5 (engines send none while nothing changes): by 4.0
    # it is past, and i0 is kept for "large".
    assert gs.dispatch(req("small2", 5), 4.0) is None
    gs.report(load("i0", used=60, running=2, received=1), 5.0)  # "small" arrives, queued
    gs.report(load("i0", used=65, running=3, received=1), 5.5)  # and takes its blocks
    assert gs.dispatch(req("small3", 5), 5.5) is None
    assert [h.info.request_id for h in gs.held] == ["large", "small2", "small3"]


def test_a_prompt_never_received_is_no_credit_to_the_room_it_was_placed_in():
    gs = large_held_beside_a_shrinking_instance("lost")  # it never reaches i0
    gs.report(load("i0", used=60, running=2), 20.0)
    # It expires from i0's pending requests as i0 loses a block: a loss, not a gain of 4.
    gs.report(load("i0", used=61, running=2), 1.0 + PENDING_EXPIRY + 1)
    assert gs.dispatch(req("small", 5), 1.0 + PENDING_EXPIRY + 1) == "i0"


def test_small_requests_do_not_take_the_room_a_large_one_waits_for_while_it_grows():
    gs = scheduler(2)
    gs.report(load("i0", used=60, running=2), 0.0)
    gs.report(load("i1", used=60, running=2), 0.0)
    assert gs.dispatch(req("large", 50), 0.0) is None
    received = 0
    for t in range(1, 20):  # i1 keeps finishing work and taking small requests; i0 drains
        received += 1
        gs.report(load("i1", used=60, running=2, received=received - 1), float(t))
        assert gs.dispatch(req(f"s{t}", 5), float(t)) == "i1"
        gs.report(load("i0", used=60 - 3 * t, running=2), float(t))
        placed = gs.release(float(t))
        if placed:
            assert [(i.request_id, target) for i, target in placed] == [("large", "i0")]
            break
    assert not gs.held


def test_choices_placed_together_are_held_and_placed_together():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=1), 0.0)
    assert gs.dispatch(req("n3", 2, count=3), 1.0) is None
    gs.report(load("i0", used=10, running=1), 2.0)
    assert [(i.request_id, t) for i, t in gs.release(2.0)] == [("n3", "i0")]
    assert gs.instances()[0].num_pending == 3


def test_choices_placed_together_wait_for_room_for_every_copy():
    """Each copy is a request with its own prompt's blocks (as vLLM runs them): room for one is no room for four."""
    single = scheduler(1)
    single.report(load("i0", used=80, running=2), 0.0)
    assert single.dispatch(req("n1", 5), 1.0) == "i0"  # one copy keeps (100 - 80 - 5) / 3 = 5 blocks per request
    gs = scheduler(1)
    gs.report(load("i0", used=80, running=2), 0.0)
    assert gs.dispatch(req("n4", 5, count=4), 1.0) is None  # four keep (100 - 80 - 20) / 6 = 0
    gs.report(load("i0", used=75, running=2), 2.0)
    assert gs.release(2.0) == []  # (100 - 75 - 20) / 6 = 0.8
    gs.report(load("i0", used=70, running=2), 3.0)
    assert [(i.request_id, t) for i, t in gs.release(3.0)] == [("n4", "i0")]  # 10 / 6 = 1.7
    assert gs.instances()[0].num_pending == 4


def test_choices_placed_together_go_where_all_of_them_keep_room():
    gs = scheduler(2)
    gs.report(load("i0", used=76, running=1), 0.0)  # one copy of 5 blocks: (24 - 5) / 2 = 9.5; four: 4 / 5 = 0.8
    gs.report(load("i1", used=40, running=9), 0.0)  # one: 55 / 10 = 5.5; four: 40 / 13 = 3.1
    assert gs.dispatch(req("n4", 5, count=4), 1.0) == "i1"


def test_a_withdrawn_request_is_never_placed():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=4), 0.0)
    assert gs.dispatch(req("gone", 2), 1.0) is None
    assert gs.withdraw("gone") and not gs.withdraw("gone") and not gs.withdraw("never")
    gs.report(load("i0", used=10, running=1), 2.0)
    assert gs.release(2.0) == []


def test_a_request_cannot_be_held_twice():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=4), 0.0)
    assert gs.dispatch(req("r", 2), 1.0) is None
    with pytest.raises(ValueError, match="held already"):
        gs.dispatch(req("r", 2), 1.0)
    # Nor placed while held under the same id, even where it would fit at once.
    gs = scheduler(2)
    gs.report(load("i0", used=80, running=4), 0.0)
    gs.report(load("i1", used=50, running=4), 0.0)
    assert gs.dispatch(req("a", 60), 1.0) is None  # i1 kept for it
    assert gs.dispatch(req("b", 2), 1.0) == "i0"
    with pytest.raises(ValueError, match="held already"):
        gs.dispatch(req("a", 2), 1.0)
    assert [h.info.request_id for h in gs.held] == ["a"]


def test_held_requests_wait_while_no_instance_is_ready_then_go_to_one_that_joins():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=4), 0.0)
    assert gs.dispatch(req("r", 2), 1.0) is None
    gs.set_terminating("i0", 2.0)
    assert gs.release(2.0) == []  # no candidate: still held
    gs.register_instance("i1", BLOCKS, BLOCK_SIZE, 3.0)
    gs.mark_ready("i1", 3.0)
    assert [(i.request_id, t) for i, t in gs.release(3.0)] == [("r", "i1")]


def test_the_queue_finds_the_requests_whose_floor_fits_in_leaving_order_and_lowers_them_as_keys_are_cached():
    held = HeldRequests()
    assert list(held.within(float("inf"))) == [] and held.oldest(5.0) == 0.0
    for name, floor, watch, step, at in (("a", 9, (), 0, 0.0), ("b", 30, (7, 8), 10, 1.0), ("c", 50, (8, 7, 8), 5, 2.0),
                                         ("d", 3, (), 0, 3.0)):
        held.add(req(name, 10), at, floor, watch, step)
    assert held.oldest(5.0) == 5.0 and held.first.info.request_id == "a"

    def within(tokens: float) -> list[str]:
        return [h.info.request_id for h in held.within(tokens)]

    assert within(2) == [] and within(9) == ["a", "d"] and within(30) == ["a", "b", "d"]
    assert within(float("inf")) == ["a", "b", "c", "d"]
    # A key cached lowers each floor watching it to what is left past it (a repeated key: its last place).
    held.cached([8, 99])
    assert within(10) == ["a", "b", "d"] and within(35) == ["a", "b", "c", "d"] and within(34) == ["a", "b", "d"]
    held.cached([7])  # before 8 in b's prompt: b keeps the lower floor
    assert within(10) == ["a", "b", "d"] and within(9) == ["a", "d"]
    held.refloor("b", 1, (9,), 1)
    assert within(1) == ["b"]
    held.cached([9])
    assert within(0) == ["b"] and within(-1) == []
    assert held.remove("c").info.request_id == "c" and held.remove("c") is None
    held.cached([8])  # nobody watches it now
    assert within(float("inf")) == ["a", "b", "d"]
    # Unbounded by default: always among those that might fit.
    held.add(req("e", 10), 6.0)
    assert within(-1.0) == ["e"]
    # Many fitting: looked at in the queue's order, lazily.
    for k in range(40):
        held.add(req(f"m{k}", 10), 7.0, 0)
    found = held.within(0)
    assert [next(found).info.request_id for _ in range(3)] == ["b", "e", "m0"]


def test_hold_freeness_is_on_by_default_and_must_not_be_negative():
    assert load_config().dispatch.hold_freeness == 1.0
    assert load_config({"dispatch": {"hold-freeness": None}}).dispatch.hold_freeness is None
    with pytest.raises(ConfigError, match="hold-freeness"):
        load_config({"dispatch": {"hold-freeness": -1}})


def test_scaling_counts_held_requests_as_demand():
    config = LlumdaskConfig(dispatch=DispatchConfig(hold_freeness=1.0),
                            scaling=ScalingConfig(enabled=True, band=(10.0, 60.0), scale_out_period=5.0,
                                                  scale_in_period=30.0, min_instances=1, max_instances=4))
    gs = GlobalScheduler(config)
    gs.register_instance("i0", BLOCKS, BLOCK_SIZE, 0.0)
    gs.mark_ready("i0", 0.0)
    gs.report(load("i0", used=95, running=4), 0.0)
    before = gs.pooled_load()
    for k in range(3):
        assert gs.dispatch(req(f"r{k}", 10, count=2 if k == 0 else 1), 0.0) is None
    after = gs.pooled_load()
    assert after.surplus == before.surplus - 40 and after.requests == before.requests + 4
    assert gs.scale(0.0).add == 0 and gs.scale(5.0).add >= 1  # below the band for a period: out


def test_high_priority_requests_and_ones_no_instance_could_ever_take_are_not_held():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=4), 0.0)
    assert gs.dispatch(req("high", 2, Priority.HIGH), 1.0) == "i0"  # its headroom is its room
    assert gs.dispatch(req("huge", BLOCKS), 1.0) == "i0"  # even an empty instance keeps no block to spare
    assert gs.dispatch(req("fits-later", BLOCKS - 2), 1.0) is None
    assert gs.dispatch(req("four", 25, count=4), 1.0) == "i0"  # four copies fill an empty instance
    assert gs.dispatch(req("thirds", 33, count=3), 1.0) == "i0"  # three keep 1 / 3 there
    assert gs.dispatch(req("three", 30, count=3), 1.0) is None  # three keep (100 - 90) / 3 there


def test_a_held_request_that_only_a_departed_instance_could_take_goes_at_once_instead_of_waiting_forever():
    gs = scheduler(1)  # i0: 100 blocks
    gs.register_instance("big", 2 * BLOCKS, BLOCK_SIZE, 0.0)
    gs.mark_ready("big", 0.0)
    gs.report(load("i0", used=10, running=1), 0.0)
    gs.report(InstanceLoad("big", 2 * BLOCKS, BLOCK_SIZE, 2 * BLOCKS - 190, 5, 0, running_blocks={Priority.NORMAL: 190},
                           running_count={Priority.NORMAL: 5}), 0.0)
    assert gs.dispatch(req("large", 150), 1.0) is None  # only "big" could ever keep room for it
    assert gs.release(2.0) == []
    gs.remove_instance("big")
    assert [(i.request_id, t) for i, t in gs.release(3.0)] == [("large", "i0")]  # where a new one would go
    assert not gs.held


def test_a_placement_never_handed_over_is_forgotten_and_later_ones_are_counted_as_received():
    gs = scheduler(1)
    gs.report(load("i0", used=99, running=1), 0.0)
    assert gs.dispatch(req("abandoned", 2, count=2), 1.0) is None
    gs.report(load("i0", used=80, running=1), 2.0)
    assert [i.request_id for i, _ in gs.release(2.0)] == ["abandoned"]  # its requester gave up meanwhile
    # Two pending for it: with a 10-block prompt, (20 - 4 - 10) / 4 = 1.5.
    assert gs.dispatch(req("next", 10), 2.5) == "i0" and gs.instances()[0].num_pending == 3
    assert gs.dispatch(req("held", 5), 2.5) is None  # (20 - 14 - 5) / 5 = 0.2
    assert gs.unplace("abandoned", "i0", 2, 2.6) and not gs.unplace("abandoned", "nowhere", 2, 2.6)
    assert gs.instances()[0].num_pending == 1
    assert [i.request_id for i, _ in gs.release(2.6)] == ["held"]  # (20 - 10 - 5) / 3 = 1.7
    gs.report(load("i0", used=100, running=3, received=2), 3.0)  # "next" and "held", the first two it received
    assert gs.instances()[0].num_pending == 0


def test_a_placement_taken_for_received_before_it_was_forgotten_leaves_the_count_right():
    """A later request arrived first and the count took the abandoned one's entry for received:
    forgetting it still moves every later entry up by its copies."""
    gs = scheduler(1)
    gs.report(load("i0", used=10, running=1), 0.0)
    assert gs.dispatch(req("abandoned", 2, count=2), 1.0) == "i0"  # positions 0 and 1
    assert gs.dispatch(req("a", 2), 1.0) == "i0" and gs.dispatch(req("b", 2), 1.0) == "i0"  # 2 and 3
    gs.report(load("i0", used=12, running=2, received=1), 2.0)  # "a" arrived: position 0 taken as received
    assert gs.instances()[0].num_pending == 3
    gs.unplace("abandoned", "i0", 2, 2.5)
    assert gs.instances()[0].num_pending == 1  # "b": "a", now position 0, was received
    gs.report(load("i0", used=14, running=3, received=2), 3.0)
    assert gs.instances()[0].num_pending == 0


def test_a_request_dispatched_but_never_received_stops_counting_after_a_while():
    """Refused by the instance, or its requester died on the way: without expiry its demand would
    stay pending there, and holding would keep every later request off an empty instance."""
    gs = scheduler(1)
    gs.report(load("i0", used=0, running=0), 0.0)
    assert gs.dispatch(req("lost", 90), 0.0) == "i0"
    gs.report(load("i0", used=0, running=0), 1.0)  # never received
    assert gs.dispatch(req("next", 20), 1.0) is None  # the lost one's 90 blocks still count
    gs.report(load("i0", used=0, running=0), 1.0 + PENDING_EXPIRY)
    assert [(i.request_id, t) for i, t in gs.release(1.0 + PENDING_EXPIRY)] == [("next", "i0")]


class _Everything(HeldRequests):
    """The held queue without floors: every request is looked at, as before they were kept."""

    def within(self, blocks: float) -> list[Held]:
        return list(self)


_ANCHORS = st.lists(st.integers(1, 6), max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(40, 100), st.integers(1, 6), _ANCHORS, _ANCHORS),
    st.tuples(st.just("dispatch"), st.integers(1, 60), _ANCHORS, st.integers(1, 3)),
    st.tuples(st.just("leave"), st.integers(0, 2)),
), max_size=30), st.sampled_from([0.0, 1.0, 2.5]), st.sampled_from([BLOCK_SIZE, 2 * BLOCK_SIZE]), st.booleans())
def test_floors_turn_away_only_requests_a_full_look_would_not_place(steps, hold, third_block_size, prefix_aware):
    """Placements with the floors are those of looking at every held request after every report,
    at any hold-freeness, with mixed block sizes, as instances leave, prefix-aware or not, with
    choices placed together."""
    sizes = (BLOCK_SIZE, BLOCK_SIZE, third_block_size)

    def run(queue: type[HeldRequests]) -> list:
        gs = GlobalScheduler(LlumdaskConfig(dispatch=DispatchConfig(
            interference_freeness=None, hold_freeness=hold, prefix_aware=prefix_aware)))
        for k, size in enumerate(sizes):
            gs.register_instance(f"i{k}", BLOCKS, size, 0.0)
            gs.mark_ready(f"i{k}", 0.0)
        gs._held = queue()
        out = []
        for k, step in enumerate(steps):
            if step[0] == "report":
                _, i, used, running, stored, removed = step
                if f"i{i}" in gs.members()[0]:
                    gs.report(InstanceLoad(f"i{i}", BLOCKS, sizes[i], BLOCKS - used, running, 0,
                                           running_blocks={Priority.NORMAL: used}, running_count={Priority.NORMAL: running}),
                              float(k), PrefixEvents(stored, removed))
            elif step[0] == "leave":
                if f"i{step[1]}" in gs.members()[0] and len(gs.members()[0]) > 1:
                    gs.remove_instance(f"i{step[1]}")
            else:
                _, blocks, anchors, count = step
                out.append(gs.dispatch(req(f"r{k}", blocks, block_hashes=anchors, count=count), float(k)))
            out.append([(info.request_id, target) for info, target in gs.release(float(k))])
        return out

    assert run(HeldRequests) == run(_Everything)
