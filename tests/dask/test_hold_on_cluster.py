"""Holding past capacity on a real cluster: a request with no instance to spare waits at the
scheduler (not in an instance's queue) and runs, exactly, once room appears."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens, wait_until

from llumdask.api.client import connect
from llumdask.api.gateway import ModelInfo
from llumdask.api.gateway.dask_backend import DaskBackend
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config
from llumdask.global_scheduler import NoInstanceAvailable
from llumdask.plugins.scheduler import HOLD_LEASE
from llumdask.request import Priority, SamplingParams

pytestmark = pytest.mark.slow


def test_a_request_without_room_waits_at_the_scheduler_then_runs_where_room_appears():
    overrides = {"sim-engine": {"total-blocks": 64}}
    config = load_config(overrides)
    long_prompt, held_prompt = prompt_of(1, 600), prompt_of(2, 500)  # 38 + 32 blocks of 64
    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster) as llum, \
            ThreadPoolExecutor(1) as pool:
        (only,) = llum.instances().rows
        running = llum.stream(long_prompt, max_tokens=300)
        tokens = [next(running)]
        held = pool.submit(llum.generate, held_prompt, max_tokens=40, timeout=120)
        wait_until(lambda: llum.instances().held.get("requests") == 1, 10, what="a held request")
        table = llum.instances()
        assert table[only["instance"]]["num_waiting"] == 0 and table[only["instance"]]["num_pending"] == 0
        tokens += list(running)
        generation = held.result(timeout=120)

        assert generation.token_ids == reference_tokens(config, held_prompt, 40)
        assert tokens == reference_tokens(config, long_prompt, 300)
        assert generation.instance == only["instance"]
        assert llum.instances().held == {"requests": 0, "oldest_s": 0.0}
        assert_workers_clean(llum.dask_client)


def test_a_held_request_whose_instances_all_leave_fails_after_the_placement_timeout_and_is_withdrawn():
    """A request finding no instance is refused after `requester.placement-timeout`; one held when
    the last instance leaves waits no longer, and the scheduler forgets it at once."""
    overrides = {"sim-engine": {"total-blocks": 64}}
    long_prompt, held_prompt = prompt_of(3, 600), prompt_of(4, 500)  # 38 + 32 blocks of 64
    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster, placement_timeout=2.0) as llum, \
            ThreadPoolExecutor(1) as pool:
        running = llum.stream(long_prompt, max_tokens=300)
        next(running)
        held = pool.submit(llum.generate, held_prompt, max_tokens=40, timeout=120)
        wait_until(lambda: llum.instances().held.get("requests") == 1, 10, what="a held request")
        left = time.monotonic()
        cluster.scale(0)
        with pytest.raises(NoInstanceAvailable, match="held with no instance to go to"):
            held.result(timeout=30)
        assert 2.0 < time.monotonic() - left < 20  # the placement timeout, not at once nor never
        # Withdrawn by its requester, well before the scheduler's lease on it would run out.
        wait_until(lambda: llum.instances().held.get("requests") == 0, 2, what="the held request withdrawn")


def test_a_held_request_whose_client_leaves_gives_up_its_place_at_once():
    """The gateway's backend cancelled while its request is held (the HTTP client left): the
    scheduler forgets the request at once, not when its lease runs out, and it never runs."""
    overrides = {"sim-engine": {"total-blocks": 64}}
    config = load_config(overrides)
    long_prompt, held_prompt = prompt_of(5, 600), prompt_of(6, 500)  # 38 + 32 blocks of 64

    async def held_count(backend: DaskBackend) -> int:
        return (await backend.requester.status())["held"]["requests"]

    async def scenario(address: str) -> list[int]:
        async with DaskBackend.connect(address, ModelInfo("tiny", 4096)) as backend:
            (running,) = await backend.submit([("long", SamplingParams(max_tokens=300))], long_prompt,
                                              Priority.NORMAL, None)
            batches = aiter(running)
            tokens = await anext(batches)
            held = asyncio.ensure_future(backend.submit([("held", SamplingParams(max_tokens=40))], held_prompt,
                                                        Priority.NORMAL, None))
            while await held_count(backend) != 1:
                await asyncio.sleep(0.05)
            held.cancel()
            left = time.monotonic()
            while await held_count(backend) != 0:
                assert time.monotonic() - left < HOLD_LEASE / 2, "still held: withdrawn only by its lease"
                await asyncio.sleep(0.05)
            assert held.cancelled()
            async for batch in batches:
                tokens += batch
            return tokens

    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster) as llum:
        tokens = asyncio.run(scenario(cluster.scheduler_address))
        assert tokens == reference_tokens(config, long_prompt, 300)
        assert llum.instances().held == {"requests": 0, "oldest_s": 0.0}
        metrics = llum.dask_client.run_on_scheduler(lambda dask_scheduler: dict(
            dask_scheduler.plugins["llumdask"].metrics.dispatches))
        assert metrics.get("withdrawn") == 1 and metrics.get("placed") == 1  # the long one only: never placed
        assert_workers_clean(llum.dask_client)
