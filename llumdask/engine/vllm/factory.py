"""A `VllmEngine` from llumdask's configuration (the ``llumdask.vllm-engine`` section).

The typed keys and the passed-through ``engine-args`` become one set of vLLM engine arguments
here, so that a deployment (a Dask worker, ``llumdask serve``) and a test build an instance
the same way, and a misspelt argument fails before any engine starts, naming its key.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from llumdask.config import ConfigError, VllmEngineConfig
from llumdask.tiny_model import DEFAULT_KV_CACHE_BYTES, build_tiny_model, default_model_dir

if TYPE_CHECKING:
    from llumdask.engine.vllm.engine import VllmEngine

_KEY = "llumdask.vllm-engine"
# The typed keys of VllmEngineConfig that are vLLM engine arguments of the same name.
_TYPED_ARGS = ("dtype", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization",
               "tensor_parallel_size", "enforce_eager")


def resolve_model(config: VllmEngineConfig) -> str:
    """The model to load: the configured one, or the offline tiny model (built on first use)."""
    return config.model if config.model is not None else str(build_tiny_model(default_model_dir()))


def engine_arguments(config: VllmEngineConfig) -> dict[str, Any]:
    """vLLM engine keyword arguments (model excluded). Pass-through names may be spelt with
    dashes, as YAML and command lines write them; vLLM's are Python names."""
    passed: dict[str, Any] = {}
    for name, value in config.engine_args.items():
        python_name = name.replace("-", "_")
        if python_name in passed:
            raise ConfigError(f"{_KEY}.engine-args.{name}", f"is given twice (also as {python_name})")
        passed[python_name] = value
    typed = {name: getattr(config, name) for name in _TYPED_ARGS if getattr(config, name) is not None}
    if config.model is None and config.kv_cache_memory_bytes is None and config.gpu_memory_utilization is None:
        typed["kv_cache_memory_bytes"] = DEFAULT_KV_CACHE_BYTES
    return {**passed, **typed}


def check_engine_arguments(names: Iterable[str]) -> None:
    """ConfigError for a name vLLM's EngineArgs does not have, with the closest one it has."""
    from vllm import EngineArgs

    known = [f.name for f in dataclasses.fields(EngineArgs)]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{_KEY}.engine-args.{name}", f"is not a vLLM engine argument{hint}")


def usable_kv_bytes(config: VllmEngineConfig) -> int:
    """The most KV cache one instance can ever fill: vLLM's `max_num_seqs` sequences of
    `max_model_len` tokens, both as vLLM resolves them for this model, platform and arguments.
    Memory past it holds no request (at most cached prefixes), and a CPU instance zeroes it all
    at start."""
    from vllm import EngineArgs
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_dtype_size

    from llumdask.engine.vllm.engine import engine_args_for

    vllm_config = EngineArgs(**engine_args_for(resolve_model(config), engine_arguments(config))).create_engine_config()
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    element = get_dtype_size(model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype])
    per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * element
    return vllm_config.scheduler_config.max_num_seqs * model.max_model_len * per_token


def worker_processes(config: VllmEngineConfig) -> int:
    """Processes vLLM starts for one instance beyond its own: 0 unless it is split over devices."""
    args = engine_arguments(config)
    world = args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1)
    return world if world > 1 else 0


def create_engine(config: VllmEngineConfig, clock: Callable[[], float] = time.monotonic) -> "VllmEngine":
    """A running vLLM instance as `config` describes it."""
    from llumdask.engine.vllm.engine import VllmEngine

    args = engine_arguments(config)
    check_engine_arguments(args)
    return VllmEngine(resolve_model(config), args, clock=clock)
