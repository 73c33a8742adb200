"""Failures on a real cluster: a worker killed mid-stream, a migration peer dying mid-migration.

The handshake timeout is set far above the test's deadlines, so every clean-up seen here comes
from the dead-peer path (the scheduler's remove_worker -> llumnix_peer_lost), not from timeouts.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from daskhelpers import (assert_workers_clean, hand_a_reservation, nannies_kept, prompt_of, reference_tokens, wait_until,
                         worker_statuses)

from llumdask.api.client import connect
from llumdask.clusters.instances import wait_for_instances
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config
from llumdask.request import FinishReason

pytestmark = pytest.mark.slow

OVERRIDES = {"sim-engine": {"total-blocks": 256}, "migration": {"handshake-timeout": 60.0}}


@pytest.fixture(scope="module")
def llum():
    """Workers are killed and engines broken for their nannies to restart (`nannies_kept`)."""
    with nannies_kept(), local_cluster(2, config_overrides=OVERRIDES) as cluster, connect(cluster) as client:
        yield client


@pytest.fixture
def two_instances(llum):
    """Each test starts with two ready instances (a killed worker is restarted by its nanny)."""
    client = llum.dask_client
    wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, 60, what="two workers")
    wait_for_instances(client, 2, timeout=60)
    yield [row["instance"] for row in llum.instances() if row["ready"]]
    assert_workers_clean(client)


def pid_of(llum, worker: str) -> int:
    return llum.dask_client.run(os.getpid, workers=[worker])[worker]


def test_killed_worker_mid_stream_still_completes_its_requests_exactly(llum, two_instances):
    config = load_config(OVERRIDES)
    prompts = [prompt_of(40 + k, 50) for k in range(4)]
    resubmitted_before = llum.resubmissions
    streams = [llum.stream(p, max_tokens=200) for p in prompts]
    tokens = [[next(s) for _ in range(5)] for s in streams]
    victim = streams[0].instance
    on_victim = sum(s.instance == victim for s in streams)
    os.kill(pid_of(llum, victim), signal.SIGKILL)
    for got, stream in zip(tokens, streams):
        got += list(stream)
    for got, prompt in zip(tokens, prompts):
        assert got == reference_tokens(config, prompt, 200)
    assert llum.resubmissions - resubmitted_before == on_victim >= 1
    assert victim not in {s.instance for s in streams}


def test_source_death_releases_the_destination_reservation(llum, two_instances):
    source, destination = two_instances
    client = llum.dask_client
    client.sync(hand_a_reservation, destination, source, "fake-migration", 7)
    wait_until(lambda: worker_statuses(client)[destination]["reserved_blocks"] == 7, 10, what="reservation")
    assert worker_statuses(client)[destination]["migrations_in_flight"] == 1
    os.kill(pid_of(llum, source), signal.SIGKILL)
    wait_until(lambda: worker_statuses(client, [destination]).get(destination, {}).get("reserved_blocks") == 0, 10,
               what="reservation released")
    assert worker_statuses(client, [destination])[destination]["migrations_in_flight"] == 0


def test_destination_death_mid_migration_aborts_it_and_the_request_goes_on(llum, two_instances):
    config = load_config(OVERRIDES)
    prompt = prompt_of(50, 60)
    resubmitted_before = llum.resubmissions
    stream = llum.stream(prompt, max_tokens=150)
    tokens = [next(stream) for _ in range(5)]
    source = stream.instance
    destination = next(i for i in two_instances if i != source)
    destination_pid = pid_of(llum, destination)
    os.kill(destination_pid, signal.SIGSTOP)  # it will never answer the pre-allocation
    try:
        migration_id = llum.migrate(stream.request_id, to=destination)
    finally:
        os.kill(destination_pid, signal.SIGKILL)
    tokens += list(stream)
    assert tokens == reference_tokens(config, prompt, 150)
    assert stream.instance == source and llum.resubmissions == resubmitted_before
    events = [e for e in worker_statuses(llum.dask_client, [source])[source]["events"] if e["migration_id"] == migration_id]
    assert [e["kind"] for e in events] == ["started", "aborted"]
    assert "lost" in events[-1]["reason"]


def _break_a_step_once(dask_worker) -> None:
    """In a worker: the engine's first step once a request has 3 tokens raises (an engine bug)."""
    engine = dask_worker.plugins["llumdask"].host.llumlet.engine
    engine.working_step = engine.step

    def step():
        if any(r.num_tokens - r.num_prompt_tokens >= 3 for r in engine.snapshot().running):
            engine.step = engine.working_step
            raise RuntimeError("the engine broke")
        return engine.working_step()

    engine.step = step


def _mend(dask_worker) -> None:
    engine = dask_worker.plugins["llumdask"].host.llumlet.engine
    engine.step = getattr(engine, "working_step", engine.step)


def test_a_failed_engine_step_ends_its_requests_as_aborted_instead_of_leaving_them_waiting(llum, two_instances):
    client = llum.dask_client
    client.run(_break_a_step_once)
    try:
        # Without the abort the request would wait for ever: the timeout makes that a failure.
        ended = llum.generate(prompt_of(70, 20), max_tokens=3000, ignore_eos=True, timeout=30)
    finally:
        client.run(_mend)
    assert ended.finish_reason is FinishReason.ABORT and 3 <= len(ended.token_ids) < 3000
    # The instance goes on serving (the sim engine survives a failed step; its blocks were freed).
    again = llum.generate(prompt_of(71, 20), max_tokens=8, ignore_eos=True)
    assert len(again.token_ids) == 8


def _break_for_good(dask_worker) -> None:
    """In a worker: every step of the engine raises from now on (a dead engine core)."""
    engine = dask_worker.plugins["llumdask"].host.llumlet.engine

    def step():
        raise RuntimeError("the engine is dead")

    engine.step = step


def _where_idle_dispatch_goes(llum) -> str:
    """The instance an idle cluster sends a request to (two idle instances tie; the tie goes one
    way): the same one for two probes running, each sent once the last one's instance reported
    itself idle. One probe is not enough: an instance still reporting an earlier request loses."""
    last = None
    for k in range(20):
        probe = llum.stream(prompt_of(60 + k, 20), max_tokens=4, ignore_eos=True)
        list(probe)
        if probe.instance == last:
            return last
        last = probe.instance
        time.sleep(0.2)  # its report says idle again
    raise AssertionError("an idle cluster's dispatch did not settle on one instance")


def test_an_instance_whose_engine_stays_broken_leaves_and_a_fresh_one_takes_its_place(llum, two_instances):
    """Each failed step aborts its requests; at `max-failed-steps` (3) in a row the worker closes,
    the instance leaves the table, and its nanny starts a fresh worker that serves."""
    client = llum.dask_client
    broken = _where_idle_dispatch_goes(llum)
    client.run(_break_for_good, workers=[broken])
    aborted = 0
    for k in range(10):
        result = llum.generate(prompt_of(81 + k, 20), max_tokens=4, ignore_eos=True, timeout=30)
        aborted += result.finish_reason is FinishReason.ABORT
        if aborted == 3:
            break
        time.sleep(0.2)  # the instance reports itself idle again
    assert aborted == 3
    wait_until(lambda: broken not in [row["instance"] for row in llum.instances()], 30, what="the broken one to leave")
    wait_for_instances(client, 2, timeout=60)  # the nanny's fresh worker
    assert broken not in [row["instance"] for row in llum.instances()]
    served = [llum.generate(prompt_of(95 + k, 20), max_tokens=8, ignore_eos=True, timeout=30) for k in range(4)]
    assert all(len(r.token_ids) == 8 for r in served)
