"""llumdask on the GPUs of one machine (`dask_cuda.LocalCUDACluster`): instances pinned to GPUs.

dask-cuda starts one worker per GPU and pins each to its device (CUDA_VISIBLE_DEVICES rotated
per worker), so each vLLM instance sees one GPU and takes its memory share of that GPU alone
(`vllm-engine.gpu-memory-utilization`, 0.9 by default) instead of dividing one device between
several. With `instances_per_gpu` > 1 each GPU gets that many workers (copies of its worker's
spec, so the same pinning), and a vLLM instance's default share becomes 0.9 / instances_per_gpu.
Adaptive scaling adds instances up to the GPU count and closes only drained ones (one instance
per GPU: dask-cuda names a worker after its device, so it can only add the GPU's first).

The sim engine runs here too (`engine: sim`), its KV on its worker's GPU
(`sim-engine.kv-device: cuda` unless set): the whole Dask migration path on GPUs without vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import dask
from distributed import LocalCluster

from llumdask.clusters.instances import start_instances
from llumdask.config import load_config

GPU_MEMORY_SHARE = 0.9  # vLLM's default gpu_memory_utilization, split among a GPU's instances


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
        "memory_limit": 0,  # the engine sizes the instance's memory, not Dask
        "dashboard_address": dashboard_address,
    }


def cuda_overrides(config_overrides: dict[str, Any] | None, instances_per_gpu: int = 1) -> dict[str, Any]:
    """The configuration the instances get: vLLM unless `engine` says otherwise; a sim engine's KV
    on its GPU; a vLLM instance's default memory share divided among the GPU's instances."""
    if not isinstance(instances_per_gpu, int) or instances_per_gpu < 1:
        raise ValueError(f"instances_per_gpu: a positive integer; got {instances_per_gpu!r}")
    overrides = dask.config.merge({"engine": "vllm"}, dict(config_overrides or {}))
    if overrides["engine"] == "sim":
        overrides = dask.config.merge({"sim-engine": {"kv-device": "cuda"}}, overrides)
    elif instances_per_gpu > 1:
        share = round(GPU_MEMORY_SHARE / instances_per_gpu, 3)
        overrides = dask.config.merge({"vllm-engine": {"gpu-memory-utilization": share}}, overrides)
    load_config(overrides)  # a bad override fails here, not in every worker
    return overrides


def cuda_cluster(
    gpus: Sequence[int],
    config_overrides: dict[str, Any] | None = None,
    *,
    instances_per_gpu: int = 1,
    adaptive: bool | None = None,
    timeout: float = 900.0,
    dashboard_address: str = "127.0.0.1:8787",
) -> LocalCluster:
    """Start `instances_per_gpu` instances on each of `gpus` and wait until all are ready; with
    `adaptive` (default: ``scaling.enabled``, off with several instances per GPU) the freeness band scales
    between ``scaling.min-instances`` and the GPU count."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise ImportError(f"cuda_cluster needs dask-cuda (pip install 'llumdask[cuda]'): {exc}") from None
    overrides = cuda_overrides(config_overrides, instances_per_gpu)
    if instances_per_gpu > 1:
        if adaptive:
            raise ValueError("cuda_cluster: adaptive scaling runs one instance per GPU, not instances_per_gpu > 1")
        adaptive = False
    cluster = LocalCUDACluster(**cuda_cluster_options(gpus, dashboard_address))

    def share_gpus() -> None:
        for name, spec in list(cluster.worker_spec.items()):
            for k in range(1, instances_per_gpu):
                cluster.worker_spec[f"{name}-{k}"] = copy.deepcopy(spec)
        cluster.scale(len(cluster.worker_spec))

    return start_instances(cluster, overrides, len(gpus) * instances_per_gpu, timeout,
                           scale=share_gpus if instances_per_gpu > 1 else None,
                           adaptive=adaptive, maximum=len(gpus))
