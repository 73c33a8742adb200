"""The out-of-tree vLLM KV connector behind live migration of running requests.

vLLM (0.32/0.33) has no per-request pause and no way to add a request that already has output
tokens. Its v1 KV connector API (vllm/distributed/kv_transfer/kv_connector/v1/base.py,
`KVConnectorBase_V1`, marked experimental) gives the two hooks that make both possible:
a connector may keep a finished request's blocks, and may claim that tokens of a new request
already have KV. Migration is built from those hooks plus block-level access to the KV tensors.

Design (what each Engine primitive does on vLLM)
------------------------------------------------
Both engines run vLLM in-process (`LLMEngine(..., multiprocess_mode=False)`, uni-process
executor; see engine.py), so the scheduler, its `KVCacheManager` and `BlockPool` are in reach
between steps, and `LLMEngine.collective_rpc(fn)` runs `fn(worker)` on every worker (a direct
call with the uni-process executor, an RPC per tensor-parallel rank otherwise).

Source, while the request decodes (stages 0..k):
  completed_blocks  `Scheduler.requests[id].num_computed_tokens // block_size`: with synchronous
                    scheduling (`async_scheduling=False`, so `num_in_flight_tokens == 0`) every
                    block below it is full and final.
  export_blocks     block ids from `KVCacheManager.get_block_ids(id)[0][i:j]`;
                    `collective_rpc(gather_blocks)` indexes each attention layer's KV tensor
                    (`model_runner.compilation_config.static_forward_context[name].kv_cache`,
                    block dimension first) with those ids: one gather per layer into one
                    contiguous uint8 buffer (blocks x ranks x layers x bytes per block):
                    "block fusion" (kv_blocks.py).
Source, last stage:
  pause             mark the request held in this connector, then `LLMEngine.abort_request`.
                    vLLM's `Scheduler.finish_requests` calls `request_finished(request,
                    block_ids)`; returning True keeps every block (the request stays in
                    `Scheduler.requests`, finished). The tail blocks export as above.
  free_migrated     COMMIT: the connector lists the id in the next step's metadata; the worker
                    side reports it as `finished_sending` from `get_finished`, and the
                    scheduler's `_update_from_kv_xfer_finished` frees the blocks. One engine
                    step (an empty one is enough) completes the release.
  unpause           rollback: the same as resume below, on the source: its full blocks are
                    still in the prefix cache (vLLM caches blocks as they fill), its tail
                    block is read into a buffer; the held blocks are released after the step
                    that loads it, as after COMMIT.
Destination:
  reserve_blocks    `BlockPool.get_new_blocks(n)` (ref count 1, out of the free queue, so the
                    scheduler cannot hand them out); `release_reservation` =
                    `BlockPool.free_blocks`.
  import_blocks     `collective_rpc(scatter)` writes the fused buffer into the reserved blocks.
  resume            `LLMEngine.add_request` with prompt = prompt + generated tokens and
                    max_tokens reduced by the generated count; the migration id rides in
                    `SamplingParams.extra_args`. Zero copy for the full blocks: the reserved
                    blocks that KV fills completely are registered in the prefix cache under
                    the new request's own block hashes (`BlockPool.cache_full_blocks` with
                    the scheduler's `Request`, whose `block_hashes` vLLM computed at add time),
                    so `Scheduler.schedule` finds them as a local prefix hit and adopts them
                    as the request's blocks (prefix caching is therefore always on). The
                    partly filled tail block is read into a one-block buffer and its reserved
                    block freed at once. `get_num_new_matched_tokens(request, local_hit)`
                    then answers (tokens with KV - local_hit, load_async=False): the tail
                    (every token but the last sampled one is covered); the scheduler allocates
                    a block and calls `update_state_after_alloc(request, blocks, n)`;
                    `build_connector_meta` puts (block, buffer) into this step's metadata and,
                    the load being synchronous (`SchedulerOutput.has_sync_kv_loads`), the
                    worker side's `start_load_kv` writes it before the forward pass. The
                    forward computes exactly one token (the last sampled one) and samples the
                    next. After that step the reservation's own references are dropped: the
                    request alone holds its blocks. Should a full block not be hit (another
                    cached block with the same hash may serve instead, which is as good), the
                    connector copies it from the reserved block instead.

The worker side keeps no state: everything it does comes in the step's metadata and goes to
the KV tensors of the forward context's attention layers (`ForwardContext.no_compile_layers
[name].kv_cache`). That matters because vLLM keeps one worker-side connector per process
(`kv_transfer_state._KV_CONNECTOR_AGENT`): two engines in one process share it, and only the
metadata and the forward context say which engine's step it is serving. For the same reason
an engine without this connector cannot share a process with one that has it (its steps would
meet this connector with no metadata): every llumdask engine installs it.

Downtime, then, is: the abort, a one-or-two-block export and import, the resume bookkeeping,
and one decode step on the destination, independent of the sequence length but for that
step's attention over the context. The destination needs no block beyond its reservation
plus the tail's, so a committed request never waits for memory there.

Sampling state that cannot move exactly (decided per request by `migration_refusal`):
a re-added request restarts vLLM's per-request state with its output as part of the prompt.
Seeded random sampling (the generator restarts from the seed) and presence / frequency
penalties (they count output tokens only) would change the continuation, so such requests are
not migratable. Everything else moves exactly: greedy and unseeded sampling, top_k, min_p and
logit_bias (they look at the logits of one step), the repetition penalty (prompt and output
alike), stop token ids (they look only at the new token), min_tokens (lowered by the
tokens already generated) and a thinking budget where the model's thinking markers are one token
each (vLLM counts the thinking a prompt ends in against it).

vLLM symbols this relies on are pinned by tests/vllm/test_contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from llumdask.engine.vllm.kv_blocks import copy_blocks, kv_tensors, tensor_parallel_rank, write_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request as VllmRequest

# extra_args key naming the migration whose blocks a resumed request loads its KV from.
MIGRATION_KEY = "llumdask_migration_id"

CONNECTOR_NAME = "LlumdaskMigrationConnector"


def kv_transfer_config() -> dict[str, Any]:
    """The `kv_transfer_config` engine argument that installs this connector."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": __name__, "kv_role": "kv_both"}


@dataclass
class MigrationMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    # (source block id, destination block id): copy before this step's forward pass.
    copies: list[tuple[int, int]] = field(default_factory=list)
    # (destination block id, fused one-block buffer): write before this step's forward pass.
    writes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # Finished requests whose held blocks the scheduler may free now.
    release: set[str] = field(default_factory=set)


@dataclass
class _Import:
    """KV waiting to be loaded into a re-added request: `full_blocks[i]` holds its logical block
    i; `tail` (a fused one-block buffer) the partly filled block after them, if any."""

    full_blocks: list[int]
    num_tokens: int
    tail: np.ndarray | None


class LlumdaskMigrationConnector(KVConnectorBase_V1):
    """Holds paused requests' blocks, and loads migrated KV into resumed requests."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side.
        self._to_hold: set[str] = set()
        self._held: dict[str, list[int]] = {}
        self._to_release: set[str] = set()
        self._imports: dict[str, _Import] = {}
        self._local_hits: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []
        self._writes: list[tuple[int, np.ndarray]] = []
        self._loaded: set[str] = set()
        self._scheduled: dict[str, int] = {}

    # ------------------------------------------------------------------ control (engine thread)
    def hold_on_finish(self, request_id: str) -> None:
        """Keep this request's blocks when it finishes next (it is about to be aborted for a pause)."""
        self._to_hold.add(request_id)

    def held_blocks(self, request_id: str) -> list[int]:
        """Block ids (logical order) of a finished request whose blocks this connector holds."""
        return self._held[request_id]

    def release(self, request_id: str) -> None:
        """Let the scheduler free a held request's blocks at the next step."""
        if request_id in self._held:
            del self._held[request_id]
            self._to_release.add(request_id)

    def expect_import(
        self, migration_id: str, full_blocks: list[int], num_tokens: int, tail: np.ndarray | None
    ) -> None:
        """A request re-added under `migration_id` has KV for `num_tokens` tokens: in
        `full_blocks`, then in `tail` when num_tokens is not a whole number of blocks."""
        self._imports[migration_id] = _Import(list(full_blocks), num_tokens, tail)

    def take_loaded(self) -> set[str]:
        """Migrations whose re-added request was scheduled in the last step (its KV copied, or
        all of it found cached)."""
        loaded, self._loaded = self._loaded, set()
        return loaded

    def take_scheduled(self) -> dict[str, int]:
        """Tokens the model computed per request (internal id) in the last step: loaded KV is
        not among them, which is how a resumed request is seen to compute a single token."""
        scheduled, self._scheduled = self._scheduled, {}
        return scheduled

    def forget_import(self, migration_id: str) -> None:
        self._imports.pop(migration_id, None)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "VllmRequest", num_computed_tokens: int) -> tuple[int, bool]:
        pending = self._import_for(request)
        if pending is None:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return max(0, pending.num_tokens - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: "VllmRequest", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        pending = self._import_for(request)
        local_hit = self._local_hits.pop(request.request_id, 0)
        if pending is None:
            return
        # Loaded once it is scheduled, even with nothing to copy: KV ending on a block boundary is
        # all found as cached prefix, and its source must still go.
        self._loaded.add(migration_of(request))
        if num_external_tokens == 0:
            return
        (allocated,) = blocks.get_block_ids()
        first = local_hit // self._block_size
        last = -(-(local_hit + num_external_tokens) // self._block_size)
        for index in range(first, last):
            if index < len(pending.full_blocks):
                self._copies.append((pending.full_blocks[index], allocated[index]))
            else:
                assert pending.tail is not None, "KV claimed past the imported blocks"
                self._writes.append((allocated[index], pending.tail))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> MigrationMetadata:
        self._scheduled = dict(scheduler_output.num_scheduled_tokens)
        meta = MigrationMetadata(copies=self._copies, writes=self._writes, release=self._to_release)
        self._copies, self._writes, self._to_release = [], [], set()
        return meta

    def request_finished(self, request: "VllmRequest", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._local_hits.pop(request.request_id, None)  # asked about, then not admitted
        if request.request_id not in self._to_hold:
            return False, None
        self._to_hold.discard(request.request_id)
        self._held[request.request_id] = list(block_ids)
        return True, None

    def _import_for(self, request: "VllmRequest") -> _Import | None:
        migration_id = migration_of(request)
        return None if migration_id is None else self._imports.get(migration_id)

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MigrationMetadata)
        if not meta.copies and not meta.writes:
            return
        layers = kv_tensors(forward_context.no_compile_layers)
        if meta.copies:
            copy_blocks(layers, [s for s, _ in meta.copies], [t for _, t in meta.copies])
        for block_id, buffer in meta.writes:
            write_blocks(layers, [block_id], buffer[:, tensor_parallel_rank()])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        released = meta.release if isinstance(meta, MigrationMetadata) else set()
        return (set(released) or None), None


def migration_of(request: "VllmRequest") -> str | None:
    """The migration a re-added request brings KV for (None for any other request)."""
    extra = request.sampling_params.extra_args if request.sampling_params is not None else None
    return None if not extra else extra.get(MIGRATION_KEY)
