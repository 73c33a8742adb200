"""Policy-triggered migration on a real cluster: draining an instance moves its running
requests to the other one through the scheduler's pairing loop, streams unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens, wait_until, worker_statuses

from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config

pytestmark = pytest.mark.slow

OVERRIDES = {"sim-engine": {"total-blocks": 256}}


def test_drained_instance_hands_its_requests_over_by_live_migration():
    config = load_config(OVERRIDES)
    with local_cluster(2, config_overrides=OVERRIDES) as cluster, connect(cluster) as llum:
        prompts = [prompt_of(30 + k, 60) for k in range(4)]
        streams = [llum.stream(p, max_tokens=200) for p in prompts]
        tokens = [[next(s)] for s in streams]
        first_owners = [s.instance for s in streams]
        owners = set(first_owners)
        assert len(owners) == 2, "the burst should have been spread over both instances"
        drained = streams[0].instance
        survivor = (owners - {drained}).pop()
        llum.drain(drained)
        for got, stream in zip(tokens, streams):
            got += list(stream)
        for got, prompt in zip(tokens, prompts):
            assert got == reference_tokens(config, prompt, 200)
        assert {s.instance for s in streams} == {survivor}

        events = worker_statuses(llum.dask_client)[drained]["events"]
        committed = {e["request_id"] for e in events if e["kind"] == "committed"}
        assert committed == {s.request_id for s, owner in zip(streams, first_owners) if owner == drained}
        wait_until(lambda: llum.instances()[drained]["state"] == "terminating", 5, what="terminating state")
        # New requests avoid the draining instance.
        assert llum.generate(prompts[0], max_tokens=5, timeout=30).instance == survivor
        assert_workers_clean(llum.dask_client)


def test_a_draining_instance_hands_its_queue_over_to_an_instance_that_joins():
    """One instance runs a long request with another queued behind it and is drained; a new
    instance joins with nothing queued, and the queued request moves to it without KV (the
    first-come-waiting rule a terminating source follows) and computes there. Holding is off, so
    the request queues on the instance."""
    overrides = {"sim-engine": {"total-blocks": 64}, "dispatch": {"hold-freeness": None}}
    config = load_config(overrides)
    long_prompt, queued_prompt = prompt_of(1, 600), prompt_of(2, 500)  # 38 + 32 blocks of 64
    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster) as llum, \
            ThreadPoolExecutor(1) as pool:
        (first,) = llum.instances().rows
        running = llum.stream(long_prompt, max_tokens=300)
        tokens = [next(running)]
        queued = pool.submit(llum.generate, queued_prompt, max_tokens=40, timeout=120)
        wait_until(lambda: llum.instances()[first["instance"]]["num_waiting"] == 1, 10, what="a queued request")
        llum.drain(first["instance"])
        cluster.scale(2)
        generation = queued.result(timeout=120)
        tokens += list(running)

        assert generation.token_ids == reference_tokens(config, queued_prompt, 40)
        assert tokens == reference_tokens(config, long_prompt, 300)
        joined = generation.instance
        assert joined != first["instance"]
        events = worker_statuses(llum.dask_client)[first["instance"]]["events"]
        (handed,) = [e for e in events if e["kind"] == "committed" and e["request_id"] == generation.request_id]
        assert handed["waiting"] and handed["destination"] == joined and handed["blocks"] == 0
        assert_workers_clean(llum.dask_client)
