"""llumdask on the GPUs of one machine (`dask_cuda.LocalCUDACluster`): one instance per GPU.

dask-cuda starts one worker per GPU and pins each to its device (CUDA_VISIBLE_DEVICES rotated
per worker), so each vLLM instance sees one GPU and takes its memory share of that GPU alone
(`vllm-engine.gpu-memory-utilization`, 0.9 by default) instead of dividing one device between
several. Adaptive scaling adds instances up to the GPU count and closes only drained ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
from distributed import LocalCluster

from llumdask.clusters.instances import start_instances
from llumdask.config import load_config


def cuda_cluster_options(gpus: Sequence[int], dashboard_address: str = "127.0.0.1:8787") -> dict[str, Any]:
    """LocalCUDACluster's arguments for an instance on each of `gpus` (device ordinals)."""
    gpus = list(gpus)
    if not gpus or len(set(gpus)) != len(gpus) or not all(isinstance(g, int) and g >= 0 for g in gpus):
        raise ValueError(f"gpus: distinct device ordinals, at least one; got {gpus!r}")
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
        "n_workers": len(gpus),
        "threads_per_worker": 1,  # the engine has its own thread
        "resources": {"GPU": 1},
        "memory_limit": 0,  # vLLM sizes the instance's memory, not Dask
        "dashboard_address": dashboard_address,
    }


def cuda_cluster(
    gpus: Sequence[int],
    config_overrides: dict[str, Any] | None = None,
    *,
    adaptive: bool | None = None,
    timeout: float = 900.0,
    dashboard_address: str = "127.0.0.1:8787",
) -> LocalCluster:
    """Start a vLLM instance on each of `gpus` and wait until all are ready; with `adaptive`
    (default: ``scaling.enabled``) the freeness band scales between ``scaling.min-instances`` and
    the GPU count."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise ImportError(f"cuda_cluster needs dask-cuda (pip install 'llumdask[cuda]'): {exc}") from None
    overrides = dask.config.merge(dict(config_overrides or {}), {"engine": "vllm"})
    load_config(overrides)  # a bad override fails here, not in every worker
    cluster = LocalCUDACluster(**cuda_cluster_options(gpus, dashboard_address))
    return start_instances(cluster, overrides, len(gpus), timeout, adaptive=adaptive, maximum=len(gpus))
