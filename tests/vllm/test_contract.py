"""Pins every vLLM internal llumdask relies on (internals.py, kv_blocks.py, connector.py).

A vLLM upgrade that renames, moves or re-signs one of them fails here, naming it, rather than
somewhere inside a migration. Each check names the symbol in its id.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# (module, attribute path, parameters the call sites pass, in order)
SIGNATURES = [
    ("vllm.v1.engine.llm_engine", "LLMEngine.__init__",
     ["self", "vllm_config", "executor_class", "log_stats"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_request",
     ["self", "request_id", "prompt", "params", "arrival_time"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.abort_request", ["self", "request_ids"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.step", ["self"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine.collective_rpc", ["self", "method", "timeout", "args"]),
    ("vllm.v1.executor", "Executor.get_class", ["vllm_config"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler.get_kv_connector", ["self"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler.has_requests", ["self"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests",
     ["self", "request_ids", "finished_status"]),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", ["self", "request_id"]),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", ["self"]),
    ("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", ["self", "num_blocks"]),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks", ["self", "ordered_blocks"]),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", ["self"]),
    ("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
     ["self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id"]),
    ("vllm.v1.core.block_pool", "BlockPool.get_cached_block", ["self", "block_hash", "kv_cache_group_ids"]),
    ("vllm.v1.core.block_pool", "BlockPool.touch", ["self", "blocks"]),
    ("vllm.v1.core.kv_cache_utils", "hash_block_tokens",
     ["hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"]),
    ("vllm.utils.hashing", "get_hash_fn_by_name", ["hash_fn_name"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.__init__", ["self", "vllm_config", "role", "kv_cache_config"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.get_num_new_matched_tokens",
     ["self", "request", "num_computed_tokens"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.update_state_after_alloc",
     ["self", "request", "blocks", "num_external_tokens"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.build_connector_meta", ["self", "scheduler_output"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.request_finished", ["self", "request", "block_ids"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.start_load_kv", ["self", "forward_context"]),
    (CONNECTOR_BASE, "KVConnectorBase_V1.get_finished", ["self", "finished_req_ids"]),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", []),
]

# Abstract methods of the connector base: a new one would make ours uninstantiable.
CONNECTOR_ABSTRACT = {
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
}


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path", "params"), SIGNATURES, ids=[f"{m}.{p}" for m, p, _ in SIGNATURES])
def test_signature(vllm_ready, module, path, params):
    signature = inspect.signature(resolve(module, path))
    assert list(signature.parameters)[: len(params)] == params, f"{module}.{path}{signature}"


def test_connector_base_abstract_methods(vllm_ready):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert set(KVConnectorBase_V1.__abstractmethods__) == CONNECTOR_ABSTRACT


def test_scheduler_output_fields(vllm_ready):
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = SchedulerOutput.__dataclass_fields__
    assert {"num_scheduled_tokens", "has_sync_kv_loads", "finished_req_ids"} <= set(fields)


def test_forward_context_layers(vllm_ready):
    from vllm.forward_context import ForwardContext

    assert "no_compile_layers" in ForwardContext.__dataclass_fields__


def test_in_process_switch_is_read_by_the_cpu_platform(vllm_ready):
    """vllm/platforms/cpu.py turns the uni-process executor into the multi-process one unless
    VLLM_ENABLE_V1_MULTIPROCESSING is "0" (internals.require_in_process_executor)."""
    from vllm.platforms import cpu

    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in inspect.getsource(cpu)


def test_kv_cache_events(vllm_ready):
    """The events kv_events.py translates, and the publisher call internals.tap_kv_events
    intercepts (the scheduler publishes each step's events through it)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: F401
    from vllm.v1.core.sched.scheduler import Scheduler

    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name",
            "extra_keys"} <= set(BlockStored.__struct_fields__)
    assert "block_hashes" in BlockRemoved.__struct_fields__
    assert "self.kv_event_publisher.publish(" in inspect.getsource(Scheduler.update_from_output)


def test_running_engine_internals(vllm_engine):
    """The live objects internals.py and kv_blocks.py walk: in-process core, scheduler queues,
    request fields, block pool, and block-first KV tensors."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from llumdask.engine.vllm import internals
    from llumdask.engine.vllm.connector import LlumdaskMigrationConnector

    llm = vllm_engine.llm_engine
    assert isinstance(llm.engine_core, InprocClient)
    assert isinstance(llm.engine_core.engine_core.model_executor, UniProcExecutor)
    scheduler = internals.scheduler_of(llm)
    assert isinstance(scheduler, Scheduler)
    assert isinstance(scheduler.get_kv_connector(), LlumdaskMigrationConnector)
    for queue in ("running", "waiting", "kv_holding_waiting", "requests"):
        assert hasattr(scheduler, queue), f"Scheduler.{queue}"
    assert scheduler.enable_kv_cache_events and isinstance(scheduler.kv_event_publisher, internals.KvEventTap)
    pool = internals.block_pool_of(llm)
    assert isinstance(pool, BlockPool)
    assert pool.null_block.block_id == 0 and pool.blocks[0] is pool.null_block
    assert all(hasattr(pool.blocks[1], a) for a in ("block_id", "ref_cnt"))

    from llumdask.request import Request, SamplingParams

    vllm_engine.add_request(Request("contract", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
    vllm_engine.step()
    (live,) = internals.running_requests(scheduler)
    for attr in ("request_id", "num_computed_tokens", "num_tokens", "num_preemptions", "priority", "arrival_time"):
        assert isinstance(getattr(live, attr), (int, float, str)), f"vllm Request.{attr}"
    assert live.sampling_params.extra_args["llumdask_request_id"] == "contract"
    assert not live.is_finished() and live.status.name == "RUNNING"
    vllm_engine.abort_request("contract")

    assert pool.enable_caching, "prefix caching (resume adopts imported blocks as a prefix hit)"
    assert isinstance(live.block_hashes, list), "vllm Request.block_hashes"

    def layer_shapes(worker):
        from llumdask.engine.vllm.kv_blocks import kv_tensors

        return [tuple(kv.shape) for kv in kv_tensors(worker.model_runner.compilation_config.static_forward_context)]

    (shapes,) = llm.collective_rpc(layer_shapes)
    assert shapes and all(shape[0] == pool.num_gpu_blocks for shape in shapes), "KV tensors: block dimension first"
