"""The last minutes of the cluster, once a second, for the dashboard's time series.

The scheduler plugin records a `Sample` per second (cumulative counters, the pooled freeness the
scaling band acts on, each instance's KV use); the page differences the counters into rates
itself, so a sample costs a few numbers per instance and the page can join at any moment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Ten minutes at one sample a second.
SPAN_SECONDS = 600.0
INTERVAL_SECONDS = 1.0


@dataclass(frozen=True)
class Sample:
    time: float
    pooled_freeness: float
    ready_instances: int
    # Cumulative since the plugin started.
    dispatches: int
    committed: int
    aborted: int
    downtime: float  # seconds, summed over committed migrations
    used_pct: dict[str, float] = field(default_factory=dict)  # per instance: % of its KV blocks in use


class ClusterHistory:
    """A sliding window of samples, one per `interval` at most, `span` seconds long."""

    def __init__(self, span: float = SPAN_SECONDS, interval: float = INTERVAL_SECONDS) -> None:
        if not 0 < interval <= span:
            raise ValueError(f"history needs 0 < interval <= span, got interval {interval}, span {span}")
        self.interval = interval
        self._samples: deque[Sample] = deque(maxlen=int(span / interval) + 1)

    def due(self, now: float) -> bool:
        return not self._samples or now - self._samples[-1].time >= self.interval

    def record(self, sample: Sample) -> None:
        self._samples.append(sample)

    def samples(self, after: float = float("-inf")) -> list[Sample]:
        """Samples newer than `after`, oldest first."""
        return [s for s in self._samples if s.time > after]
