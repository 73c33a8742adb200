"""The plugins install on a plain Dask cluster: through Client.register_plugin, and through
`dask scheduler --preload` / `dask worker --preload` in their own processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from daskhelpers import (
    CLUSTER_OVERRIDES,
    ProcessCluster,
    assert_workers_clean,
    prompt_of,
    reference_tokens,
    wait_until,
    worker_statuses,
)
from distributed import Client, LocalCluster

from llumdask.api.client import connect
from llumdask.clusters.instances import wait_for_instances
from llumdask.config import load_config
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin
from llumdask.plugins.worker import LlumletWorkerPlugin

pytestmark = pytest.mark.slow


def test_register_plugin_in_either_order_and_again_without_restarting_engines():
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        # Worker plugin first: llumlets wait for the scheduler plugin before they report anything.
        client.register_plugin(LlumletWorkerPlugin(CLUSTER_OVERRIDES))
        time.sleep(0.5)
        assert client.sync(client.scheduler.llumnix_status) is None  # no handler yet, nobody disconnected
        client.register_plugin(LlumnixSchedulerPlugin(CLUSTER_OVERRIDES))
        wait_for_instances(client, 2, timeout=30)
        assert len(client.scheduler_info()["workers"]) == 2

        llum = connect(client)
        config = load_config(CLUSTER_OVERRIDES)
        prompt = prompt_of(20, 30)
        stream = llum.stream(prompt, max_tokens=60)
        tokens = [next(stream)]
        started = {w: s["started_at"] for w, s in worker_statuses(client).items()}
        # Registering again is a no-op (idempotent): the engine keeps running the request.
        client.register_plugin(LlumletWorkerPlugin(CLUSTER_OVERRIDES))
        client.register_plugin(LlumnixSchedulerPlugin(CLUSTER_OVERRIDES))
        tokens += list(stream)
        assert tokens == reference_tokens(config, prompt, 60)
        assert {w: s["started_at"] for w, s in worker_statuses(client).items()} == started
        wait_until(lambda: llum.instances()[stream.instance]["num_received"] == 1, 10, what="report of the request")
        assert_workers_clean(client)
        llum.close()


def test_preload_installs_both_plugins_and_the_example_script_uses_them(tmp_path):
    # The tiny model's vocabulary, as examples/existing_cluster.py asks, so that its text decodes.
    env = {"DASK_LLUMDASK__SIM_ENGINE__TOTAL_BLOCKS": "96", "DASK_LLUMDASK__SIM_ENGINE__VOCAB_SIZE": "512"}
    with ProcessCluster(tmp_path, n_workers=2, env=env) as processes, \
            Client(processes.address, timeout=30) as client:
        wait_for_instances(client, 2, timeout=60)
        llum = connect(client)
        rows = llum.instances().rows
        assert [row["total_blocks"] for row in rows] == [96, 96]  # dask.config reached the workers
        prompt = prompt_of(21, 25)
        result = llum.generate(prompt, max_tokens=20, timeout=30)
        config = load_config({"sim-engine": {"total-blocks": 96, "vocab-size": 512}})
        assert result.token_ids == reference_tokens(config, prompt, 20)
        llum.close()
        script = Path(__file__).parents[2] / "examples" / "existing_cluster.py"
        done = subprocess.run([sys.executable, str(script), processes.address], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "text: '" in done.stdout and "'completion_tokens': " in done.stdout
        assert done.stdout.count("normal") >= 2  # both instances in its table
        assert_workers_clean(client)
