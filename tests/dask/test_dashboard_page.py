"""The dashboard page's data: instance rows and migration events as the plots and table show them."""

from __future__ import annotations

import math

from bokeh.document import Document
from bokeh.models import ColumnDataSource, DataTable, Div

from llumdask.plugins.dashboard import STATE_COLORS, build_document, instance_columns, migration_columns, summary_html


def row(instance: str, state: str = "normal", free: int = 60, freeness: float = 30.0, **counts) -> dict:
    return {"instance": instance, "state": state, "ready": state != "starting", "freeness": freeness,
            "total_blocks": 100, "free_blocks": free, "num_running": counts.get("running", 2),
            "num_waiting": counts.get("waiting", 1), "num_pending": counts.get("pending", 0)}


def event(kind: str, t: float, request_id: str = "r1", downtime: float = 0.012) -> dict:
    return {"kind": kind, "time": t, "request_id": request_id, "source": "a", "destination": "b", "stages": 3,
            "blocks": 40, "downtime": downtime, "reason": "" if kind == "committed" else "destination refused"}


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
