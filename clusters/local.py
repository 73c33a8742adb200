"""A local CPU cluster of llumdask instances: one Dask worker process per engine instance.

The scheduler plugin is passed to the scheduler at construction, so it is running before any
worker could send a llumdask message; the worker plugin is registered on the scheduler before
the workers start, so every worker (including ones added later by scaling) sets up a llumlet.
The factory returns once the instances are ready to be dispatched to.
"""

from __future__ import annotations

import time
from typing import Any

import dask
from distributed import Client, LocalCluster

from llumdask.config import load_config
from llumdask.plugins.adaptive import LlumnixAdaptive
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin
from llumdask.plugins.worker import LlumletWorkerPlugin


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
    cluster = LocalCluster(
        n_workers=0,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=dashboard_address,
        scheduler_kwargs={"plugins": [LlumnixSchedulerPlugin(overrides)]},
        **cluster_kwargs,
    )
    try:
        with Client(cluster) as client:
            client.register_plugin(LlumletWorkerPlugin(overrides))
            cluster.scale(n_instances)
            wait_for_instances(client, n_instances, timeout)
        if config.scaling.enabled if adaptive is None else adaptive:
            cluster.adapt(Adaptive=LlumnixAdaptive, minimum=config.scaling.min_instances,
                          maximum=config.scaling.max_instances, interval=adapt_interval)
    except BaseException:
        cluster.close()
        raise
    return cluster


def wait_for_instances(client: Client, n: int, timeout: float = 60.0) -> None:
    """Block until at least `n` instances are ready (registered with the scheduler plugin)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = client.sync(client.scheduler.llumnix_status)["instances"]
        if sum(1 for row in rows if row["ready"]) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sum(1 for r in rows if r['ready'])} of {n} llumdask instances ready after {timeout} s")
        time.sleep(0.1)
