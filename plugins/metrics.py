"""The scheduler's ``llumdask_`` series, on the Dask scheduler's own ``/metrics``.

Dask serves ``prometheus_client``'s process-wide registry there, so the scheduler plugin adds
one collector to it for as long as the plugin runs: counts the plugin bumps as dispatches,
migration events and scaling actions happen, and per-instance gauges read from the global
scheduler's table when Prometheus scrapes (no work between scrapes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llumdask.global_scheduler import InstanceView
from llumdask.llumlet import MigrationEventKind

# Live migration downtime is milliseconds when all is well; the upper buckets catch stalls.
DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

INSTANCE_GAUGES: tuple[tuple[str, str, Callable[[InstanceView], float]], ...] = (
    ("freeness", "Migration freeness (free blocks per running request; -Inf while draining)", lambda v: v.freeness),
    ("dispatch_freeness", "Dispatch freeness (the queue and pending requests counted)", lambda v: v.dispatch_freeness),
    ("total_blocks", "KV blocks of the instance", lambda v: v.load.total_blocks),
    ("used_blocks", "KV blocks held by running requests or reserved for incoming migrations",
     lambda v: v.load.used_blocks),
    ("virtual_blocks", "Virtual usage: used blocks plus queued demand and priority headroom (Inf while draining)",
     lambda v: v.virtual_blocks),
    ("running", "Running requests", lambda v: v.load.num_running),
    ("pinned", "Running requests that never migrate (their sampling options cannot move exactly)",
     lambda v: v.load.num_pinned),
    ("waiting", "Queued requests", lambda v: v.load.num_waiting),
)


# The outcome of a committed migration of a waiting request: counted apart from live migrations,
# whose downtime it would dilute.
HANDED_OVER = "handed_over"

# (name, help, label, the SchedulerMetrics count it reads)
COUNTERS = (
    ("dispatches", "Dispatch decisions, by outcome (placed, held for room before being placed, refused, or "
                   "withdrawn: held and given up on by its requester, whether placed since or not)",
     "outcome", "dispatches"),
    ("migrations", "Migrations started, committed (running requests, their KV moved live), handed over "
                   "(waiting requests, nothing to move) and aborted", "outcome", "migrations"),
    ("migrations_aborted", "Aborted live migrations, by reason", "reason", "aborted"),
    ("migrations_refused", "Operator migrations refused, by reason (pinned: the request's sampling options "
                           "cannot move exactly; not_started: any other)", "reason", "refused"),
    ("scaling_events", "Scaling actions (terminate, resume, add, remove)", "action", "scaling"),
)


class SchedulerMetrics:
    """The scheduler plugin's counts, kept once: its status, the dashboard's history and /metrics
    all read them here. `install` puts them on the process's /metrics."""

    def __init__(self, instances: Callable[[], Iterable[InstanceView]], held: Callable[[], int] = lambda: 0) -> None:
        self._instances = instances
        self._held = held
        self.dispatches: Counter[str] = Counter()  # by outcome: placed, held, refused, withdrawn
        self.migrations: Counter[str] = Counter()  # started, committed, handed_over, aborted
        self.aborted: Counter[str] = Counter()  # by reason
        self.refused: Counter[str] = Counter()  # operator migrations, by reason: pinned, not_started
        self.scaling: Counter[str] = Counter()  # by action: terminate, resume, add, remove
        self.migration_bytes = 0
        self.downtime = 0.0  # seconds, summed over committed migrations
        # The downtime histogram's buckets are the one thing the counts above cannot give.
        self._registry = CollectorRegistry(auto_describe=True)
        self._downtime = Histogram("llumdask_migration_downtime_seconds",
                                   "Committed migrations' downtime: the request paused to resumed on its destination",
                                   buckets=DOWNTIME_BUCKETS, registry=self._registry)
        self._installed = False

    def on_migration_event(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("kind"))
        if kind == MigrationEventKind.COMMITTED.value and event.get("waiting"):
            self.migrations[HANDED_OVER] += 1
            return
        self.migrations[kind] += 1
        if kind == MigrationEventKind.COMMITTED.value:
            self.migration_bytes += int(event.get("bytes", 0))
            self.downtime += float(event.get("downtime", 0.0))
            self._downtime.observe(float(event.get("downtime", 0.0)))
        elif kind == MigrationEventKind.ABORTED.value:
            self.aborted[str(event.get("reason", ""))] += 1

    # ------------------------------------------------------------------ prometheus_client collector
    def describe(self) -> list[Metric]:
        """Nothing to declare up front: the names are fixed, the instance labels come and go."""
        return []

    def collect(self) -> Iterator[Metric]:
        for name, text, label, counts in COUNTERS:
            family = CounterMetricFamily(f"llumdask_{name}", text, labels=[label])
            for value, count in getattr(self, counts).items():
                family.add_metric([value], count)
            yield family
        yield CounterMetricFamily("llumdask_migration_bytes", "KV bytes moved by committed migrations",
                                  value=self.migration_bytes)
        yield from self._registry.collect()
        yield GaugeMetricFamily("llumdask_held_requests", "Requests held at the scheduler for an instance with room",
                                value=self._held())
        views = list(self._instances())
        for name, text, value in INSTANCE_GAUGES:
            family = GaugeMetricFamily(f"llumdask_instance_{name}", text, labels=["instance"])
            for view in views:
                family.add_metric([view.instance_id], float(value(view)))
            yield family

    def install(self) -> None:
        """Serve the series on the process's /metrics (Dask's scheduler route reads this registry)."""
        if not self._installed:
            prometheus_client.REGISTRY.register(self)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            prometheus_client.REGISTRY.unregister(self)
            self._installed = False
