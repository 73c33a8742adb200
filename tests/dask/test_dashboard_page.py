"""The dashboard page's data: instance rows and migration events as the plots and table show them."""

from __future__ import annotations

import math

from bokeh.document import Document
from bokeh.models import ColumnDataSource, DataTable, Div

from llumdask.plugins.dashboard import (
    STATE_COLORS,
    build_document,
    instance_columns,
    migration_columns,
    series_columns,
    summary_html,
    usage_lines,
)
from llumdask.plugins.history import ClusterHistory, Sample


def row(instance: str, state: str = "normal", free: int = 60, freeness: float = 30.0, **counts) -> dict:
    return {"instance": instance, "state": state, "ready": state != "starting", "freeness": freeness,
            "total_blocks": 100, "free_blocks": free, "num_running": counts.get("running", 2),
            "num_waiting": counts.get("waiting", 1), "num_pending": counts.get("pending", 0)}


def event(kind: str, t: float, request_id: str = "r1", downtime: float = 0.012) -> dict:
    return {"kind": kind, "time": t, "request_id": request_id, "source": "a", "destination": "b", "stages": 3,
            "blocks": 40, "downtime": downtime, "downtime_source": downtime / 6, "downtime_destination": downtime / 4,
            "reason": "" if kind == "committed" else "destination refused"}


def status(rows: list[dict], committed: int = 1, aborted: int = 1, started: int = 3, downtime: float = 0.012) -> dict:
    return {"instances": rows, "migrations": {"committed": committed, "aborted": aborted, "started": started,
                                               "downtime": downtime}}


def test_instance_columns_show_memory_roles_and_queues():
    data = instance_columns([row("a", "source", free=10, freeness=1.5, pending=2), row("b", "terminating", freeness=-math.inf)])
    assert data["instance"] == ["a", "b"] and data["used_pct"] == [90.0, 40.0]
    assert data["color"] == [STATE_COLORS["source"], STATE_COLORS["terminating"]]
    assert data["waiting"] == [3, 1]  # queued on the instance plus dispatched and not yet reported
    assert data["freeness"][1] == -1e6 and all(math.isfinite(f) for f in data["freeness"])


def test_migration_columns_are_newest_first_in_milliseconds():
    data = migration_columns([event("aborted", 100.0, "old", 0.0), event("committed", 200.0, "new")])
    assert data["request_id"] == ["new", "old"] and data["downtime_ms"] == [12.0, 0.0]
    assert data["source_ms"] == [2.0, 0.0] and data["destination_ms"] == [3.0, 0.0]  # the downtime's parts
    assert data["reason"] == ["", "destination refused"]


def test_summary_counts_instances_requests_and_migrations():
    text = summary_html(status([row("a"), row("b", "starting")]))
    assert "<b>1</b> of 2 instances ready" in text and "<b>4</b> running" in text and "<b>2</b> waiting" in text
    assert "<b>1</b> committed, 1 aborted, 1 in flight, mean downtime 12.0 ms" in text


def test_the_document_refreshes_from_the_plugin_state():
    rows = [row("a")]
    events: list[dict] = []
    doc = Document()
    refresh = build_document(doc, lambda: status(rows, committed=len(events)), lambda: events, (2.0, 16.0))
    sources = list(doc.select({"type": ColumnDataSource}))
    rows.append(row("b", "destination"))
    events.append(event("committed", 300.0))
    refresh()
    instances = next(s for s in sources if "instance" in s.data)
    migrations = next(s for s in sources if "request_id" in s.data)
    assert instances.data["instance"] == ["a", "b"] and migrations.data["kind"] == ["committed"]
    assert doc.select_one({"type": DataTable}) is not None
    assert any("<b>1</b> committed" in d.text for d in doc.select({"type": Div}))


def sample(t: float, dispatches: int = 0, committed: int = 0, downtime: float = 0.0, **used: float) -> Sample:
    return Sample(t, pooled_freeness=20.0, ready_instances=len(used), dispatches=dispatches, committed=committed,
                  aborted=0, downtime=downtime, used_pct=dict(used))


def test_history_keeps_one_sample_a_second_for_its_span():
    history = ClusterHistory(span=5, interval=1)
    for t in (0.0, 0.5, 1.0, 1.2, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        if history.due(t):
            history.record(sample(t))
    times = [s.time for s in history.samples()]
    assert times == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # 0.5 and 1.2 came too soon; 0 and 1 slid out
    assert [s.time for s in history.samples(after=5.0)] == [6.0, 7.0]


def test_series_turn_counters_into_rates_and_mean_downtime():
    samples = [sample(10.0), sample(11.0, dispatches=4, committed=2, downtime=0.02), sample(13.0, dispatches=10, committed=2, downtime=0.02)]
    data = series_columns(samples)
    assert data["time"] == [10_000.0, 11_000.0, 13_000.0]
    assert data["dispatch_rate"] == [0.0, 4.0, 3.0] and data["committed_rate"] == [0.0, 2.0, 0.0]
    assert data["downtime_ms"][1] == 10.0 and math.isnan(data["downtime_ms"][2])  # no migration: a gap
    # Rows appended later continue from the last row shown.
    assert series_columns([sample(14.0, dispatches=12)], previous=samples[-1])["dispatch_rate"] == [2.0]


def test_usage_lines_follow_each_instance_in_natural_order():
    samples = [sample(1.0, **{"i-2": 10.0, "i-10": 50.0}), sample(2.0, **{"i-2": 20.0, "i-10": 40.0, "i-3": 5.0})]
    lines = usage_lines(samples)
    assert lines["name"] == ["i-2", "i-3", "i-10"]
    assert lines["ys"] == [[10.0, 20.0], [5.0], [50.0, 40.0]] and lines["xs"][1] == [2000.0]
    assert len(set(lines["color"])) == 3


def test_the_document_streams_the_history():
    history = ClusterHistory()
    doc = Document()
    refresh = build_document(doc, lambda: status([row("a")]), lambda: [], (2.0, 16.0), history.samples, band=(10.0, 60.0))
    series = next(s for s in doc.select({"type": ColumnDataSource}) if "pooled_freeness" in s.data)
    history.record(sample(1.0, a=30.0))
    refresh()
    history.record(sample(2.0, dispatches=5, a=40.0))
    refresh()
    refresh()  # nothing new: nothing appended
    assert series.data["dispatch_rate"] == [0.0, 5.0]
    usage = next(s for s in doc.select({"type": ColumnDataSource}) if "xs" in s.data)
    assert usage.data["ys"] == [[30.0, 40.0]]
