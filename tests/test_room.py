"""An instance's room trend (llumdask/room.py): losses of free blocks, less the received prompts'
blocks as they are taken, decayed over ROOM_TREND_SECONDS."""

from __future__ import annotations

from llumdask.room import ARRIVAL_CREDIT_SECONDS, RoomTrend


def trend_after(*reports: tuple[float, int]) -> RoomTrend:
    """A trend fed (time, free blocks) reports, the first its baseline."""
    trend = RoomTrend()
    for at, free in reports:
        trend.observe(free, at)
    return trend


def test_a_loss_is_shrinking_until_it_decays_and_a_gain_never_is():
    trend = trend_after((0.0, 100), (1.0, 90))
    assert trend.shrinking(1.0)
    # No report since (an engine may send none while nothing changes): read at the decision's time.
    assert not trend.shrinking(1.0 + 4.0)  # 10 * exp(-4) < half a block
    assert not trend_after((0.0, 100), (1.0, 110)).shrinking(1.0)
    assert not trend_after((0.0, 10)).shrinking(0.0)  # a first report is only a baseline
    assert not RoomTrend().shrinking(0.0)


def test_a_received_prompt_is_no_loss_however_late_its_blocks_are_taken():
    trend = trend_after((0.0, 100))
    trend.received(40, 0.5)
    for t in range(1, 5):  # prefilled in four chunks, or queued, then admitted
        trend.observe(100 - 10 * t, 0.5 + t)
        assert not trend.shrinking(0.5 + t)
    trend.observe(57, 5.0)  # the prompt's credit is used up: its sequence growing is a loss
    assert trend.shrinking(5.0)


def test_credit_is_no_gain_and_what_is_never_taken_expires():
    trend = trend_after((0.0, 100))
    trend.received(40, 0.0)  # its prefix was cached: it takes 4 of its 40 blocks
    trend.observe(96, 0.5)
    trend.observe(96, 1.0)
    assert not trend.shrinking(1.0)
    trend.observe(94, 2.0)  # growth hidden by the credit left...
    assert not trend.shrinking(2.0)
    later = 0.1 + ARRIVAL_CREDIT_SECONDS
    trend.observe(92, later)  # ...only until it expires
    assert trend.shrinking(later)


def test_a_gain_beside_a_received_prompt_keeps_its_credit():
    trend = trend_after((0.0, 100))
    trend.received(20, 0.1)
    trend.observe(102, 0.2)  # a request finished before the prompt took its blocks
    trend.observe(82, 0.3)
    assert not trend.shrinking(0.3)


def test_the_oldest_credit_is_used_first():
    trend = trend_after((0.0, 100))
    trend.received(10, 0.0)
    trend.received(10, 5.0)
    trend.observe(90, 6.0)  # the first prompt's blocks: its credit, which would expire first
    trend.observe(80, 12.0)  # the second's, its credit still good
    assert not trend.shrinking(12.0)


def test_prompts_received_before_the_first_report_are_in_its_baseline():
    trend = RoomTrend()
    trend.received(40, 0.0)  # placed on an instance that has not reported yet
    trend.observe(60, 0.1)  # its first report shows the blocks taken
    trend.observe(50, 0.5)  # the running sequences grow: a loss, with no credit left to hide it
    assert trend.shrinking(0.5)
