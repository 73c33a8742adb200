"""llumdask on a SLURM cluster (`dask_jobqueue.SLURMCluster`): engine instances in batch jobs.

A job holds `instances_per_job` instances, one Dask worker process each with one task thread
(the engine computes on its own threads: `cpus_per_instance` CPUs and `gpus_per_instance` GPUs
are asked of SLURM per instance). The plugins are installed from this process, their
configuration travelling with them, so job scripts need no llumdask environment. With
`adaptive`, the freeness band sizes the cluster: a deficit submits jobs, and a job is cancelled
only once every instance in it is drained (its requests migrated away), so scale-in drops nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import dask
from distributed import SpecCluster

from llumdask.clusters.instances import start_instances
from llumdask.config import load_config


def slurm_job_options(
    instances_per_job: int = 1,
    *,
    cpus_per_instance: int = 1,
    gpus_per_instance: int = 0,
    memory_per_instance: str = "16GB",
    walltime: str = "24:00:00",
    queue: str | None = None,
    account: str | None = None,
    python: str | None = None,
    log_directory: str | None = None,
    job_extra_directives: tuple[str, ...] = (),
) -> dict[str, Any]:
    """SLURMCluster's arguments for jobs of `instances_per_job` instances; `python` is the
    interpreter the jobs run (this one's by default: the same environment on a shared file
    system), `log_directory` where SLURM writes their output."""
    for name, value, low in (("instances_per_job", instances_per_job, 1), ("cpus_per_instance", cpus_per_instance, 1),
                             ("gpus_per_instance", gpus_per_instance, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    memory = dask.utils.parse_bytes(memory_per_instance) * instances_per_job
    directives = list(job_extra_directives)
    if gpus_per_instance:
        directives.append(f"--gres=gpu:{gpus_per_instance * instances_per_job}")
    return {
        "cores": instances_per_job,  # one task thread per worker
        "processes": instances_per_job,
        "job_cpu": cpus_per_instance * instances_per_job,
        "memory": dask.utils.format_bytes(memory).replace(" ", ""),
        "walltime": walltime,
        "queue": queue,
        "account": account,
        "python": python or sys.executable,
        "log_directory": log_directory,
        "job_extra_directives": directives,
    }


def slurm_cluster(
    jobs: int,
    config_overrides: dict[str, Any] | None = None,
    *,
    adaptive: bool | None = None,
    timeout: float = 900.0,
    adapt_interval: str = "1s",
    **job_options: Any,
) -> SpecCluster:
    """Submit `jobs` jobs (see `slurm_job_options` for `job_options`) and wait until their
    instances are ready; with `adaptive` (default: ``scaling.enabled``) the band scales between
    ``scaling.min-instances`` and ``scaling.max-instances`` instances."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as exc:
        raise ImportError(f"slurm_cluster needs dask-jobqueue (pip install 'llumdask[slurm]'): {exc}") from None
    overrides = dict(config_overrides or {})
    load_config(overrides)  # a bad override fails here, not in every job
    options = slurm_job_options(**job_options)
    cluster = SLURMCluster(**options, scheduler_options={"dashboard_address": ":0"})
    return start_instances(cluster, overrides, jobs * options["processes"], timeout,
                           scale=lambda: cluster.scale(jobs=jobs), adaptive=adaptive, interval=adapt_interval)
