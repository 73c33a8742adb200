"""The scheduler's ``llumdask_`` series, on the Dask scheduler's own ``/metrics``.

Dask serves ``prometheus_client``'s process-wide registry there, so the scheduler plugin adds
one collector to it for as long as the plugin runs: counters the plugin bumps as dispatches,
migration events and scaling actions happen, and per-instance gauges read from the global
scheduler's table when Prometheus scrapes (no work between scrapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from llumdask.global_scheduler import InstanceView

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
    ("waiting", "Queued requests", lambda v: v.load.num_waiting),
)


class SchedulerMetrics:
    """What the scheduler plugin counts; `install` puts it on the process's /metrics."""

    def __init__(self, instances: Callable[[], Iterable[InstanceView]]) -> None:
        self._instances = instances
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.dispatches = Counter("llumdask_dispatches", "Dispatch decisions, by outcome (placed or refused)",
                                  ["outcome"], registry=r)
        self.migrations = Counter("llumdask_migrations", "Live migrations started, committed and aborted",
                                  ["outcome"], registry=r)
        self.aborted = Counter("llumdask_migrations_aborted", "Aborted live migrations, by reason", ["reason"], registry=r)
        self.migration_bytes = Counter("llumdask_migration_bytes", "KV bytes moved by committed migrations", registry=r)
        self.downtime = Histogram("llumdask_migration_downtime_seconds",
                                  "Committed migrations' downtime: the request paused to resumed on its destination",
                                  buckets=DOWNTIME_BUCKETS, registry=r)
        self.scaling = Counter("llumdask_scaling_events", "Scaling actions (terminate, add, remove)", ["action"], registry=r)
        self._installed = False

    def on_migration_event(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("kind"))
        self.migrations.labels(kind).inc()
        if kind == "committed":
            self.migration_bytes.inc(float(event.get("bytes", 0)))
            self.downtime.observe(float(event.get("downtime", 0.0)))
        elif kind == "aborted":
            self.aborted.labels(str(event.get("reason", ""))).inc()

    # ------------------------------------------------------------------ prometheus_client collector
    def describe(self) -> list[Metric]:
        """Nothing to declare up front: the names are fixed, the instance labels come and go."""
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
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
