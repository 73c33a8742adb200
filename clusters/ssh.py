"""llumdask on fixed machines over SSH (`distributed.SSHCluster`), one engine instance per worker.

`hosts[0]` runs the scheduler; every further entry runs one worker, so one instance (list a
machine once per instance it should hold). On GPU machines pass
``worker_class="dask_cuda.CUDAWorker"`` and list each machine once: dask-cuda starts a worker per
GPU there, each pinned to its device (say how many instances to wait for with `instances`).
The plugins are installed from this process once the cluster is up, so the remote shells need no
llumdask environment, only the same Python environment (`remote_python`).
Hosts are fixed: scaling can drain an instance by migration and close its worker
(`LlumnixAdaptive`), never add a machine; `cluster.scale(n)` only restarts workers on listed hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
from distributed import Security, SpecCluster
from distributed.deploy.ssh import SSHCluster

from llumdask.clusters.instances import start_instances
from llumdask.config import load_config


def ssh_cluster(
    hosts: Sequence[str],
    config_overrides: dict[str, Any] | None = None,
    *,
    connect_options: dict[str, Any] | list[dict[str, Any]] | None = None,
    remote_python: str | list[str] | None = None,
    worker_options: dict[str, Any] | None = None,
    worker_class: str = "distributed.Nanny",
    instances: int | None = None,
    dashboard_address: str = ":8787",
    security: Security | None = None,
    timeout: float = 120.0,
) -> SpecCluster:
    """Start the scheduler on `hosts[0]` and an instance per further entry; return once every one
    is ready (or `instances` of them, where a worker class starts several per host). `connect_options`
    are asyncssh's (port, username, client_keys, known_hosts), one dict for all hosts or one per
    host; `config_overrides` a partial ``llumdask`` section. With `security` (mutual TLS, e.g.
    `llumdask.clusters.certs.security(DIR)` for certificates naming every host) every channel of
    the cluster runs over TLS: Dask's comms, KV stages and token streams. The processes started
    now get it through the Dask configuration they inherit; for workers a later `cluster.scale`
    starts, keep the same TLS settings in your Dask configuration (`tls_config` gives them)."""
    hosts = list(hosts)
    if len(hosts) < 2 or not all(isinstance(h, str) and h for h in hosts):
        raise ValueError(f"hosts: the scheduler's host, then one entry per instance; got {hosts!r}")
    overrides = dict(config_overrides or {})
    load_config(overrides)  # a bad override fails here, not on every machine
    options = {"nthreads": 1, **(worker_options or {})}
    if options["nthreads"] != 1:
        raise ValueError("an instance's worker runs one task thread (nthreads=1): its engine has its own")
    protocol = {"protocol": "tls://"} if security is not None else {}
    # The remote processes get this process's Dask configuration, not its Security object.
    with dask.config.set(tls_config(security) if security is not None else {}):
        cluster = SSHCluster(hosts, connect_options=connect_options or {}, worker_options=options,
                             scheduler_options={"port": 0, "dashboard_address": dashboard_address, **protocol},
                             worker_class=worker_class, remote_python=remote_python, security=security)
    return start_instances(cluster, overrides, instances or len(hosts) - 1, timeout, adaptive=False)


def tls_config(security: Security) -> dict[str, Any]:
    """The Dask configuration under which a process uses `security`'s certificates and keys
    (files or PEM text alike) for every role, as `SSHCluster` hands its configuration to the
    scheduler and workers it starts."""
    config: dict[str, Any] = {"distributed.comm.require-encryption": security.require_encryption,
                              "distributed.comm.tls.ca-file": security.tls_ca_file}
    for role in ("scheduler", "worker", "client"):
        config[f"distributed.comm.tls.{role}.cert"] = getattr(security, f"tls_{role}_cert")
        config[f"distributed.comm.tls.{role}.key"] = getattr(security, f"tls_{role}_key")
    return config
