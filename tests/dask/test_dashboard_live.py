"""The llumdask page on a live cluster's dashboard: served over HTTP, fed by the scheduler plugin,
and rendered by a real browser (headless Chromium) with the instances and a forced migration."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from bokeh.client import pull_session
from bokeh.models import ColumnDataSource
from prometheus_client.parser import text_string_to_metric_families
from daskhelpers import prompt_of, wait_until

from llumdask.benchmarks.dashboard_screenshot import CHROMIUM_ARGS
from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def migrated():
    """Two instances, one request live-migrated between them: (client, page URL, request id)."""
    with local_cluster(2, config_overrides={"sim-engine": {"total-blocks": 256}}) as cluster, connect(cluster) as llum:
        stream = llum.stream(prompt_of(3, 120), max_tokens=150)
        next(stream)
        destination = next(r["instance"] for r in llum.instances() if r["instance"] != stream.instance)
        llum.migrate(stream.request_id, to=destination)
        list(stream)
        wait_until(lambda: llum.instances().migrations["committed"] == 1, 20, what="the migration's commit")
        page = cluster.dashboard_link.rsplit("/", 1)[0] + "/llumdask"
        yield llum, page, stream.request_id


def test_the_page_is_served_beside_the_dask_dashboard(migrated):
    _, page, _ = migrated
    r = httpx.get(page, timeout=30)
    assert r.status_code == 200 and "bokeh" in r.text.lower()


def test_the_dashboard_menu_lists_the_page(migrated):
    _, page, _ = migrated
    status = httpx.get(page.rsplit("/", 1)[0] + "/status", timeout=30)
    assert status.status_code == 200
    menu = status.text.split("More...", 1)[1].split("</ul>", 1)[0]  # the "More..." dropdown
    assert '<a href="llumdask">Llumdask</a>' in menu


def test_the_live_document_holds_every_instance_and_the_migration(migrated):
    llum, page, request_id = migrated
    with pull_session(url=page) as session:
        sources = list(session.document.select({"type": ColumnDataSource}))
    instances = next(s.data for s in sources if "instance" in s.data)
    migrations = next(s.data for s in sources if "request_id" in s.data)
    assert sorted(instances["instance"]) == sorted(r["instance"] for r in llum.instances())
    assert migrations["request_id"] == [request_id] and migrations["kind"] == ["committed"]
    assert migrations["downtime_ms"][0] > 0 and migrations["stages"][0] >= 1
    # Both sides' parts arrive from the workers (the destination's, unrounded, is never 0) and the
    # page shows them in ms; neither can exceed the whole (0.1 ms rounding).
    [event] = llum.migrations(limit=1).rows
    assert event["downtime_destination"] > 0
    assert migrations["destination_ms"][0] == round(1000.0 * event["downtime_destination"], 1)
    parts = migrations["source_ms"][0] + migrations["destination_ms"][0]
    assert parts <= migrations["downtime_ms"][0] + 0.1
    # The last minutes: a sample a second since the scheduler started, each instance's KV use.
    series = next(s.data for s in sources if "pooled_freeness" in s.data)
    usage = next(s.data for s in sources if "xs" in s.data)
    assert len(series["time"]) >= 2 and series["instances"][-1] == 2
    assert sum(series["dispatch_rate"]) > 0 and max(series["committed_rate"]) > 0
    assert sorted(usage["name"]) == sorted(instances["instance"]) and all(len(ys) >= 2 for ys in usage["ys"])


def test_the_scheduler_metrics_carry_the_llumdask_series(migrated):
    llum, page, _ = migrated
    text = httpx.get(page.rsplit("/", 1)[0] + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    rows = llum.instances()
    for row in rows:
        label = (("instance", row["instance"]),)
        assert samples[("llumdask_instance_total_blocks", label)] == row["total_blocks"] == 256
        assert samples[("llumdask_instance_freeness", label)] > 0  # idle after the migration
        assert ("llumdask_instance_virtual_blocks", label) in samples
        assert samples[("llumdask_instance_pinned", label)] == 0  # the sim engine pins nothing
    assert samples[("llumdask_migrations_total", (("outcome", "started"),))] == 1
    assert samples[("llumdask_migrations_total", (("outcome", "committed"),))] == 1
    assert samples[("llumdask_migration_downtime_seconds_count", ())] == 1
    assert samples[("llumdask_migration_bytes_total", ())] > 0
    assert samples[("llumdask_dispatches_total", (("outcome", "placed"),))] >= 1


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (make test installs Debian's chromium)")
def test_a_browser_renders_the_instances_and_the_migration(migrated, tmp_path: Path):
    from playwright.sync_api import sync_playwright

    llum, page_url, request_id = migrated
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # As a user finds it: the dashboard's "More..." menu, then the llumdask link.
            page.goto(page_url.rsplit("/", 1)[0] + "/status")
            page.get_by_text("More...").hover()
            page.get_by_role("link", name="Llumdask").click()
            page.wait_for_url(page_url)
            page.get_by_text("2 of 2 instances ready").wait_for(timeout=30_000)
            page.get_by_text(request_id).wait_for(timeout=30_000)  # the migrations table's row
            assert page.get_by_text("1 committed").count() >= 1
            page.get_by_text("The last minutes").wait_for(timeout=30_000)
            assert page.locator("canvas").count() >= 8  # the three instance plots and five time series drew
            page.screenshot(path=str(tmp_path / "llumdask-dashboard.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
