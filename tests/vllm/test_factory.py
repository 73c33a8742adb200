"""From llumdask's vllm-engine configuration to vLLM engine arguments."""

from __future__ import annotations

import dataclasses

import pytest

from llumdask.config import ConfigError, VllmEngineConfig
from llumdask.engine.vllm.factory import (
    check_engine_arguments, engine_arguments, resolve_model, usable_kv_bytes, worker_processes,
)
from llumdask.tiny_model import DEFAULT_KV_CACHE_BYTES, STAMP_FILE


def test_typed_keys_and_pass_through_become_one_set_of_engine_arguments():
    config = VllmEngineConfig(model="org/m", dtype="half", max_model_len=512,
                              engine_args={"max-num-seqs": 8, "swap_space": 1})
    assert engine_arguments(config) == {"dtype": "half", "max_model_len": 512, "tensor_parallel_size": 1,
                                        "enforce_eager": True, "max_num_seqs": 8, "swap_space": 1}


def test_a_pass_through_argument_spelt_twice_is_named():
    config = VllmEngineConfig(engine_args={"max-num-seqs": 8, "max_num_seqs": 4})
    with pytest.raises(ConfigError, match=r"^llumdask\.vllm-engine\.engine-args\.max_num_seqs is given twice"):
        engine_arguments(config)


def test_the_default_tiny_model_gets_a_small_kv_cache_unless_one_is_configured(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = resolve_model(VllmEngineConfig())
    assert model == str(tmp_path / "llumdask" / "tiny-llama") and (tmp_path / "llumdask" / "tiny-llama" / STAMP_FILE).is_file()
    assert engine_arguments(VllmEngineConfig())["kv_cache_memory_bytes"] == DEFAULT_KV_CACHE_BYTES
    assert "kv_cache_memory_bytes" not in engine_arguments(VllmEngineConfig(gpu_memory_utilization=0.5))
    assert "kv_cache_memory_bytes" not in engine_arguments(VllmEngineConfig(model="org/m"))


def test_worker_processes_count_devices_beyond_the_first():
    assert worker_processes(VllmEngineConfig()) == 0
    assert worker_processes(VllmEngineConfig(tensor_parallel_size=2, engine_args={"pipeline_parallel_size": 2})) == 4


@pytest.mark.vllm
def test_engine_arguments_are_checked_against_vllm(vllm_ready):
    from vllm import EngineArgs

    # Contract: EngineArgs is a dataclass with a field for every typed key.
    typed = {f.name for f in dataclasses.fields(VllmEngineConfig)} - {"model", "engine_args"}
    assert typed <= {f.name for f in dataclasses.fields(EngineArgs)}
    check_engine_arguments(engine_arguments(VllmEngineConfig(engine_args={"max_num_seqs": 8})))
    with pytest.raises(ConfigError, match=r"engine-args\.max_num_seq is not a vLLM engine argument; did you mean max_num_seqs"):
        check_engine_arguments(["max_num_seq"])


@pytest.mark.vllm
def test_usable_kv_bytes_are_the_sequences_vllm_admits_at_full_length(vllm_ready, tiny_model):
    # The tiny model: 2 layers, K and V, 2 KV heads of 64 dimensions.
    per_token = {"bfloat16": 2 * 2 * 2 * 64 * 2, "float32": 2 * 2 * 2 * 64 * 4}
    for dtype, seqs, length in (("bfloat16", 8, 512), ("float32", 8, 512), ("float32", 32, 1024)):
        config = VllmEngineConfig(model=str(tiny_model), dtype=dtype, max_model_len=length,
                                  engine_args={"max_num_seqs": seqs})
        assert usable_kv_bytes(config) == seqs * length * per_token[dtype]


def test_a_daemonic_worker_refuses_an_instance_that_needs_vllm_worker_processes(monkeypatch):
    import multiprocessing
    from types import SimpleNamespace

    from llumdask.config import load_config
    from llumdask.plugins import worker

    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))
    config = load_config({"engine": "vllm", "vllm-engine": {"tensor-parallel-size": 2}})
    with pytest.raises(RuntimeError, match=r"set distributed\.worker\.daemon to False"):
        worker.make_engine(config, "instance", lambda: 0.0)


def test_local_vllm_workers_get_their_share_of_cores_no_memory_limit_and_children_when_needed(monkeypatch):
    import dask
    from dask.system import CPU_COUNT

    from llumdask.clusters.local import _prepare_vllm_workers
    from llumdask.config import load_config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with dask.config.set({"distributed.worker.daemon": True}):
        kwargs: dict = {}
        _prepare_vllm_workers(load_config({"engine": "vllm"}), 2, kwargs)
        assert kwargs == {"env": {"OMP_NUM_THREADS": str(max(1, CPU_COUNT // 2))}, "memory_limit": 0}
        assert dask.config.get("distributed.worker.daemon") is True
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's own setting wins
        kwargs = {}
        _prepare_vllm_workers(load_config({"engine": "vllm"}), 2, kwargs)
        assert kwargs["env"] == {"OMP_NUM_THREADS": "3"}
        _prepare_vllm_workers(load_config({"engine": "vllm", "vllm-engine": {"tensor-parallel-size": 2}}), 2, {})
        assert dask.config.get("distributed.worker.daemon") is False
