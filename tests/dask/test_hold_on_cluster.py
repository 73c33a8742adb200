"""Holding past capacity on a real cluster: a request with no instance to spare waits at the
scheduler (not in an instance's queue) and runs, exactly, once room appears."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens, wait_until

from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config
from llumdask.global_scheduler import NoInstanceAvailable

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
