"""The scheduler's migration counts: a waiting request handed over is no live migration."""

from __future__ import annotations

from llumdask.plugins.metrics import HANDED_OVER, SchedulerMetrics


def test_a_handed_over_waiting_request_is_counted_apart_and_adds_no_downtime():
    metrics = SchedulerMetrics(lambda: [])
    metrics.on_migration_event({"kind": "started", "waiting": False})
    metrics.on_migration_event({"kind": "committed", "bytes": 4096, "downtime": 0.008, "waiting": False})
    metrics.on_migration_event({"kind": "started", "waiting": True})
    metrics.on_migration_event({"kind": "committed", "bytes": 0, "downtime": 0.0, "waiting": True})
    assert metrics.migrations == {"started": 2, "committed": 1, HANDED_OVER: 1}
    assert metrics.downtime == 0.008 and metrics.migration_bytes == 4096
    families = {f.name: f for f in metrics.collect()}
    outcomes = {s.labels["outcome"]: s.value for s in families["llumdask_migrations"].samples}
    assert outcomes == {"started": 2, "committed": 1, HANDED_OVER: 1}


def test_the_held_requests_are_a_gauge_read_when_scraped():
    held = [3]
    metrics = SchedulerMetrics(lambda: [], lambda: held[0])
    read = lambda: {f.name: f for f in metrics.collect()}["llumdask_held_requests"].samples[0].value  # noqa: E731
    assert read() == 3
    held[0] = 0
    assert read() == 0
