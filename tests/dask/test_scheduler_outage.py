"""The scheduler going away: restarted (workers exit with it, as Dask workers do), or unresponsive.

Deployment-like processes: `dask scheduler` and `dask worker` with the llumdask preloads.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from daskhelpers import ProcessCluster, prompt_of, reference_tokens
from distributed import Client

from llumdask.api.client import connect
from llumdask.clusters.instances import wait_for_instances
from llumdask.config import load_config

pytestmark = pytest.mark.slow

ENV = {"DASK_LLUMDASK__SIM_ENGINE__TOTAL_BLOCKS": "128"}
CONFIG_OVERRIDES = {"sim-engine": {"total-blocks": 128}}


def test_scheduler_restart_loses_no_in_flight_request(tmp_path):
    config = load_config(CONFIG_OVERRIDES)
    with ProcessCluster(tmp_path, n_workers=2, env=ENV) as processes, \
            Client(processes.address, timeout=30) as client:
        wait_for_instances(client, 2, timeout=60)
        llum = connect(client, liveness_interval=0.5)
        prompts = [prompt_of(80 + k, 40) for k in range(2)]
        streams = [llum.stream(p, max_tokens=150) for p in prompts]
        tokens = [[next(s) for _ in range(5)] for s in streams]
        before = {s.instance for s in streams}
        processes.kill_scheduler()
        processes.start_scheduler()
        # Dask workers exit with their scheduler; a supervisor starts new ones.
        processes.add_workers(2)
        for got, stream in zip(tokens, streams):
            got += list(stream)
        for got, prompt in zip(tokens, prompts):
            assert got == reference_tokens(config, prompt, 150)
        assert llum.resubmissions == 2
        assert not before & {s.instance for s in streams}
        llum.close()


def test_unresponsive_scheduler_is_bypassed_until_it_answers_again(tmp_path):
    config = load_config(CONFIG_OVERRIDES)
    with ProcessCluster(tmp_path, n_workers=2, env=ENV) as processes, \
            Client(processes.address, timeout=30) as client:
        wait_for_instances(client, 2, timeout=60)
        llum = connect(client, dispatch_timeout=0.5, bypass_period=1.0)
        prompt = prompt_of(90, 30)
        expected = reference_tokens(config, prompt, 20)
        assert llum.generate(prompt, max_tokens=20, timeout=30).token_ids == expected
        assert llum.requester.bypassed == 0

        os.kill(processes.scheduler.pid, signal.SIGSTOP)
        try:
            results = [llum.generate(prompt, max_tokens=20, timeout=30) for _ in range(2)]
        finally:
            os.kill(processes.scheduler.pid, signal.SIGCONT)
        assert [r.token_ids for r in results] == [expected, expected]
        assert llum.requester.bypassed == 2
        assert len({r.instance for r in results}) == 2  # bypass mode rotates over known instances

        time.sleep(1.0)  # the bypass period ends: back to the scheduler
        assert len(llum.instances()) == 2
        assert llum.generate(prompt, max_tokens=20, timeout=30).token_ids == expected
        assert llum.requester.bypassed == 2
        llum.close()
