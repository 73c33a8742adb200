"""Adaptive scaling on a real cluster: up on low freeness, down only after draining, no request lost."""

from __future__ import annotations

import threading

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens, wait_until

from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config

pytestmark = pytest.mark.slow


def n_workers(llum) -> int:
    return len(llum.dask_client.scheduler_info()["workers"])


def actions(llum) -> list[str]:
    return [entry["action"] for entry in llum.dask_client.sync(llum.dask_client.scheduler.llumnix_status)["scaling"]["log"]]


def test_scales_up_on_low_freeness_then_back_down_when_idle():
    overrides = {
        "sim-engine": {"total-blocks": 64},
        "scaling": {"enabled": True, "band": [10.0, 60.0], "scale-out-period": 0.5, "scale-in-period": 0.5,
                    "min-instances": 1, "max-instances": 2},
    }
    config = load_config(overrides)
    with local_cluster(1, config_overrides=overrides) as cluster, connect(cluster) as llum:
        # An idle instance has F = 64 > 60, but the minimum keeps it.
        prompts = [prompt_of(60 + k, 80) for k in range(5)]
        streams = [llum.stream(p, max_tokens=90) for p in prompts]
        results: list[list[int]] = [[] for _ in streams]
        readers = [threading.Thread(target=lambda i=i: results[i].extend(streams[i])) for i in range(len(streams))]
        for reader in readers:
            reader.start()
        # 5 requests of 5+ blocks each on 64 blocks: mean F < 10 -> a second instance.
        wait_until(lambda: n_workers(llum) == 2, 30, what="scale-up to two workers")
        for reader in readers:
            reader.join(60)
        for got, prompt in zip(results, prompts):
            assert got == reference_tokens(config, prompt, 90)
        # Idle again: mean F > 60 -> one instance drained, then closed.
        wait_until(lambda: n_workers(llum) == 1, 30, what="scale-down to one worker")
        assert actions(llum)[:1] == ["add"] and {"terminate", "remove"} <= set(actions(llum))
        assert_workers_clean(llum.dask_client)


def test_a_drained_instance_closes_only_after_its_requests_migrated():
    overrides = {"sim-engine": {"total-blocks": 256}}
    config = load_config(overrides)
    with local_cluster(2, config_overrides=overrides, adaptive=True) as cluster, connect(cluster) as llum:
        prompts = [prompt_of(70 + k, 60) for k in range(4)]
        streams = [llum.stream(p, max_tokens=200) for p in prompts]
        tokens = [[next(s)] for s in streams]
        victim = streams[0].instance
        on_victim = [s.request_id for s in streams if s.instance == victim]
        llum.drain(victim)
        for got, stream in zip(tokens, streams):
            got += list(stream)
        for got, prompt in zip(tokens, prompts):
            assert got == reference_tokens(config, prompt, 200)
        assert victim not in {s.instance for s in streams} and on_victim
        wait_until(lambda: n_workers(llum) == 1, 30, what="the drained worker closed")
        assert victim not in llum.dask_client.scheduler_info()["workers"]
        assert_workers_clean(llum.dask_client)


def test_only_whole_drained_jobs_close():
    """A job of several workers (SLURM's, say) closes only once all of them are drained; plain
    workers close one by one; never more than the excess."""
    from llumdask.plugins.adaptive import whole_jobs

    spec = {"job-a": {"group": ["-0", "-1"]}, "job-b": {"group": ["-0", "-1"]}, "plain": {}}
    assert whole_jobs(["job-a-0"], spec, 4) == []
    assert whole_jobs(["job-a-0", "job-b-1", "job-a-1"], spec, 4) == ["job-a-0", "job-a-1"]
    assert whole_jobs(["plain", "job-a-1", "job-a-0"], spec, 2) == ["plain"]
    assert whole_jobs(["job-a-1", "job-a-0", "plain"], spec, 3) == ["job-a-0", "job-a-1", "plain"]
    assert whole_jobs(["w1", "w2"], {}, 1) == ["w1"]


def test_a_burst_takes_back_an_instance_that_is_still_draining():
    """Without migration a drained instance keeps its requests until they finish; a burst meanwhile
    takes it back (no start-up, within the maximum) rather than waiting for a new one."""
    overrides = {
        "sim-engine": {"total-blocks": 256, "real-time": True},
        "migration": {"enabled": False},
        "scaling": {"enabled": True, "band": [10.0, 60.0], "scale-out-period": 0.5, "scale-in-period": 2.0,
                    "min-instances": 1, "max-instances": 2},
    }
    # The references need the same engine, not its pace.
    config = load_config({**overrides, "sim-engine": {"total-blocks": 256}})
    with local_cluster(2, config_overrides=overrides) as cluster, connect(cluster) as llum:
        requests: list[tuple[list[int], int]] = []
        streams, results, readers = [], [], []

        def send(prompt: list[int], max_tokens: int) -> None:
            stream = llum.stream(prompt, max_tokens=max_tokens)
            got = [next(stream)]
            reader = threading.Thread(target=lambda: got.extend(stream))
            reader.start()
            requests.append((prompt, max_tokens))
            streams.append(stream)
            results.append(got)
            readers.append(reader)

        for k in range(2):  # one long request on each instance: neither can be drained empty
            send(prompt_of(90 + k, 40), 400)
        assert {s.instance for s in streams} == set(llum.dask_client.scheduler_info()["workers"])
        # Idle enough for one instance: a drain, which waits for the victim's request to finish.
        wait_until(lambda: "terminate" in actions(llum), 30, what="a scale-in")
        log = llum.dask_client.sync(llum.dask_client.scheduler.llumnix_status)["scaling"]["log"]
        victim = next(entry["instance"] for entry in log if entry["action"] == "terminate")
        for k in range(24):  # the one instance left would queue: the victim comes back
            send(prompt_of(100 + k, 80), 60)
        wait_until(lambda: "resume" in actions(llum), 30, what="the draining instance taken back")
        later = len(streams)
        for k in range(8):
            send(prompt_of(200 + k, 40), 20)
        assert victim in {s.instance for s in streams[later:]}  # placeable again
        assert n_workers(llum) == 2  # not closed: taken back
        for reader in readers:
            reader.join(120)
        for got, (prompt, max_tokens) in zip(results, requests):
            assert got == reference_tokens(config, prompt, max_tokens)
        assert actions(llum)[:2] == ["terminate", "resume"]
        assert_workers_clean(llum.dask_client)
