"""An instance's room trend (llumdask/room.py): losses of free blocks, less the received prompts'
blocks as they are taken, decayed over ROOM_TREND_SECONDS."""

from __future__ import annotations

from llumdask.room import ARRIVAL_CREDIT_SECONDS, RoomTrend


def trend_after(*reports: tuple[float, int]) -> RoomTrend:
    """A trend fed (time, change of free blocks) reports, the first a baseline."""
    trend = RoomTrend()
    for at, change in reports:
        trend.observe(change, at)
    return trend


def test_a_loss_is_shrinking_until_it_decays_and_a_gain_never_is():
    trend = trend_after((0.0, 0), (1.0, -10))
    assert trend.shrinking(1.0)
    # No report since (an engine may send none while nothing changes): read at the decision's time.
    assert not trend.shrinking(1.0 + 4.0)  # 10 * exp(-4) < half a block
    assert not trend_after((0.0, 0), (1.0, 10)).shrinking(1.0)
    assert not RoomTrend().shrinking(0.0)  # nothing reported yet


def test_a_received_prompt_is_no_loss_however_late_its_blocks_are_taken():
    trend = trend_after((0.0, 0))
    trend.received(40, 0.5)
    for t in range(1, 5):  # prefilled in four chunks, or queued, then admitted
        trend.observe(-10, 0.5 + t)
        assert not trend.shrinking(0.5 + t)
    trend.observe(-3, 5.0)  # the prompt's credit is used up: its sequence growing is a loss
    assert trend.shrinking(5.0)


def test_credit_is_no_gain_and_what_is_never_taken_expires():
    trend = trend_after((0.0, 0))
    trend.received(40, 0.0)  # its prefix was cached: it takes 4 of its 40 blocks
    trend.observe(-4, 0.5)
    trend.observe(0, 1.0)
    assert not trend.shrinking(1.0)
    trend.observe(-2, 2.0)  # growth hidden by the credit left...
    assert not trend.shrinking(2.0)
    later = 0.1 + ARRIVAL_CREDIT_SECONDS
    trend.observe(-2, later)  # ...only until it expires
    assert trend.shrinking(later)


def test_a_gain_beside_a_received_prompt_keeps_its_credit():
    trend = trend_after((0.0, 0))
    trend.received(20, 0.1)
    trend.observe(+30, 0.2)  # a request finished before the prompt took its blocks
    trend.observe(-20, 0.3)
    assert not trend.shrinking(0.3)
