"""End to end on a real two-process LocalCluster: dispatch, streaming, forced live migration."""

from __future__ import annotations

import asyncio
import time

import pytest

from llumdask.api.client import MigrationNotStarted, RequestRejected
from llumdask.plugins.llumlet_driver import REPORT_KEEPALIVE
from llumdask.request import FinishReason

from daskhelpers import prompt_of, reference_tokens, wait_until, worker_statuses

pytestmark = pytest.mark.slow


def test_instances_are_ready_and_render(clean):
    table = clean.instances()
    assert len(table) == 2
    assert all(row["ready"] and row["state"] == "normal" and row["num_running"] == 0 for row in table)
    assert table._repr_html_().count("<tr>") == 3
    assert table[table.rows[0]["instance"]] is table.rows[0]


def _dask_timers(dask_worker) -> tuple[bool, float]:
    callbacks = dask_worker.periodic_callbacks
    return "profile" in callbacks, callbacks["tick"].callback_time


def test_idle_instances_report_while_dasks_profiler_is_off_and_its_tick_slowed(clean, cluster_config):
    assert set(clean.dask_client.run(_dask_timers).values()) == {(False, 200.0)}
    before = {row["instance"]: row["last_report_at"] for row in clean.instances()}
    time.sleep(REPORT_KEEPALIVE + 10 * cluster_config.report_interval)  # an unchanged report goes once a keepalive
    after = {row["instance"]: row["last_report_at"] for row in clean.instances()}
    assert all(after[i] > before[i] for i in before), (before, after)


def test_generate_matches_an_unmigrated_run(clean, cluster_config):
    prompt = prompt_of(1, 40)
    result = clean.generate(prompt, max_tokens=30, timeout=30)
    assert result.token_ids == reference_tokens(cluster_config, prompt, 30)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.instance in {row["instance"] for row in clean.instances()}


def test_seeded_sampling_and_stop_tokens_match(clean, cluster_config):
    prompt = prompt_of(3, 20)
    expected = reference_tokens(cluster_config, prompt, 40, temperature=0.8, seed=11)
    stop = expected[25]
    result = clean.generate(prompt, max_tokens=40, temperature=0.8, seed=11, stop_token_ids=[stop], timeout=30)
    assert result.token_ids == expected[: expected.index(stop) + 1]
    assert result.finish_reason is FinishReason.STOP


def test_sync_stream_yields_tokens_in_order(clean, cluster_config):
    prompt = prompt_of(4, 30)
    stream = clean.stream(prompt, max_tokens=25)
    assert stream.instance is None
    assert list(stream) == reference_tokens(cluster_config, prompt, 25)
    assert stream.finish_reason is FinishReason.LENGTH


def test_async_streams_from_another_event_loop_spread_over_instances(clean, cluster_config):
    before = {row["instance"]: row["num_received"] for row in clean.instances()}
    prompts = [prompt_of(10 + k, 24) for k in range(8)]

    async def collect(stream) -> list[int]:
        return [token async for token in stream]

    async def burst():
        streams = [clean.stream(p, max_tokens=12) for p in prompts]
        return streams, await asyncio.gather(*(collect(s) for s in streams))

    streams, results = asyncio.run(burst())
    for prompt, tokens in zip(prompts, results):
        assert tokens == reference_tokens(cluster_config, prompt, 12)
    received = {row["instance"]: row["num_received"] - before[row["instance"]] for row in clean.instances()}
    assert sum(received.values()) == 8
    # The burst lands before any load report shows it: pending-demand accounting spreads it.
    assert min(received.values()) >= 3, received
    assert {s.instance for s in streams} == set(received)


def test_forced_migration_keeps_the_stream_identical(clean, cluster_config):
    prompt = prompt_of(5, 100)
    stream = clean.stream(prompt, max_tokens=120)
    tokens = [next(stream) for _ in range(10)]
    source = stream.instance
    destination = next(row["instance"] for row in clean.instances() if row["instance"] != source)
    migration_id = clean.migrate(stream.request_id, to=destination)
    tokens += list(stream)
    assert tokens == reference_tokens(cluster_config, prompt, 120)
    assert stream.instance == destination
    events = [e for e in worker_statuses(clean.dask_client)[source]["events"] if e["migration_id"] == migration_id]
    assert [e["kind"] for e in events] == ["started", "committed"]
    assert events[-1]["destination"] == destination and events[-1]["blocks"] >= 7
    assert clean.instances().migrations["committed"] >= 1
    # The notebook's view of it: the latest outcome, as a text and an HTML table.
    wait_until(lambda: any(r["migration_id"] == migration_id for r in clean.migrations()), 10, what="the outcome")
    table = clean.migrations(limit=1)
    [row] = table.rows
    assert (row["migration_id"], row["kind"], row["source"], row["destination"]) == (
        migration_id, "committed", source, destination)
    assert row["downtime_ms"] > 0 and stream.request_id in repr(table)
    assert table._repr_html_().count("<tr>") == 2
    with pytest.raises(ValueError, match="limit"):
        clean.migrations(limit=0)


def test_operator_migration_of_an_unknown_request_is_refused(clean):
    def refused() -> dict[str, int]:
        return clean.dask_client.sync(clean.dask_client.scheduler.llumnix_status)["migrations"]["refused"]

    before = refused()
    rows = clean.instances().rows
    with pytest.raises(MigrationNotStarted, match="not running here"):
        clean.migrate("no-such-request", to=rows[1]["instance"], source=rows[0]["instance"])
    with pytest.raises(MigrationNotStarted, match="not a ready instance"):
        clean.migrate("no-such-request", to="tcp://127.0.0.1:9", source=rows[0]["instance"])
    with pytest.raises(MigrationNotStarted, match="not running .* on any other instance"):
        clean.migrate("no-such-request", to=rows[1]["instance"])
    after = refused()
    assert after.get("not_started", 0) == before.get("not_started", 0) + 3 and "pinned" not in after


def test_a_request_that_can_never_fit_is_rejected(clean):
    with pytest.raises(RequestRejected, match="can never fit"):
        clean.generate(prompt_of(6, 100), max_tokens=128 * 16, timeout=30)
