"""A local CPU cluster of llumdask instances: one Dask worker process per engine instance.

The scheduler plugin is passed to the scheduler at construction, so it is running before any
worker could send a llumdask message; the worker plugin is registered on the scheduler before
the workers start, so every worker (including ones added later by scaling) sets up a llumlet.
The factory returns once the instances are ready to be dispatched to.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dask
from dask.system import CPU_COUNT
from distributed import LocalCluster

from llumdask.clusters.instances import start_instances
from llumdask.config import LlumdaskConfig, load_config
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin

logger = logging.getLogger(__name__)


def local_cluster(
    n_instances: int = 2,
    engine: str = "sim",
    config_overrides: dict[str, Any] | None = None,
    *,
    timeout: float = 60.0,
    adaptive: bool | None = None,
    adapt_interval: str = "500ms",
    dashboard_address: str = "127.0.0.1:0",
    **cluster_kwargs: Any,
) -> LocalCluster:
    """Start `n_instances` instances on this machine and wait until each is ready.

    `config_overrides` is a (partial, kebab-case) ``llumdask`` section applied on the scheduler
    and on every worker on top of dask.config, e.g. ``{"migration": {"enabled": False}}``.
    `adaptive` (default: ``scaling.enabled``) lets `LlumnixAdaptive` add instances and close
    drained ones, between ``scaling.min-instances`` and ``scaling.max-instances``.
    `cluster_kwargs` go to `LocalCluster` (e.g. ``memory_limit``).
    """
    if not isinstance(n_instances, int) or isinstance(n_instances, bool) or n_instances < 0:
        raise ValueError(f"n_instances must be an integer >= 0, got {n_instances!r}")
    overrides = dask.config.merge(dict(config_overrides or {}), {"engine": engine})
    config = load_config(overrides)  # fail here, not in every worker, on a bad override
    if config.engine == "vllm":
        _prepare_vllm_workers(config, n_instances, cluster_kwargs)
    cluster = LocalCluster(
        n_workers=0,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=dashboard_address,
        scheduler_kwargs={"plugins": [LlumnixSchedulerPlugin(overrides)]},
        **cluster_kwargs,
    )
    return start_instances(cluster, overrides, n_instances, timeout, scale=lambda: cluster.scale(n_instances),
                           adaptive=adaptive, interval=adapt_interval)


def _prepare_vllm_workers(config: LlumdaskConfig, n_instances: int, cluster_kwargs: dict[str, Any]) -> None:
    """What vLLM instances need from their worker processes.

    Threads: Dask starts workers with OMP_NUM_THREADS=1 (sized for one task thread); a CPU
    engine computes with torch's intra-op threads, so each instance gets its share of the cores,
    or the OMP_NUM_THREADS this process was started with, when it was given one.
    Memory: the nanny restarts a worker whose memory passes its share of the machine; an
    instance's weights and KV cache are sized by vLLM (kv-cache-memory-bytes,
    gpu-memory-utilization), not by Dask, so the limit is off.
    Processes: an instance split over several devices starts vLLM worker processes, which a
    daemonic Dask worker may not. The nanny reads that setting whenever it (re)starts a worker,
    so it is set for this process, not only while the cluster starts.
    """
    from llumdask.engine.vllm.factory import worker_processes

    given = os.environ.get("OMP_NUM_THREADS")
    threads = given or str(max(1, CPU_COUNT // max(1, n_instances)))
    logger.info("each vLLM instance computes on %s torch thread(s) (%s)", threads,
                "OMP_NUM_THREADS of this process" if given else f"{CPU_COUNT} cores / {n_instances} instances")
    cluster_kwargs.setdefault("env", {"OMP_NUM_THREADS": threads})
    cluster_kwargs.setdefault("memory_limit", 0)
    if worker_processes(config.vllm_engine):
        dask.config.set({"distributed.worker.daemon": False})
