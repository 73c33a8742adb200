"""The arguments the GPU and SLURM factories hand to dask-cuda and dask-jobqueue (running them
needs GPUs, or a SLURM cluster: tests/dask/test_slurm.py starts one)."""

from __future__ import annotations

import sys

import pytest

from llumdask.clusters.cuda import cuda_cluster_options, cuda_overrides
from llumdask.clusters.slurm import slurm_job_options


def test_one_instance_per_gpu_each_pinned_to_its_device():
    options = cuda_cluster_options([0, 2, 3])
    assert options["CUDA_VISIBLE_DEVICES"] == "0,2,3" and options["n_workers"] == 3
    assert options["threads_per_worker"] == 1 and options["resources"] == {"GPU": 1}
    assert options["memory_limit"] == 0  # vLLM sizes an instance's memory, not Dask


@pytest.mark.parametrize("gpus", [[], [0, 0], [-1], ["0"]])
def test_gpus_must_be_distinct_ordinals(gpus):
    with pytest.raises(ValueError, match="gpus"):
        cuda_cluster_options(gpus)


def test_a_slurm_job_asks_per_instance_for_cpus_gpus_and_memory():
    options = slurm_job_options(4, cpus_per_instance=8, gpus_per_instance=1, memory_per_instance="32GB",
                                queue="gpu", account="lab")
    assert (options["processes"], options["cores"]) == (4, 4)  # a worker per instance, one task thread each
    assert options["job_cpu"] == 32 and options["memory"] == "119.21GiB"
    assert options["job_extra_directives"] == ["--gres=gpu:4"]
    assert (options["queue"], options["account"], options["python"]) == ("gpu", "lab", sys.executable)
    assert slurm_job_options()["job_extra_directives"] == []  # CPU instances ask no GPU


@pytest.mark.parametrize("field", ["instances_per_job", "cpus_per_instance"])
def test_slurm_counts_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        slurm_job_options(**{field: 0})


def test_gpu_instances_run_vllm_unless_told_and_a_sim_engine_keeps_its_kv_on_its_gpu():
    assert cuda_overrides(None)["engine"] == "vllm"
    sim = cuda_overrides({"engine": "sim"})
    assert sim["sim-engine"]["kv-device"] == "cuda"
    assert cuda_overrides({"engine": "sim", "sim-engine": {"kv-device": "cuda:1"}})["sim-engine"]["kv-device"] == "cuda:1"


def test_instances_sharing_a_gpu_divide_vllms_default_memory_share_only():
    assert cuda_overrides(None, 3)["vllm-engine"]["gpu-memory-utilization"] == 0.3
    assert "vllm-engine" not in cuda_overrides(None, 1)
    mine = {"vllm-engine": {"gpu-memory-utilization": 0.4}}
    assert cuda_overrides(mine, 2)["vllm-engine"]["gpu-memory-utilization"] == 0.4


@pytest.mark.parametrize("overrides, per_gpu, match", [
    (None, 0, "instances_per_gpu"), (None, 1.5, "instances_per_gpu"),
    ({"engine": "sim", "sim-engine": {"kv-device": "gpu"}}, 1, "kv-device"),
])
def test_bad_gpu_cluster_settings_fail_before_any_worker_starts(overrides, per_gpu, match):
    with pytest.raises(ValueError, match=match):
        cuda_overrides(overrides, per_gpu)


def test_scaling_asks_for_no_more_instances_than_the_cluster_can_start():
    """A GPU cluster starts one instance per GPU at most: the scheduler plugin's bounds follow, or
    an instance asked for beyond them would count as on its way, and no other be asked for."""
    from llumdask.clusters.instances import at_most
    from llumdask.config import load_config

    overrides = {"sim-engine": {"total-blocks": 64}, "scaling": {"min-instances": 4}}
    scaling = load_config(at_most(overrides, 3)).scaling
    assert (scaling.max_instances, scaling.min_instances) == (3, 3)
    assert load_config(at_most(overrides, 3)).sim_engine.total_blocks == 64
    assert at_most(overrides, 16) == overrides and at_most(None, 16) == {}
    assert overrides == {"sim-engine": {"total-blocks": 64}, "scaling": {"min-instances": 4}}  # not changed
