"""The llumdask page of the Dask dashboard (`<dashboard>/llumdask`): every instance's load and every migration.

The page is a Bokeh document served by the scheduler's own dashboard server, fed from the
scheduler plugin's state twice a second: per instance the blocks in use, freeness (with the
pairing thresholds), running and waiting requests and the instance's role this round; then the
last ten minutes (pooled freeness against the scaling band, ready instances, dispatches and
migrations per second, migration downtime, each instance's KV use); below, the latest
migrations. Nothing here talks to workers: the plugin already holds every report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from bokeh.document import Document
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataTable, Div, Span, TableColumn
from bokeh.plotting import figure

from llumdask.load import instance_order
from llumdask.plugins.control import InstanceState
from llumdask.plugins.history import INTERVAL_SECONDS, SPAN_SECONDS, Sample

PAGE = "/llumdask"
MENU_NAME = "Llumdask"
REFRESH_MS = 500
HISTORY_POINTS = int(SPAN_SECONDS / INTERVAL_SECONDS) + 1
# Line colours of the per-instance history (cycled).
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")

# Fill colour of an instance by its role (the scheduler plugin's `_state_of`).
STATE_COLORS = {
    InstanceState.NORMAL: "#4c78a8",
    InstanceState.SOURCE: "#e45756",
    InstanceState.DESTINATION: "#54a24b",
    InstanceState.TERMINATING: "#9d755d",
    InstanceState.STARTING: "#bab0ac",
}

MIGRATION_COLUMNS = (
    ("time", "time"),
    ("kind", "outcome"),
    ("request_id", "request"),
    ("source", "from"),
    ("destination", "to"),
    ("stages", "stages"),
    ("blocks", "blocks"),
    ("downtime_ms", "downtime ms"),
    # The downtime's parts on each side; the rest of it is the transport, both ways.
    ("source_ms", "at source ms"),
    ("destination_ms", "at destination ms"),
    ("reason", "reason"),
)


def instance_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """The instance plots' data: one entry per instance, in the scheduler's order."""
    columns: dict[str, list] = {key: [] for key in (
        "instance", "state", "color", "used_pct", "freeness", "running", "waiting", "used_blocks", "total_blocks")}
    for r in rows:
        total = max(int(r["total_blocks"]), 1)
        used = total - int(r["free_blocks"])
        columns["instance"].append(r["instance"])
        columns["state"].append(r["state"])
        columns["color"].append(STATE_COLORS.get(r["state"], STATE_COLORS[InstanceState.NORMAL]))
        columns["used_pct"].append(100.0 * used / total)
        columns["freeness"].append(_drawable(r["freeness"]))
        columns["running"].append(int(r["num_running"]))
        columns["waiting"].append(int(r["num_waiting"]) + int(r.get("num_pending", 0)))
        columns["used_blocks"].append(used)
        columns["total_blocks"].append(total)
    return columns


def migration_columns(events: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """The migrations table's data, newest first; times as local clock strings."""
    columns: dict[str, list] = {key: [] for key, _ in MIGRATION_COLUMNS}
    for e in reversed(events):
        columns["time"].append(time.strftime("%H:%M:%S", time.localtime(float(e["time"]))))
        columns["kind"].append(e["kind"])
        columns["request_id"].append(e["request_id"])
        columns["source"].append(e["source"])
        columns["destination"].append(e["destination"])
        columns["stages"].append(int(e.get("stages", 0)))
        columns["blocks"].append(int(e.get("blocks", 0)))
        for name, key in (("downtime_ms", "downtime"), ("source_ms", "downtime_source"),
                          ("destination_ms", "downtime_destination")):
            columns[name].append(round(1000.0 * float(e.get(key, 0.0)), 1))
        columns["reason"].append(e.get("reason", ""))
    return columns


SERIES_COLUMNS = ("time", "pooled_freeness", "instances", "dispatch_rate", "committed_rate", "aborted_rate",
                  "downtime_ms")


def series_columns(samples: Sequence[Sample], previous: Sample | None = None) -> dict[str, list]:
    """The time series' new rows: counters become rates over each sample's interval (from
    `previous`, the last sample already shown; the first row of a page has no rate yet)."""
    columns: dict[str, list] = {key: [] for key in SERIES_COLUMNS}
    for sample in samples:
        columns["time"].append(1000.0 * sample.time)  # Bokeh's datetime axis counts milliseconds
        columns["pooled_freeness"].append(_drawable(sample.pooled_freeness))
        columns["instances"].append(sample.ready_instances)
        base = previous or sample  # the first row has no interval: no rate, no downtime
        elapsed = sample.time - base.time
        for key, field in (("dispatch_rate", "dispatches"), ("committed_rate", "committed"), ("aborted_rate", "aborted")):
            columns[key].append((getattr(sample, field) - getattr(base, field)) / elapsed if elapsed > 0 else 0.0)
        committed = sample.committed - base.committed
        # Mean downtime of the migrations committed in the interval; a gap where none was.
        columns["downtime_ms"].append(1000.0 * (sample.downtime - base.downtime) / committed if committed else math.nan)
        previous = sample
    return columns


def usage_lines(samples: Sequence[Sample]) -> dict[str, list]:
    """Each instance's KV use over the window, one line per instance (natural order)."""
    instances = sorted({i for s in samples for i in s.used_pct}, key=instance_order)
    lines: dict[str, list] = {"name": instances, "xs": [], "ys": [], "color": []}
    for k, instance in enumerate(instances):
        held = [s for s in samples if instance in s.used_pct]
        lines["xs"].append([1000.0 * s.time for s in held])
        lines["ys"].append([s.used_pct[instance] for s in held])
        lines["color"].append(PALETTE[k % len(PALETTE)])
    return lines


def _drawable(value: float) -> float:
    """-inf and +inf cannot be drawn: clip to the axis (the state or summary says why)."""
    return max(min(float(value), 1e6), -1e6)


def summary_html(status: Mapping[str, Any]) -> str:
    rows = status["instances"]
    counts = status["migrations"]
    committed = counts["committed"]
    mean_downtime = 1000.0 * counts["downtime"] / committed if committed else 0.0
    ready = sum(1 for r in rows if r["ready"])
    return (
        f"<b>{ready}</b> of {len(rows)} instances ready &middot; "
        f"<b>{sum(r['num_running'] for r in rows)}</b> running, "
        f"<b>{sum(r['num_waiting'] + r.get('num_pending', 0) for r in rows)}</b> waiting &middot; "
        f"migrations: <b>{committed}</b> committed, {counts['aborted']} aborted, "
        f"{counts['started'] - committed - counts['aborted']} in flight, mean downtime {mean_downtime:.1f} ms"
    )


def build_document(doc: Document, read_status: Callable[[], Mapping[str, Any]],
                   read_migrations: Callable[[], Sequence[Mapping[str, Any]]],
                   thresholds: tuple[float, float],
                   read_history: Callable[[float], Sequence[Sample]] = lambda after: (),
                   band: tuple[float, float] | None = None) -> Callable[[], None]:
    """Lay out the page on `doc`; returns the refresh function (also scheduled on the document).

    `read_history(after)` gives the samples newer than `after`; `band` is the scaling band
    drawn over the pooled freeness (None when scaling is off)."""
    instances = ColumnDataSource(instance_columns([]))
    migrations = ColumnDataSource(migration_columns([]))
    summary = Div(text="", sizing_mode="stretch_width")
    tooltips = [("instance", "@instance"), ("state", "@state"), ("blocks", "@used_blocks / @total_blocks"),
                ("freeness", "@freeness{0.0}"), ("running", "@running"), ("waiting", "@waiting")]

    def bars(title: str, field: str, y_label: str):
        plot = figure(title=title, x_range=[], height=260, sizing_mode="stretch_width", tooltips=tooltips,
                      toolbar_location=None)
        plot.vbar(x="instance", top=field, width=0.8, color="color", source=instances)
        plot.yaxis.axis_label = y_label
        plot.xaxis.major_label_orientation = 0.6
        return plot

    memory = bars("KV blocks in use", "used_pct", "% of the instance's blocks")
    memory.y_range.start, memory.y_range.end = 0, 100
    freeness = bars("Freeness (red: migration source, green: destination)", "freeness", "F = (M - ΣV) / B")
    low, high = thresholds
    for level, dash in ((low, "dashed"), (high, "dotted")):
        freeness.add_layout(Span(location=level, dimension="width", line_dash=dash, line_color="#555"))
    load = figure(title="Requests", x_range=memory.x_range, height=260, sizing_mode="stretch_width",
                  tooltips=tooltips, toolbar_location=None)
    load.vbar(x="instance", top="running", width=0.4, color="#4c78a8", legend_label="running", source=instances)
    load.scatter(x="instance", y="waiting", size=10, color="#f58518", legend_label="waiting", source=instances)
    load.y_range.start = 0
    freeness.x_range = memory.x_range
    table = DataTable(source=migrations, columns=[TableColumn(field=k, title=t) for k, t in MIGRATION_COLUMNS],
                      height=300, sizing_mode="stretch_width", index_position=None)

    series = ColumnDataSource(series_columns([]))
    usage = ColumnDataSource(usage_lines([]))
    shown: list[Sample] = []  # the last sample on the page

    def over_time(title: str, y_label: str):
        plot = figure(title=title, x_axis_type="datetime", height=220, sizing_mode="stretch_width",
                      toolbar_location=None)
        plot.yaxis.axis_label = y_label
        return plot

    pooled = over_time("Pooled freeness (the scaling signal)" + (", with the band" if band else ""), "F")
    pooled.line("time", "pooled_freeness", source=series, line_width=2)
    for level in band or ():
        pooled.add_layout(Span(location=level, dimension="width", line_dash="dashed", line_color="#555"))
    count = over_time("Ready instances", "instances")
    count.step("time", "instances", source=series, line_width=2, mode="after")
    rates = over_time("Per second", "events / s")
    for field, color, label in (("dispatch_rate", "#4c78a8", "dispatches"), ("committed_rate", "#54a24b", "migrations committed"),
                                ("aborted_rate", "#e45756", "migrations aborted")):
        rates.line("time", field, source=series, color=color, legend_label=label, line_width=2)
    rates.legend.location = "top_left"
    downtime = over_time("Mean migration downtime", "ms")
    downtime.scatter("time", "downtime_ms", source=series, size=6, color="#54a24b")
    kv = over_time("KV blocks in use, per instance", "% of the instance's blocks")
    kv.multi_line("xs", "ys", color="color", source=usage, line_width=2)
    kv.y_range.start, kv.y_range.end = 0, 100
    for plot in (count, rates, downtime, kv):
        plot.x_range = pooled.x_range

    def refresh() -> None:
        status = read_status()
        data = instance_columns(status["instances"])
        memory.x_range.factors = data["instance"]
        instances.data = data
        migrations.data = migration_columns(read_migrations())
        summary.text = summary_html(status)
        new = list(read_history(shown[-1].time if shown else -math.inf))
        if new:
            series.stream(series_columns(new, shown[-1] if shown else None), rollover=HISTORY_POINTS)
            shown[:] = [new[-1]]
            usage.data = usage_lines(read_history(-math.inf))

    doc.title = "llumdask"
    doc.add_root(column(Div(text="<h2>llumdask: instances and migrations</h2>"), summary,
                        row(memory, freeness, sizing_mode="stretch_width"), load,
                        Div(text="<h3>The last minutes</h3>"), row(pooled, count, sizing_mode="stretch_width"),
                        row(rates, downtime, sizing_mode="stretch_width"), kv,
                        Div(text="<h3>Latest migrations</h3>"), table, sizing_mode="stretch_width"))
    refresh()
    doc.add_periodic_callback(refresh, REFRESH_MS)
    return refresh


def _page(plugin, scheduler, extra: dict, doc: Document) -> None:
    """The Bokeh application function (the dashboard passes the scheduler and template data)."""
    migration, scaling = plugin.config.migration, plugin.config.scaling
    build_document(doc, plugin.status, lambda: list(plugin.recent_migrations),
                   (migration.low_threshold, migration.high_threshold), plugin.history.samples,
                   scaling.band if scaling.enabled else None)


def page_link(dashboard_link: str) -> str:
    """The page's URL from the dashboard's (`http://host:port[/prefix]/status`, as Dask prints it)."""
    return f"{dashboard_link.rsplit('/', 1)[0]}{PAGE}"


def add_page(scheduler, plugin) -> str | None:
    """Serve the page beside the scheduler's dashboard; the page's URL path, or None without a dashboard."""
    from bokeh.server.tornado import BokehTornado
    from distributed.dashboard.core import BokehApplication
    from tornado.ioloop import IOLoop

    http = getattr(scheduler, "http_application", None)
    dashboards = [a for a in getattr(http, "applications", ()) if isinstance(a, BokehTornado)]
    if not dashboards:
        return None  # started without a dashboard (or without bokeh): nothing to add a page to
    prefix = dashboards[0].prefix  # the dashboard's own, e.g. "/dask" behind a proxy
    app = BokehApplication({PAGE: partial(_page, plugin)}, scheduler, prefix=prefix)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    list_in_menu(scheduler)
    return f"{prefix}{PAGE}"


def list_in_menu(scheduler) -> None:
    """Add the page to the dashboard's "More..." menu, as distributed lists its own extra pages.

    Every dashboard page renders its menu from one list per scheduler (the template variables
    distributed computes once per scheduler and shares by reference), so adding to it lists
    the page on every page served from now on.
    """
    from distributed.dashboard.scheduler import template_variables

    menu = template_variables(scheduler)["plots"]
    entry = {"url": PAGE.strip("/"), "name": MENU_NAME}
    if entry not in menu:
        menu.append(entry)
        menu.sort(key=lambda page: page["name"])
