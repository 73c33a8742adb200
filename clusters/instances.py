"""What every llumdask deployment does once its Dask cluster is up: install the two plugins, wait
for the instances, and let the freeness band size the cluster where it may (`start_instances`).

The plugins are registered from the client, so their configuration (a partial ``llumdask``
section) travels with them, pickled, to machines whose shells set no environment: the
scheduler plugin first (it must answer before any llumlet registers), then the worker plugin,
which Dask runs on every worker present and to come, each setting up one engine instance.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Callable

import dask
from distributed import Client, SpecCluster

from llumdask.config import load_config
from llumdask.plugins.adaptive import LlumnixAdaptive
from llumdask.plugins.control import Op, call
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin
from llumdask.plugins.worker import LlumletWorkerPlugin, startup_error


class InstanceStartupError(RuntimeError):
    """An instance could not start (its engine raised); the message carries the engine's error."""


def install_plugins(client: Client, config_overrides: dict[str, Any] | None = None) -> None:
    """The scheduler plugin, then the worker plugin, both with `config_overrides`; idempotent."""
    client.register_plugin(LlumnixSchedulerPlugin(config_overrides))
    client.register_plugin(LlumletWorkerPlugin(config_overrides))


def at_most(config_overrides: dict[str, Any] | None, maximum: int) -> dict[str, Any]:
    """`config_overrides` with scaling's instance bounds at most `maximum`, the most the cluster
    can start (its GPUs, say): instances asked for beyond it would count as on their way until
    given up on, and no other would be asked for meanwhile."""
    scaling = load_config(config_overrides).scaling
    if maximum >= scaling.max_instances:
        return dict(config_overrides or {})
    return dask.config.merge(config_overrides or {}, {"scaling": {
        "max-instances": maximum, "min-instances": min(scaling.min_instances, maximum)}})


def start_instances(cluster: SpecCluster, config_overrides: dict[str, Any], instances: int, timeout: float, *,
                    scale: Callable[[], None] | None = None, adaptive: bool | None = None,
                    maximum: int | None = None, interval: str = "1s") -> SpecCluster:
    """What every factory does once its cluster object exists: install the plugins, ask for the
    workers (`scale`, where the cluster does not start them itself), wait until `instances` are
    ready, then, with `adaptive` (default ``scaling.enabled``), let `LlumnixAdaptive` size it
    between ``scaling.min-instances`` and ``scaling.max-instances`` (or `maximum`). The cluster
    is closed if any of it fails."""
    if maximum is not None:
        config_overrides = at_most(config_overrides, maximum)
    scaling = load_config(config_overrides).scaling
    try:
        with Client(cluster) as client:
            install_plugins(client, config_overrides)
            if scale is not None:
                scale()
            wait_for_instances(client, instances, timeout)
        if scaling.enabled if adaptive is None else adaptive:
            top = scaling.max_instances if maximum is None else maximum
            cluster.adapt(Adaptive=LlumnixAdaptive, minimum=min(scaling.min_instances, top), maximum=top,
                          interval=interval)
    except BaseException:
        cluster.close()
        raise
    return cluster


def wait_for_instances(client: Client, n: int, timeout: float = 60.0,
                       check: Callable[[], None] | None = None) -> None:
    """Block until at least `n` instances are ready (registered with the scheduler plugin).

    An instance whose setup failed (a bad engine option, a model that does not load) raises
    `InstanceStartupError` with its error as soon as it is seen, instead of waiting out `timeout`.
    `check`, called while waiting, may raise to stop early (e.g. when a worker process exited).
    """
    deadline = time.monotonic() + timeout
    next_failure_check = time.monotonic()
    while True:
        if check is not None:
            check()
        rows = client.sync(call, client.scheduler, Op.STATUS)["instances"]
        if sum(1 for row in rows if row["ready"]) >= n:
            return
        if time.monotonic() >= next_failure_check:
            failures = {w: e for w, e in client.run(startup_error, on_error="ignore").items() if e}
            if failures:
                worker, error = sorted(failures.items())[0]
                raise InstanceStartupError(f"the llumdask instance on {worker} failed to start: {error}")
            next_failure_check = time.monotonic() + 1.0
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sum(1 for r in rows if r['ready'])} of {n} llumdask instances ready after {timeout} s")
        time.sleep(0.1)


def worker_statuses(client: Client, workers: Iterable[str] | None = None) -> dict[str, dict]:
    """Each live worker's llumlet status (`llumnix_worker_status`: blocks, work and migrations in
    flight, integrity), by address; with an asynchronous client, awaitable. A worker that is gone
    or not serving yet is left out. Asking a worker just killed can take Dask's whole connect
    timeout (a refused connection is retried), so a caller that killed one names the others."""
    return client.sync(_worker_statuses, client, workers)


async def _worker_statuses(client: Client, workers: Iterable[str] | None) -> dict[str, dict]:
    if workers is None:
        workers = (await client.scheduler.identity())["workers"]
    statuses = {}
    for worker in workers:
        try:
            statuses[worker] = await call(client.rpc(worker), Op.WORKER_STATUS)
        except OSError:
            continue
    return statuses
