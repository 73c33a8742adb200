"""When a request refused for load should come back: the departure rate and the retry slots."""

from __future__ import annotations

import pytest

from llumdask.admission import LONGEST_WAIT, DepartureRate, RetryQueue, departures
from llumdask.load import InstanceLoad


def report(received: int, running: int, waiting: int = 0) -> InstanceLoad:
    return InstanceLoad("i0", 100, 16, 100, running, waiting, num_received=received)


def test_departures_are_requests_received_less_the_growth_of_those_held():
    assert departures(report(10, 4, 2), report(13, 5, 1)) == 3  # 3 came, 6 -> 6 held: 3 left
    assert departures(report(10, 4), report(10, 2)) == 2  # 2 finished
    # A migration leaves the source and joins the destination without being received: it cancels out.
    assert departures(report(10, 4), report(10, 3)) + departures(report(7, 2), report(7, 3)) == 0


def test_the_rate_follows_a_steady_pace_and_decays_once_nothing_leaves():
    rate = DepartureRate(window=10.0)
    assert rate.per_second(0.0) == 0.0
    for step in range(1, 1201):  # 2 departures a second, reported every 0.05 s for 60 s
        rate.add(1 if step % 10 == 0 else 0, step * 0.05)
    assert rate.per_second(60.0) == pytest.approx(2.0, rel=0.05)
    assert rate.per_second(70.0) == pytest.approx(2.0 / 2.718, rel=0.1)  # one window later, nothing left
    early = DepartureRate(window=10.0)
    early.add(0, 0.0)
    early.add(1, 0.05)  # one departure right after the first report is not 20 a second
    assert early.per_second(0.05) < 1.1  # counted over a second at least
    early.add(-3, 0.1)  # more came back than left (a destination reporting before its source)
    assert early.per_second(0.1) == 0.0
    with pytest.raises(ValueError, match="window"):
        DepartureRate(window=0.0)


def test_a_burst_of_refusals_is_spread_at_the_departure_pace():
    queue = RetryQueue()
    assert queue.slot(0.0, 0.0) is None  # no pace known yet
    waits = [queue.slot(0.0, 2.0) for _ in range(4)]
    assert waits == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert queue.slot(1.0, 2.0) == pytest.approx(1.5)  # behind the burst, a second later
    assert queue.slot(10.0, 2.0) == pytest.approx(0.5)  # the burst's slots have passed
    assert max(queue.slot(10.0, 0.01) for _ in range(3)) == LONGEST_WAIT
