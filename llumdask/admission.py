"""When a request refused for load (`dispatch.admission-freeness`) should come back.

A fixed Retry-After sends every refused client back at the same moment: the queue the cluster
refused rebuilds on the clients' side, each request is sent again and again, and the first to
return after room appears is served by luck. The scheduler knows how fast requests leave the
cluster (from its instances' reports), so it gives each refusal the next slot of a virtual queue
drained at that pace: a burst of refused clients is told to come back one after another, each
about when an instance will have let enough requests go to take it. The slots only advise: a
request that arrives when there is room is admitted whatever the slots say.
"""

from __future__ import annotations

import math

from llumdask.load import InstanceLoad

# Departures are averaged over about this many seconds: several at the rates where admission
# matters (a request a second or more), and short enough to follow a change of load.
DEPARTURE_WINDOW = 10.0
# No client is told to wait longer than this: an estimate further ahead is not worth trusting.
LONGEST_WAIT = 60.0


class DepartureRate:
    """Requests leaving the cluster per second: an exponentially weighted average over about
    `window` seconds, O(1) per report. A departure is a request that finished or was aborted;
    a migration leaves one instance and joins another, so it cancels out over the two reports."""

    def __init__(self, window: float = DEPARTURE_WINDOW) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 s, got {window!r}")
        self._window = window
        self._weight = 0.0  # departures, each decayed by exp(-age / window)
        self._at: float | None = None
        self._since: float | None = None

    def add(self, departures: int, now: float) -> None:
        """`departures` seen in a report at `now` (negative when requests it counted as gone came
        back, e.g. a migration's destination reported before its source)."""
        if self._at is None:
            self._since = self._at = now
        if not departures:  # most reports: nothing to add, and decay is applied lazily
            return
        if now > self._at:
            self._weight *= math.exp((self._at - now) / self._window)
            self._at = now
        self._weight += departures

    def per_second(self, now: float) -> float:
        """The rate at `now`: the decayed count over the time it covers (0 before any report)."""
        if self._at is None or self._since is None:  # both set by the first report
            return 0.0
        covered = self._window * -math.expm1(-max(now - self._since, self._window / 10) / self._window)
        return max(0.0, self._weight * math.exp(min(0.0, self._at - now) / self._window) / covered)


def departures(previous: InstanceLoad, load: InstanceLoad) -> int:
    """Requests that left an instance between two of its reports: those it received meanwhile,
    less the growth of those it holds (running and waiting)."""
    held = load.num_running + load.num_waiting - previous.num_running - previous.num_waiting
    return load.num_received - previous.num_received - held


class RetryQueue:
    """Slots for refused requests, `1 / rate` seconds apart from now on: in a burst the k-th
    refusal waits about k / rate; refusals spread over time each wait about one gap."""

    def __init__(self, longest: float = LONGEST_WAIT) -> None:
        self._longest = longest
        self._next = -math.inf

    def slot(self, now: float, rate: float) -> float | None:
        """Seconds the next refused request should wait (at most `longest`); None while no rate
        is known (nothing has left the cluster yet)."""
        if not rate > 0:
            return None
        self._next = min(max(self._next, now) + 1.0 / rate, now + self._longest)
        return self._next - now
