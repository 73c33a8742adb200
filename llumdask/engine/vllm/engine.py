"""A real vLLM instance behind the Engine contract, live migration included (see connector.py).

Why the synchronous `LLMEngine` with an in-process EngineCore, not `AsyncLLM`: the llumlet drives
its engine one step at a time and interleaves migration stages between steps. In-process,
`LLMEngine.step()` is exactly one schedule -> execute -> update iteration and returns its
outputs, so a step, the load read after it and a block copy between two steps all see one
consistent state, with no second process to race. `AsyncLLM` runs EngineCore in a busy loop in
another process: per-step control, exact block tables and KV tensors would all need a side
channel. The host runs `step()` in a thread so that its event loop stays free.

Load comes straight from vLLM's scheduler after each step (running and waiting queues, block
tables, free blocks, preemption counters): the numbers vLLM's `SchedulerStats` carries, read
without a stats logger. All of those reads go through internals.py. A request paused for the last
stage of a migration is out of vLLM (aborted, its blocks held by the connector) but counts as
running with those blocks, as on the sim engine.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llumdask.engine.base import (
    EngineSnapshot,
    LoadTotals,
    MigrationRefused,
    MigrationState,
    PendingBlocks,
    RequestLoad,
    StepResult,
    TokenLogprob,
    TokenOutput,
)
from llumdask.engine.vllm import internals
from llumdask.engine.vllm.kv_events import PrefixTracker
from llumdask.prefix import PrefixEvents
from llumdask.request import FinishReason, Request, RequestStatus, SamplingParams, blocks_for

if TYPE_CHECKING:
    import vllm
    from vllm import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.request import Request as VllmRequest

# Our request id travels inside vLLM's SamplingParams: LLMEngine suffixes the id it schedules
# under ("<id>-<8 random chars>"), and code that only sees vLLM's Request (the KV connector)
# must still know whose it is.
REQUEST_ID_KEY = "llumdask_request_id"

# Engine arguments the engine relies on; a user value for one of these is an error.
FIXED_ENGINE_ARGS: Mapping[str, Any] = {
    # One synchronous step at a time: KV of every scheduled token is written when step() returns.
    "async_scheduling": False,
    # A resumed request finds its migrated full blocks as a prefix-cache hit (connector.py).
    "enable_prefix_caching": True,
}

# Defaults a user may override. Eager mode starts in ~2 s on CPU; a compiled graph takes minutes.
DEFAULT_ENGINE_ARGS: Mapping[str, Any] = {
    "enforce_eager": True,
    # Admission by (priority, arrival), as llumdask's queue_key orders waiting requests.
    "scheduling_policy": "priority",
    # What the prefix cache gains and loses, for the global scheduler's prefix index
    # (kv_events.py); off ({"enable_kv_cache_events": False}) leaves dispatch blind to it.
    "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"},
}

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def engine_args_for(model: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM EngineArgs keyword arguments: defaults, then the caller's, then the fixed ones."""
    overrides = dict(overrides or {})
    clash = sorted(k for k in FIXED_ENGINE_ARGS if k in overrides and overrides[k] != FIXED_ENGINE_ARGS[k])
    if clash:
        raise ValueError(f"vllm engine arguments {clash} cannot be changed: live migration relies on them")
    if "kv_transfer_config" in overrides:
        raise ValueError("vllm engine argument kv_transfer_config is taken by llumdask's migration connector")
    from llumdask.engine.vllm.connector import kv_transfer_config

    return {
        **DEFAULT_ENGINE_ARGS,
        **overrides,
        "model": str(model),
        **FIXED_ENGINE_ARGS,
        "kv_transfer_config": kv_transfer_config(),
    }


def _holds_nothing(holdings: tuple[int, bool]) -> bool:
    """Whether a waiting request (`VllmEngine._waiting_holdings`) may be handed over: it holds no
    block and loads no KV."""
    blocks, loading = holdings
    return not blocks and not loading


def migration_refusal(request: Request, budget_moves: bool) -> str:
    """Why the request cannot move exactly ("" when it can). A resumed request restarts vLLM's
    per-request sampling state, so a seeded random sampler would replay its seed, and it resumes
    with its output as prompt, which presence and frequency penalties do not count (the
    repetition penalty counts prompt and output alike, so it moves exactly). A thinking budget
    moves where `budget_moves` (`thinking_budget_moves`)."""
    s = request.sampling
    if s.seeded_random:
        return "seeded random sampling restarts its generator on the destination"
    if option := s.counts_own_output:
        return f"{option} counts only the tokens generated where the request runs"
    if s.thinking_token_budget is not None and not budget_moves:
        return "this engine's thinking budget would not go on exactly elsewhere (`thinking_budget_moves`)"
    return s.resume_breaks


def thinking_budget_moves(vllm_config: Any) -> bool:
    """Whether vLLM goes on exactly with a resumed request's thinking budget (its VllmConfig). Its
    runner counts the thinking a request's prompt ends in against the budget, so a request resumed
    with its output as prompt goes on counting where it was, provided the markers are one token
    each and the end it forces is the model's own (its count looks for the forced end; one the
    model wrote itself, if another, would leave a resumed request's thinking open). Spec decoding
    forces ends within its drafts: not relied on."""
    reasoning = vllm_config.reasoning_config
    if reasoning is None or not reasoning.enabled or vllm_config.speculative_config is not None:
        return False
    end = list(reasoning.reasoning_end_token_ids or ())
    return (len(reasoning.reasoning_start_token_ids or ()) == 1 and len(end) == 1
            and end == list(reasoning.natural_reasoning_end_token_ids or ()))


def to_vllm_sampling(request: Request, migration_id: str | None = None) -> "vllm.SamplingParams":
    """vLLM sampling parameters for one of our requests: deltas only, token ids only; a request
    resumed after a migration asks only for the tokens it still lacks, and for fewer minimum
    tokens by those it has."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from llumdask.engine.vllm.connector import MIGRATION_KEY

    s: SamplingParams = request.sampling
    extra_args: dict[str, str] = {REQUEST_ID_KEY: request.request_id}
    if migration_id is not None:
        extra_args[MIGRATION_KEY] = migration_id
    return VllmSamplingParams(
        n=1,
        max_tokens=s.max_tokens - request.num_output_tokens,
        min_tokens=max(0, s.min_tokens - request.num_output_tokens),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias) or None,
        allowed_token_ids=list(s.allowed_token_ids) or None,
        bad_words=list(s.bad_words) or None,
        logprobs=s.logprobs,
        structured_outputs=structured_outputs(s),
        thinking_token_budget=s.thinking_token_budget,
        # The prompt's come with the first output: a request that has output already had them.
        prompt_logprobs=s.prompt_logprobs if request.num_output_tokens == 0 else None,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra_args,
    )


def structured_outputs(s: SamplingParams) -> StructuredOutputsParams | None:
    """vLLM's structured-output parameters for the request's kind, if any."""
    from vllm.sampling_params import StructuredOutputsParams

    if s.json_schema is not None:
        return StructuredOutputsParams(json=json.loads(s.json_schema))
    if s.json_object:
        return StructuredOutputsParams(json_object=True)
    if s.regex is not None:
        return StructuredOutputsParams(regex=s.regex)
    if s.choice:
        return StructuredOutputsParams(choice=list(s.choice))
    if s.structural_tag is not None:
        return StructuredOutputsParams(structural_tag=s.structural_tag)
    return StructuredOutputsParams(grammar=s.grammar) if s.grammar is not None else None


def _logprob(position: Mapping[int, Any], token: int, top: int) -> TokenLogprob:
    """vLLM's {token id: Logprob} of one position: the token's own (with its rank), and the `top`
    most likely by rank."""
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= top))
    own = position[token]
    return TokenLogprob(own.logprob, tuple((t, logprob) for _, t, logprob in ranked), own.rank)


class VllmEngine:
    """One vLLM instance. Not thread-safe: call it from one thread at a time, like every Engine."""

    def __init__(
        self,
        model: str,
        engine_args: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from llumdask.engine.vllm.malloc import keep_freed_memory_for_reuse

        keep_freed_memory_for_reuse()  # before the engine allocates anything
        self._llm = internals.create_llm_engine(engine_args_for(model, engine_args))
        self._scheduler = internals.scheduler_of(self._llm)
        self._pool = internals.block_pool_of(self._llm)
        self._clock = clock
        self._max_model_len: int = self._llm.vllm_config.model_config.max_model_len
        self._on_cpu = self._llm.vllm_config.device_config.device_type == "cpu"
        self._budget_moves = thinking_budget_moves(self._llm.vllm_config)
        self._connector = self._scheduler.get_kv_connector()
        self._prefix: PrefixTracker | None = PrefixTracker(self.block_size, self.total_blocks)
        if not internals.tap_kv_events(self._scheduler, self._prefix.apply):
            self._prefix = None
        self._requests: dict[str, Request] = {}
        self._internal_ids: dict[str, str] = {}
        self._num_preemptions = 0
        # Source side: paused request -> the internal id whose blocks the connector holds.
        self._paused: dict[str, str] = {}
        # Source side: waiting requests taken from vLLM's queue for a migration (holding nothing).
        self._handed: set[str] = set()
        # Destination side: migration id -> reserved blocks (vLLM KVCacheBlock objects), the
        # cached ones it reuses first (how many: `_reused`).
        self._reservations: dict[str, list[Any]] = {}
        self._reused: dict[str, int] = {}
        # Re-added requests (resumed or unpaused) whose KV loads at their first step: migration id
        # -> held source-side internal id to release afterwards (None on a destination).
        self._loading: dict[str, str | None] = {}
        from llumdask.engine.vllm.kv_blocks import prepare_stages

        ranks = self._llm.collective_rpc(prepare_stages)
        self._fused_shape: tuple[int, int, int] = (len(ranks), *ranks[0])

    # ------------------------------------------------------------------ shape
    @property
    def block_size(self) -> int:
        return self._llm.vllm_config.cache_config.block_size

    @property
    def total_blocks(self) -> int:
        return internals.usable_blocks(self._pool)

    @property
    def high_priority_headroom(self) -> int | None:
        return None  # no latency profile: set llumdask.headroom-tokens.high (llumdask profile headroom)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def llm_engine(self) -> Any:
        """The underlying vllm LLMEngine (for tokenizers, config and tests)."""
        return self._llm

    # ------------------------------------------------------------------ serving
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already on this engine")
        if self._on_cpu and request.sampling.seeded_random:
            # vLLM rewinds a seeded request's generator when it discards the token of a prompt
            # chunk; torch's CPU generators cannot rewind, and the failed step stops every request.
            raise ValueError(f"request {request.request_id}: vLLM on the CPU cannot run seeded random sampling "
                             "(its engine step fails once such a prompt is prefilled in chunks); leave out the "
                             "seed, or serve on a GPU")
        needed = request.num_prompt_tokens + request.sampling.max_tokens
        if needed > self._max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's max_model_len {self._max_model_len}"
            )
        if blocks_for(needed, self.block_size) > self.total_blocks:
            raise ValueError(
                f"request {request.request_id}: {needed} tokens need more than the engine's "
                f"{self.total_blocks} KV blocks of {self.block_size}"
            )
        request.status = RequestStatus.WAITING
        self._submit(request)

    def _submit(self, request: Request, migration_id: str | None = None) -> None:
        """Hand a request to vLLM (`_prompt_of`)."""
        from vllm.exceptions import VLLMClientError

        try:
            prompt: Any = _prompt_of(request)
            params = to_vllm_sampling(request, migration_id)
            if request.sampling.reasoning_ended is not None:
                # `add_request` takes no reasoning_ended (vLLM's server passes it to its async
                # engine): the request is processed here and handed over whole, as it may be.
                prompt = self._llm.input_processor.process_inputs(
                    request.request_id, prompt, params, supported_tasks=self._llm.get_supported_tasks(),
                    arrival_time=request.arrival_time, priority=self._vllm_priority(request))
                prompt.reasoning_ended = request.sampling.reasoning_ended
                if request.sampling.reasoning_kwargs is not None:
                    prompt.reasoning_parser_kwargs = {"chat_template_kwargs": json.loads(request.sampling.reasoning_kwargs)}
            self._internal_ids[request.request_id] = self._llm.add_request(
                request.request_id,
                prompt,
                params,
                arrival_time=request.arrival_time,
                priority=self._vllm_priority(request),
            )
        except VLLMClientError as exc:  # what vLLM finds wrong with the request (a regex that does not compile)
            raise ValueError(f"request {request.request_id}: vLLM refused it: {exc}") from None
        self._requests[request.request_id] = request

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        internal_id = self._internal_ids.pop(request_id)
        if request_id in self._paused:
            self._connector.release(self._paused.pop(request_id))
        elif request_id in self._handed:
            self._handed.discard(request_id)
        else:
            self._finish_loading_of(internal_id)
            self._llm.abort_request([request_id])
        request.status = RequestStatus.ABORTED
        request.finish_reason = FinishReason.ABORT
        request.timing.finished = self._clock()

    def step(self) -> StepResult:
        before = self._progress()
        self._connector.take_scheduled()
        started = time.perf_counter()
        outputs = self._llm.step()
        duration = time.perf_counter() - started
        now = self._clock()
        preempted = self._record_preemptions(before, now)
        tokens = tuple(t for t in (self._apply_output(o, now) for o in outputs) if t is not None)
        prefill, batch = _work_done(before, self._connector.take_scheduled())
        self._after_loads()
        return StepResult(
            outputs=tokens, preempted=preempted, duration=duration, num_prefill_tokens=prefill, batch_size=batch
        )

    def has_work(self) -> bool:
        # has_requests() also covers finished requests whose blocks a connector still holds.
        return bool(self._requests) or self._scheduler.has_requests()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            total_blocks=self.total_blocks,
            block_size=self.block_size,
            free_blocks=self._pool.get_num_free_blocks(),
            reserved_blocks=self._num_reserved(),
            running=tuple(
                self._load(request, blocks, running=True, can_move=not paused) for request, blocks, paused in self._holders()
            ),
            waiting=tuple(
                self._load(self._requests[_our_id(r)], holdings[0], running=False, can_move=_holds_nothing(holdings))
                for r in internals.waiting_requests(self._scheduler)
                for holdings in (self._waiting_holdings(r),)
            ),
            num_preemptions=self._num_preemptions,
        )

    def load_totals(self) -> LoadTotals:
        """One pass over vLLM's queues without building per-request loads. O(requests), unlike
        the sim engine's counters: a real step costs far more than this pass."""
        holders = list(self._holders())
        return LoadTotals.tally(
            total_blocks=self.total_blocks,
            block_size=self.block_size,
            free_blocks=self._pool.get_num_free_blocks(),
            reserved_blocks=self._num_reserved(),
            running=[(request.execution_priority, blocks) for request, blocks, _ in holders],
            waiting=[(self._requests[_our_id(r)].num_tokens, self._waiting_holdings(r)[0])
                     for r in internals.waiting_requests(self._scheduler)],
            num_preemptions=self._num_preemptions,
            num_pinned=sum(1 for request, _, _ in holders if self._refusal(request)),
        )

    def prefix_events(self) -> PrefixEvents | None:
        """Anchor blocks cached and evicted since the last call, from vLLM's KV-cache events;
        None when those are off."""
        return self._prefix.drain() if self._prefix is not None else None

    def get_request(self, request_id: str) -> Request | None:
        """A request this engine is serving (finished and aborted ones are forgotten)."""
        return self._requests.get(request_id)

    def check_integrity(self) -> None:
        """Every block's reference count equals the number of requests holding it, free + held ==
        total, and the load totals equal a recount. With prefix caching two requests may share a block (counted
        twice in its reference count), so sharing itself is not an error."""
        holders = [0] * self._pool.num_gpu_blocks
        for vllm_request in internals.live_requests(self._scheduler):
            for block_id in internals.request_block_ids(self._scheduler, vllm_request.request_id):
                holders[block_id] += 1
        for blocks in self._reservations.values():
            for block in blocks:
                holders[block.block_id] += 1
        null_id = self._pool.null_block.block_id
        refs = internals.block_ref_counts(self._pool)
        wrong = [(b, refs[b], holders[b]) for b in range(len(refs)) if b != null_id and refs[b] != holders[b]]
        assert not wrong, f"block (id, ref_cnt, holders) mismatches: {wrong[:10]}"
        held = sum(1 for b, n in enumerate(holders) if n and b != null_id)
        free = self._pool.get_num_free_blocks()
        assert free + held == self.total_blocks, f"free {free} + held {held} != total {self.total_blocks}"
        recount = LoadTotals.from_snapshot(self.snapshot())
        assert self.load_totals() == recount, f"load totals {self.load_totals()} != recount {recount}"

    # ------------------------------------------------------------------ migration, source side
    def completed_blocks(self, request_id: str) -> int:
        vllm_request = self._running_vllm_request(request_id)
        if vllm_request is None:
            return 0
        # Synchronous scheduling: no token is in flight between steps.
        return vllm_request.num_computed_tokens // self.block_size

    def export_blocks(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Blocks [start, end) fused into one (blocks, ranks, layers, bytes) uint8 array.
        A running request exports completed blocks only; a paused one any block up to
        blocks_for(num_tokens), those past the KV it holds coming back as zeros."""
        return self.export_later(request_id, start, end).copy()

    def export_later(self, request_id: str, start: int, end: int) -> PendingBlocks:
        """The block ids are read now; the gather runs when `copy()` does. With one rank that is
        a direct call into the in-process worker, safe from another thread; several ranks share
        the executor's channel with the engine's own steps, so they gather now."""
        request = self._known(request_id)
        if request_id in self._paused:
            block_ids = self._connector.held_blocks(self._paused[request_id])
            limit = blocks_for(request.num_tokens, self.block_size)
        else:
            block_ids = internals.request_block_ids(self._scheduler, self._internal_ids[request_id])
            limit = self.completed_blocks(request_id)
        if not 0 <= start <= end <= limit:
            raise ValueError(f"request {request_id!r}: cannot export blocks [{start}, {end}); {limit} can be")
        gather = functools.partial(self._gather, block_ids[start : min(end, len(block_ids))], end - start)
        nbytes = (end - start) * math.prod(self._fused_shape)
        if self._fused_shape[0] > 1:
            buffer = gather()
            return PendingBlocks(nbytes, lambda: buffer)
        return PendingBlocks(nbytes, gather)

    def pause(self, request_id: str, *, waiting: bool = False) -> MigrationState:
        """Abort the request in vLLM while the connector keeps its blocks (vLLM cannot pause one);
        with `waiting`, a request of vLLM's waiting queue holding no blocks, which keeps nothing."""
        request = self._known(request_id)
        if waiting:
            return self._hand_over(request)
        if request_id in self._paused or self._running_vllm_request(request_id) is None:
            raise MigrationRefused(f"request {request_id!r} is not in the running batch")
        refusal = self._refusal(request)
        if refusal:
            raise MigrationRefused(f"request {request_id!r}: {refusal}")
        internal_id = self._internal_ids[request_id]
        self._connector.hold_on_finish(internal_id)
        self._llm.abort_request([request_id])
        self._paused[request_id] = internal_id
        return MigrationState.capture(request)

    def _hand_over(self, request: Request) -> MigrationState:
        request_id = request.request_id
        if request_id in self._handed or not self._waits_holding_nothing(request_id):
            raise MigrationRefused(f"request {request_id!r} is not waiting without blocks")
        refusal = self._refusal(request)
        if refusal:
            raise MigrationRefused(f"request {request_id!r}: {refusal}")
        self._llm.abort_request([request_id])
        self._handed.add(request_id)
        return MigrationState.capture(request, waiting=True)

    def _waits_holding_nothing(self, request_id: str) -> bool:
        """In vLLM's waiting queue, not loading KV and holding no blocks."""
        internal_id = self._internal_ids.get(request_id)
        vllm_request = self._scheduler.requests.get(internal_id) if internal_id is not None else None
        return vllm_request is not None and vllm_request in internals.waiting_requests(self._scheduler) \
            and _holds_nothing(self._waiting_holdings(vllm_request))

    def unpause(self, request_id: str) -> None:
        """Rollback: re-add the request, its KV loaded from its own held blocks (a waiting one
        re-queued in its place)."""
        if request_id in self._handed:
            self._handed.discard(request_id)
            self._submit(self._requests[request_id])
            return
        internal_id = self._paused.pop(request_id, None)
        if internal_id is None:
            return
        request = self._requests[request_id]
        migration_id = f"unpause:{internal_id}"
        # Its full blocks are still in the prefix cache (vLLM cached them as they filled).
        full, tail = self._split_kv(self._connector.held_blocks(internal_id), request.num_tokens - 1)
        self._connector.expect_import(migration_id, full, request.num_tokens - 1, tail)
        self._loading[migration_id] = internal_id
        self._submit(request, migration_id)

    def free_migrated(self, request_id: str) -> None:
        """After COMMIT: forget the request; its blocks are freed at the next step."""
        if request_id in self._handed:
            self._handed.discard(request_id)
            del self._requests[request_id]
            del self._internal_ids[request_id]
            return
        internal_id = self._paused.pop(request_id, None)
        if internal_id is None:
            raise MigrationRefused(f"request {request_id!r} is not paused here")
        self._connector.release(internal_id)
        del self._requests[request_id]
        del self._internal_ids[request_id]

    # ------------------------------------------------------------------ migration, destination side
    def reserve_cached(self, migration_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """The cached blocks are touched (one more holder: out of the free queue, not evicted);
        at resume they are a prefix hit of the re-added request like the imported ones."""
        if migration_id in self._reservations:
            raise ValueError(f"migration {migration_id!r} has a reservation already")
        blocks = internals.cached_prefix_blocks(self._llm, tokens, self.block_size, cache_salt)
        self._pool.touch(blocks)
        self._reservations[migration_id] = blocks
        self._reused[migration_id] = len(blocks)
        return len(blocks)

    def reserve_blocks(self, migration_id: str, num_blocks: int) -> bool:
        """Adds to the migration's reservation; each stage reserves the blocks it will import."""
        if num_blocks > self._pool.get_num_free_blocks():
            return False
        self._reservations.setdefault(migration_id, []).extend(self._pool.get_new_blocks(num_blocks))
        return True

    def release_reservation(self, migration_id: str) -> None:
        blocks = self._reservations.pop(migration_id, None)
        self._reused.pop(migration_id, None)
        if blocks:
            self._pool.free_blocks(blocks)
        self._connector.forget_import(migration_id)

    def import_blocks(self, migration_id: str, start: int, buffer: Any) -> None:
        reserved = self._reservations.get(migration_id)
        if reserved is None:
            raise MigrationRefused(f"no reservation for migration {migration_id!r}")
        if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint8 or buffer.shape[1:] != self._fused_shape:
            got = f"{buffer.dtype} {buffer.shape}" if isinstance(buffer, np.ndarray) else type(buffer).__name__
            shape = ", ".join(map(str, self._fused_shape))
            raise MigrationRefused(
                f"migration {migration_id!r}: expected uint8 blocks of shape (n, {shape}), got {got}"
            )
        end = start + len(buffer)
        if not 0 <= start <= end <= len(reserved):
            raise MigrationRefused(
                f"migration {migration_id!r}: blocks [{start}, {end}) outside the {len(reserved)} reserved"
            )
        if end > start:
            from llumdask.engine.vllm.kv_blocks import scatter_blocks

            block_ids = [block.block_id for block in reserved[start:end]]
            self._llm.collective_rpc(scatter_blocks, args=(block_ids, buffer))

    def resume(self, migration_id: str, state: MigrationState) -> None:
        """Re-add the request with its generated tokens as prompt; the connector loads the
        imported KV for all but the last token, so its first step computes one token."""
        rid = state.request_id
        if rid in self._requests:
            raise MigrationRefused(f"request {rid!r} is already here")
        if len(state.prompt_token_ids) + state.sampling.max_tokens > self._max_model_len:
            raise MigrationRefused(f"request {rid!r} can never finish within max_model_len {self._max_model_len}")
        if state.waiting:
            # Queued in its place to compute everything (as vLLM recomputes a preempted request);
            # the reservation only made sure it fits.
            self.release_reservation(migration_id)
            self._submit(state.to_request())
            return
        if not state.output_token_ids:
            raise MigrationRefused(f"request {rid!r} has no output yet; only running requests migrate")
        reserved = self._reservations.get(migration_id, [])
        needed = blocks_for(state.num_tokens - 1, self.block_size)
        if len(reserved) < needed:
            raise MigrationRefused(
                f"migration {migration_id!r} reserved {len(reserved)} blocks, request {rid!r} needs {needed}"
            )
        request = state.to_request()
        num_kv = state.num_tokens - 1
        full, tail = self._split_kv([b.block_id for b in reserved], num_kv)
        self._submit(request, migration_id)
        # Zero-copy for the full blocks: they become a prefix-cache hit of the re-added request.
        # The partial tail travels as a one-block buffer, so its block can go back right away.
        internals.cache_as_prefix(self._pool, self._scheduler.requests[self._internal_ids[rid]], reserved[: len(full)],
                                  self.block_size, num_cached=min(self._reused.pop(migration_id, 0), len(full)))
        self._reservations[migration_id] = reserved[: len(full)]
        self._pool.free_blocks(reserved[len(full) :])
        self._connector.expect_import(migration_id, full, num_kv, tail)
        self._loading[migration_id] = None

    def close(self) -> None:
        """Stop vLLM's engine core and free its KV cache."""
        self._llm.engine_core.shutdown()

    # ------------------------------------------------------------------ migration bookkeeping
    def _gather(self, block_ids: list[int], num_blocks: int) -> np.ndarray:
        """A fused buffer of `num_blocks` blocks: the given ones, then zeros. One rank's share
        is the buffer itself (a view with the rank axis added), so one rank copies once."""
        from llumdask.engine.vllm.kv_blocks import gather_blocks

        ranks = self._llm.collective_rpc(gather_blocks, args=(block_ids, num_blocks))
        return ranks[0][:, np.newaxis] if len(ranks) == 1 else np.stack(ranks, axis=1)

    def _split_kv(self, block_ids: list[int], num_kv_tokens: int) -> tuple[list[int], np.ndarray | None]:
        """(the blocks KV fills completely, a fused copy of the partly filled one after them)."""
        num_full = num_kv_tokens // self.block_size
        tail = self._gather([block_ids[num_full]], 1) if num_kv_tokens % self.block_size else None
        return block_ids[:num_full], tail

    def _known(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise MigrationRefused(f"request {request_id!r} is not on this engine")
        return request

    def _running_vllm_request(self, request_id: str) -> "VllmRequest | None":
        from vllm.v1.request import RequestStatus as VllmStatus

        internal_id = self._internal_ids.get(request_id)
        if internal_id is None or request_id in self._paused:
            return None
        vllm_request = self._scheduler.requests.get(internal_id)
        if vllm_request is None or vllm_request.status != VllmStatus.RUNNING:
            return None
        return vllm_request

    def _after_loads(self) -> None:
        """Once a re-added request has run a step (its KV copied into its own blocks, or all found
        cached), the sources go."""
        for migration_id in self._connector.take_loaded():
            self._settle_load(migration_id)

    def _finish_loading_of(self, internal_id: str) -> None:
        """An aborted request that never got to load its KV: drop the load and its source."""
        from llumdask.engine.vllm.connector import migration_of

        vllm_request = self._scheduler.requests.get(internal_id)
        migration_id = migration_of(vllm_request) if vllm_request is not None else None
        if migration_id in self._loading:
            self._settle_load(migration_id)

    def _settle_load(self, migration_id: str) -> None:
        source = self._loading.pop(migration_id, None)
        if source is None:
            self.release_reservation(migration_id)
        else:
            self._connector.forget_import(migration_id)
            self._connector.release(source)

    def _num_reserved(self) -> int:
        """Blocks taken for requests that are not running: migrations' reservations, and the blocks
        a rolled-back request's KV is loaded from until it runs again (held by the connector, no
        longer by a running or paused request)."""
        reserved = sum(len(blocks) for blocks in self._reservations.values())
        return reserved + sum(len(self._connector.held_blocks(source)) for source in self._loading.values()
                              if source is not None)

    # ------------------------------------------------------------------ step bookkeeping
    def _vllm_priority(self, request: Request) -> int:
        # vLLM admits the lowest value first and refuses non-zero priorities under FCFS.
        if self._llm.vllm_config.scheduler_config.policy != "priority":
            return 0
        return -int(request.scheduling_priority)

    def _progress(self) -> list[tuple["VllmRequest", int, int, int]]:
        """(request, computed tokens, tokens, preemptions) of every scheduled request before a step."""
        return [
            (r, r.num_computed_tokens, r.num_tokens, r.num_preemptions)
            for r in internals.live_requests(self._scheduler)
            if not r.is_finished()
        ]

    def _record_preemptions(self, before: list[tuple["VllmRequest", int, int, int]], now: float) -> tuple[str, ...]:
        preempted = []
        for vllm_request, _, _, preemptions in before:
            if vllm_request.num_preemptions == preemptions:
                continue
            request = self._requests.get(_our_id(vllm_request))
            if request is None:
                continue
            self._num_preemptions += vllm_request.num_preemptions - preemptions
            request.status = RequestStatus.WAITING
            request.timing.preemptions += vllm_request.num_preemptions - preemptions
            request.timing.preempted_at = now
            preempted.append(request.request_id)
        return tuple(preempted)

    def _apply_output(self, output: Any, now: float) -> TokenOutput | None:
        request = self._requests.get(output.request_id)
        if request is None:
            return None
        completion = output.outputs[0]
        new_tokens = tuple(completion.token_ids)
        first_index = request.num_output_tokens
        request.output_token_ids.extend(new_tokens)
        timing = request.timing
        if new_tokens:
            request.status = RequestStatus.RUNNING
            timing.first_scheduled = timing.first_scheduled if timing.first_scheduled is not None else now
            timing.first_token = timing.first_token if timing.first_token is not None else now
            timing.last_token = now
            if timing.preempted_at is not None:
                timing.preemption_loss += now - timing.preempted_at
                timing.preempted_at = None
        finish_reason = None
        if output.finished:
            finish_reason = _FINISH_REASONS.get(completion.finish_reason, FinishReason.STOP)
            request.status = RequestStatus.FINISHED
            request.finish_reason = finish_reason
            timing.finished = now
            del self._requests[request.request_id]
            del self._internal_ids[request.request_id]
        if not new_tokens and not output.finished:
            return None
        logprobs = prompt_logprobs = cached = None
        if first_index == 0:
            cached = output.num_cached_tokens or 0
        if request.sampling.logprobs is not None:
            logprobs = tuple(_logprob(position, token, request.sampling.logprobs)
                             for position, token in zip(completion.logprobs, new_tokens))
        if first_index == 0 and output.prompt_logprobs:
            prompt = request.prompt_token_ids
            prompt_logprobs = tuple(None if position is None else _logprob(position, token, request.sampling.prompt_logprobs)
                                    for position, token in zip(output.prompt_logprobs, prompt))
        return TokenOutput(request.request_id, first_index, new_tokens, output.finished, finish_reason,
                           logprobs, prompt_logprobs, cached)

    # ------------------------------------------------------------------ load
    def _holders(self) -> Iterator[tuple[Request, int, bool]]:
        """(request, blocks it holds, paused) of the running batch, then of the paused requests."""
        for vllm_request in internals.running_requests(self._scheduler):
            yield self._requests[_our_id(vllm_request)], self._num_blocks(vllm_request), False
        for request_id, internal_id in self._paused.items():
            yield self._requests[request_id], len(self._connector.held_blocks(internal_id)), True

    def _num_blocks(self, vllm_request: "VllmRequest") -> int:
        return len(internals.request_block_ids(self._scheduler, vllm_request.request_id))

    def _waiting_holdings(self, vllm_request: "VllmRequest") -> tuple[int, bool]:
        """(blocks a waiting request holds, whether it is loading KV). A request re-added with its
        KV (a migrant here, or one rolled back) holds the whole blocks that KV is in until its
        first step takes them as a cached prefix: a migrant's reservation, a rolled-back request's
        own held blocks (counting them as its demand too would count them twice). A partly filled
        last block is not among them: its tokens are written into a new block. Any other request
        holds its block table."""
        if not self._loading:  # nearly every report: no request is loading KV
            return self._num_blocks(vllm_request), False
        from llumdask.engine.vllm.connector import migration_of

        migration_id = migration_of(vllm_request)
        if migration_id not in self._loading:
            return self._num_blocks(vllm_request), False
        source = self._loading[migration_id]
        if source is None:
            return len(self._reservations.get(migration_id, ())), True
        whole = (vllm_request.num_tokens - 1) // self.block_size
        return min(len(self._connector.held_blocks(source)), whole), True

    def _refusal(self, request: Request) -> str:
        return migration_refusal(request, self._budget_moves)

    def _load(self, request: Request, num_blocks: int, *, running: bool, can_move: bool) -> RequestLoad:
        pinned = bool(self._refusal(request))
        return RequestLoad(
            request_id=request.request_id,
            running=running,
            num_blocks=num_blocks,
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            execution_priority=request.execution_priority,
            scheduling_priority=request.scheduling_priority,
            migratable=can_move and not pinned,
            pinned=pinned,
        )


def _prompt_of(request: Request) -> "TokensPrompt":
    """What vLLM is given: everything generated so far (a request re-added after a migration
    continues from its last token), with the request's cache salt."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=[*request.prompt_token_ids, *request.output_token_ids])
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def _our_id(vllm_request: "VllmRequest") -> str:
    return vllm_request.sampling_params.extra_args[REQUEST_ID_KEY]


def _work_done(before: list[tuple["VllmRequest", int, int, int]], scheduled: dict[str, int]) -> tuple[int, int]:
    """(prefill tokens, batch size) of the step just run. `scheduled` is what the model computed
    per request; a request was prefilling (or recomputing after preemption, or resuming after a
    migration) when more than its last sampled token lacked KV before the step."""
    phase = {r.request_id: computed < num_tokens - 1 for r, computed, num_tokens, _ in before}
    prefill = sum(n for request_id, n in scheduled.items() if phase.get(request_id, True))
    return prefill, len(scheduled)
