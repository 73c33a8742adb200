"""A simulated instance: vLLM's scheduling and memory behaviour, a latency model instead of a model.

What is real: a paged KV pool (`BlockManager`) and vLLM v1's scheduler as the vLLM engine runs
it (priority policy): one token budget per step (`max_num_batched_tokens`) spent first on the
running requests in batch order (one token per decode, the next chunk of an unfinished prefill),
then on admissions from a waiting queue ordered by scheduling priority then arrival. A request
is admitted only when blocks for its whole prompt are free (vLLM's `scheduler_reserve_full_isl`),
but takes blocks only for the chunk it computes; a prompt longer than what is left of the budget
is prefilled in chunks over several steps (chunked prefill), its first token coming with the last
chunk. A running request that needs a block when none is free preempts (by recompute) the
lowest-priority, latest-arrived running request, possibly itself; a step that preempted admits
nobody. What is modelled: each step's duration (`LatencyProfile`).

Prefix caching (`sim_engine.prefix_caching`, on by default as in vLLM v1): full blocks are cached
under their chained prefix hash (`llumdask.prefix`), prompt blocks as their prefill fills them,
blocks that decoding fills when the request lets go of them (finished, preempted, migrated away,
aborted). An admitted request starts from the longest cached run of its full blocks short of its
last token: it shares those blocks, computes only the rest (the step is priced from the first
uncached token), and its first output reports the cached prompt tokens. Its admission needs free
blocks for the uncached rest plus any cached block nobody holds (it leaves the free pool). A
request recomputed after a preemption finds its own blocks until they are evicted.

KV content is real too, so that migration correctness is observable. Every token slot holds
`kv_bytes_per_token` bytes derived from (token id, position, hash of every token before its
block), so requests sharing a prefix write the same bytes into it, and the next token is
a function of the bytes of the last slot and of three earlier slots picked pseudo-randomly per
position, read through the block table. A migration that loses, misplaces or corrupts a block
therefore changes later tokens, while a faithful one (or a recompute) reproduces them exactly.
Sampling: greedy uses that function alone; temperature > 0 mixes in a value derived from
(seed, position) when seeded, or drawn from a per-request numpy Generator whose state travels in
`MigrationState.engine_state` when not. top_p, top_k and min_p are accepted and change nothing
(the sampled value stands for a draw from whatever the filters keep); options that move
probability between named tokens (penalties, logit_bias, structured output) or report it
(logprobs) would need logits, so the sim refuses them. The sim has no EOS token: a request ends at max_tokens or when
a generated token is one of its stop_token_ids; before min_tokens a stop token is masked (the
next id that is not one is generated instead), as vLLM masks them.

With `kv_bytes_per_token = 0` there is no content: tokens are a function of the prompt hash and
position only (plus the sampling value), exported buffers have shape (blocks, block_size, 0) and
so carry only their size, and migrations cannot corrupt anything. Large simulations use this.

Per step the Python work is O(batch) with small constants; KV writes and reads of all sequences
in the step go through a handful of vectorized numpy calls. The load totals are counters that the
few methods moving blocks or queue entries keep current, so a load report costs O(priorities).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np

from llumdask.engine.base import (
    EngineSnapshot,
    LoadTotals,
    MigrationRefused,
    MigrationState,
    PendingBlocks,
    RequestLoad,
    StepResult,
    TokenOutput,
    physical_split,
)
from llumdask.engine.block_manager import BlockManager
from llumdask.engine.kv_slots import kv_slots
from llumdask.engine.latency import LatencyProfile, load_profile
from llumdask.prefix import ROOT_HASH, PrefixEvents, block_hashes, is_anchor, mix, mix_int, salted
from llumdask.request import FinishReason, Priority, Request, RequestStatus, SamplingParams, blocks_for

if TYPE_CHECKING:
    from llumdask.config import LlumdaskConfig, SimEngineConfig

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
# Odd multipliers of the hash inputs (any fixed odd constants would do).
_K_TOKEN, _K_POS, _K_PICK = _U64(0x9E3779B97F4A7C15), _U64(0xC2B2AE3D27D4EB4F), _U64(0x165667B19E3779F9)
_SEED_SALT = 0xD6E8FEB86659FD93
# Earlier slots each generated token reads besides the last one.
_NUM_LOOKBACK = 3
_CONSTANTS_SEED = 20240710


_K_POS_INT = int(_K_POS)
# Content-free batches up to this size sample in Python integers (`_tokens_without_content`).
_SMALL_BATCH = 24


def _prompt_hash(prompt: list[int]) -> int:
    tokens = np.asarray(prompt, dtype=_U64)
    positions = np.arange(len(prompt), dtype=_U64)
    return int(mix(mix(tokens * _K_TOKEN + positions).sum(keepdims=True))[0])


@dataclass(eq=False, slots=True)
class _Seq:
    """Engine-side bookkeeping of one request (the `Request` itself is shared with the caller)."""

    request: Request
    request_id: str
    key: tuple[int, float, str]
    prompt_hash: int
    # request.num_tokens, kept here because the step reads it several times per sequence.
    num_tokens: int
    # Tokens whose KV is computed: num_tokens - 1 while decoding, less during a chunked prefill.
    num_computed: int
    # request.execution_priority: the load totals it counts in.
    priority: Priority
    # Length of its block table, read by every decode step (0 while waiting).
    num_blocks: int
    # Chained hashes of its full blocks of tokens so far (`llumdask.prefix`), extended as needed,
    # and the prefix cache's keys of them: `salted` by the request's cache salt, else the same list.
    block_hashes: list[int]
    cache_keys: list[int]
    # Blocks of its table known to be in the prefix cache (registered or shared from it).
    registered: int
    greedy: bool
    # Temperature > 0: a key derived from the seed, or a per-request sampler when there is none.
    seed_key: int
    rng: np.random.Generator | None
    # The last `_cached_prefix` answer while waiting: (cache version, blocks looked up, the blocks).
    # A head of the queue that does not fit is looked up again every step, mostly in an unchanged cache.
    prefix_memo: tuple[int, int, list[int]] | None = None


class _Chunk(NamedTuple):
    """What one sequence computes in one step: its tokens [start, start + count). A tuple: one
    is made per sequence per step, and the step unpacks it."""

    seq: _Seq
    start: int
    count: int
    # The last sampled token only: priced as a decode, whatever phase came before.
    is_decode: bool


def _chunk(seq: _Seq, start: int, count: int) -> _Chunk:
    return _Chunk(seq, start, count, start == seq.num_tokens - 1)


def _new_seq(request: Request, rng_state: dict[str, Any] | None = None) -> _Seq:
    sampling = request.sampling
    hashes: list[int] = []
    rng = None
    if not sampling.greedy and sampling.seed is None:
        rng = np.random.default_rng()
        if rng_state is not None:
            rng.bit_generator.state = rng_state
    return _Seq(
        request=request,
        request_id=request.request_id,
        key=request.queue_key(),
        prompt_hash=_prompt_hash(request.prompt_token_ids),
        num_tokens=request.num_tokens,
        num_computed=0,
        priority=request.execution_priority,
        num_blocks=0,
        block_hashes=hashes,
        cache_keys=hashes if request.cache_salt is None else [],
        registered=0,
        greedy=sampling.greedy,
        seed_key=((sampling.seed or 0) * _SEED_SALT) & _MASK64,
        rng=rng,
    )


def unmodelled_option(sampling: SamplingParams) -> str:
    """The first sampling option the sim cannot model ("" when none)."""
    if sampling.repetition_penalty != 1:
        return "repetition_penalty"
    if option := sampling.counts_own_output:
        return option
    if sampling.logit_bias:
        return "logit_bias"
    if sampling.allowed_token_ids:
        return "allowed_token_ids"
    if sampling.logprobs is not None:
        return "logprobs"
    if sampling.prompt_logprobs is not None:
        return "prompt_logprobs"
    if sampling.structured_kinds:
        return "structured outputs"
    if sampling.thinking_token_budget is not None:
        return "thinking_token_budget"
    return ""


def _unstopped(token: int, stop_token_ids: tuple[int, ...], vocab: int) -> int:
    """The first id after `token` (cyclically) that is no stop token: what masking them leaves."""
    for offset in range(1, vocab):
        candidate = (token + offset) % vocab
        if candidate not in stop_token_ids:
            return candidate
    raise ValueError(f"every token id is a stop token ({vocab} of them)")


def _token_range(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without concatenating the two lists."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n : end - n]
    return prompt[start:] + output[: end - n]


def _u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=_U64)


def _odd_constants(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63, n, dtype=_U64) * _U64(2) + _U64(1)


def _queue_key(seq: _Seq) -> tuple[int, float, str]:
    return seq.key


def _decoding(seq: _Seq) -> bool:
    """Prefill done: every token but the last sampled one has its KV (what a migration moves).
    A prompt chunked to end one token short of its last has no sampled token yet."""
    return seq.num_computed == seq.num_tokens - 1 and bool(seq.request.output_token_ids)


class SimEngine:
    """Implements `llumdask.engine.base.Engine`. Single-threaded, like every engine."""

    def __init__(
        self,
        config: SimEngineConfig,
        *,
        block_size: int,
        clock: Callable[[], float],
        instance_id: str = "",
    ) -> None:
        self._name = f"sim engine {instance_id!r}" if instance_id else "sim engine"
        self.profile: LatencyProfile = load_profile(config.profile)
        total = config.total_blocks if config.total_blocks is not None else self.profile.capacity_tokens // block_size
        for field_name, value, low in (
            ("kv_bytes_per_token", config.kv_bytes_per_token, 0),
            ("vocab_size", config.vocab_size, 2),
            ("max_num_seqs", config.max_num_seqs, 1),
            ("max_num_batched_tokens", config.max_num_batched_tokens, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{self._name}: sim_engine.{field_name} must be an integer >= {low}, got {value!r}")
        self._blocks = BlockManager(total, block_size)
        self._prefix_caching = config.prefix_caching
        self._clock = clock
        self._real_time = config.real_time
        self._vocab = _U64(config.vocab_size)
        self._max_num_seqs = config.max_num_seqs
        self._max_batched_tokens = config.max_num_batched_tokens
        try:
            self._kv = kv_slots(total, block_size, config.kv_bytes_per_token, config.kv_device)
        except ValueError as exc:
            raise ValueError(f"{self._name}: sim_engine.kv_device: {exc}") from None
        constants = np.random.default_rng(_CONSTANTS_SEED)
        # Byte j of a slot is the top byte of h * spread[j]; a slot's digest is sum(byte_j * weight_j).
        # Odd weights make the digest change whenever any single byte does.
        self._spread = _odd_constants(constants, config.kv_bytes_per_token)
        self._weights = _odd_constants(constants, config.kv_bytes_per_token)
        self._combine = _odd_constants(constants, _NUM_LOOKBACK + 1)
        self._seqs: dict[str, _Seq] = {}
        # Both sorted by queue key: the head of waiting is admitted first, the tail of running is
        # the preemption victim.
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        # Out of the batch for the last stage of a migration; blocks kept.
        self._paused: dict[str, _Seq] = {}
        # Out of the queue for a migration of a waiting request: nothing computed, nothing held.
        self._handed: dict[str, _Seq] = {}
        self._num_preemptions = 0
        self._snapshot: EngineSnapshot | None = None
        # The load totals, kept current by the few methods that move blocks or queue entries
        # (_allocate, _free, _enqueue, _dequeue, resume); check_integrity recounts them.
        self._held_blocks = dict.fromkeys(Priority, 0)
        self._held_count = dict.fromkeys(Priority, 0)
        self._waiting_tokens = 0
        self._waiting_demand = 0

    @classmethod
    def from_config(cls, config: LlumdaskConfig, *, clock: Callable[[], float], instance_id: str = "") -> "SimEngine":
        return cls(config.sim_engine, block_size=config.block_size, clock=clock, instance_id=instance_id)

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    @property
    def total_blocks(self) -> int:
        return self._blocks.total_blocks

    @property
    def high_priority_headroom(self) -> int | None:
        return self.profile.headroom_tokens

    # ------------------------------------------------------------------ serving
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._seqs:
            raise ValueError(f"{self._name}: request {rid!r} is already here")
        capacity = self.total_blocks * self.block_size
        if request.num_prompt_tokens + request.sampling.max_tokens > capacity:
            raise ValueError(
                f"{self._name}: request {rid!r} can never fit: {request.num_prompt_tokens} prompt tokens + "
                f"max_tokens {request.sampling.max_tokens} > capacity {capacity} tokens"
            )
        if option := unmodelled_option(request.sampling):
            raise ValueError(f"{self._name}: the sim engine does not model {option} (it has no logits); "
                             "serve a vLLM engine for it")
        request.status = RequestStatus.WAITING
        seq = _new_seq(request)
        self._seqs[rid] = seq
        self._enqueue(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if request_id in self._paused:
            del self._paused[request_id]
        elif request_id in self._handed:
            del self._handed[request_id]
        elif seq.request.status is RequestStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._dequeue(self._waiting.index(seq))
        self._free(seq)
        self._finish(seq, RequestStatus.ABORTED, FinishReason.ABORT, self._clock())

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        seq = self._seqs.get(request_id)
        return seq.request if seq is not None else None

    def step(self) -> StepResult:
        """Schedule (running requests first, preempting if needed; then admissions), run, postprocess."""
        if not self._running and not self._waiting:
            return StepResult()
        self._snapshot = None
        now = self._clock()
        chunks, preempted = self._schedule_running(now)
        # As vLLM: no admissions in a step that preempted, or the victim would bounce straight back.
        if not preempted:
            self._admit(chunks, now)
        # One pass for the step's price and who samples: only a sequence whose chunk reaches its
        # last token; the others were mid-prefill.
        sampling: list[_Chunk] = []
        prefills: list[tuple[int, int]] = []
        context = 0
        for chunk in chunks:
            seq, start, count, is_decode = chunk
            if is_decode:
                context += seq.num_tokens
                sampling.append(chunk)
            else:
                prefills.append((start, count))
                if start + count == seq.num_tokens:
                    sampling.append(chunk)
        duration = self.profile.step_time(prefills, len(chunks) - len(prefills), context)
        tokens = self._forward(chunks, sampling)
        # Computed once the forward pass ran (one that fails leaves nothing counted or cached).
        caching = self._prefix_caching
        for seq, start, count, is_decode in chunks:
            seq.num_computed = start + count
            # Prompt blocks are cached as soon as their prefill fills them (a request arriving
            # meanwhile shares them); blocks that decoding fills, when the request lets go of them.
            if not is_decode and caching:
                self._register_full_blocks(seq)
        outputs, finished = self._append_tokens(sampling, tokens, now + duration)
        if finished:
            # They have left _seqs but are still in the batch list.
            self._running = [s for s in self._running if s.request_id in self._seqs]
        if self._real_time and duration > 0:
            time.sleep(duration)
        return StepResult(
            outputs=tuple(outputs),
            preempted=tuple(preempted),
            duration=duration,
            num_prefill_tokens=sum(count for _, count in prefills),
            batch_size=len(chunks),
            finished=tuple(finished),
        )

    def prefix_events(self) -> PrefixEvents | None:
        """Blocks cached and evicted since the last call; None without prefix caching."""
        return self._blocks.drain_changes() if self._prefix_caching else None

    def snapshot(self) -> EngineSnapshot:
        """Cached until the next change; O(requests) to rebuild."""
        if self._snapshot is None:
            self._snapshot = self._build_snapshot()
        return self._snapshot

    def load_totals(self) -> LoadTotals:
        """O(priorities): read from counters kept current as requests move."""
        blocks, counts, waiting, pool = self._held_blocks, self._held_count, self._waiting, self._blocks
        # Running requests occupy what is neither free nor reserved: a cached block an incoming
        # migration reuses may also sit in a running request's table, and counts as reserved once.
        physical = pool.total_blocks - pool.free_blocks - pool.reserved_blocks
        return LoadTotals(
            total_blocks=pool.total_blocks,
            block_size=pool.block_size,
            free_blocks=pool.free_blocks,
            reserved_blocks=pool.reserved_blocks,
            running_blocks=physical_split({p: blocks[p] for p, n in counts.items() if n}, physical),
            running_count={p: n for p, n in counts.items() if n},
            num_waiting=len(waiting),
            head_of_line_demand=blocks_for(waiting[0].num_tokens, pool.block_size) if waiting else 0,
            waiting_demand=self._waiting_demand,
            pending_prefill_tokens=self._waiting_tokens,
            num_preemptions=self._num_preemptions,
        )

    def check_integrity(self) -> None:
        """Block accounting, request placement, and the load totals against a recount."""
        self._blocks.check_integrity()
        holders = self._running + list(self._paused.values())
        name = self._name
        assert len(self._seqs) == len(holders) + len(self._waiting) + len(self._handed), (
            f"{name}: a request is in two places or none")
        assert self._blocks.owners() == {s.request_id for s in holders}, f"{name}: a request not running holds blocks"
        for seq in self._seqs.values():
            assert seq.num_tokens == seq.request.num_tokens, f"{name}: request {seq.request_id!r} changed outside the engine"
            held = len(self._blocks.table(seq.request_id))
            assert seq.num_blocks == held, (
                f"{name}: request {seq.request_id!r} counts {seq.num_blocks} blocks, holds {held}"
            )
        for seq in holders:
            computed, held = seq.num_computed, seq.num_blocks
            assert 0 < computed < seq.num_tokens, f"{name}: request {seq.request_id!r} computed {computed} of {seq.num_tokens} tokens"
            assert blocks_for(computed, self.block_size) <= held <= blocks_for(computed + 1, self.block_size), (
                f"{name}: request {seq.request_id!r} holds {held} blocks for {computed} computed tokens"
            )
        for seq in self._waiting:
            assert seq.num_computed == 0, f"{name}: waiting request {seq.request_id!r} has computed tokens"
        recount = LoadTotals.from_snapshot(self._build_snapshot())
        assert self.load_totals() == recount, f"{name}: load totals {self.load_totals()} != recount {recount}"

    # ------------------------------------------------------------------ migration, source side
    def completed_blocks(self, request_id: str) -> int:
        seq = self._seq(request_id)
        if seq.request.status is not RequestStatus.RUNNING:
            return 0
        # A decoding request has KV for every token but the last sampled one; a prefilling one
        # for the chunks computed so far.
        return seq.num_computed // self.block_size

    def export_blocks(self, request_id: str, start: int, end: int) -> np.ndarray:
        """A copy of blocks [start, end) as one (end - start, block_size, kv_bytes_per_token) uint8 array.

        While the request runs only completed blocks may be exported. Once it is paused, every block
        up to blocks_for(num_tokens) may: its KV is final, and a block past the ones it holds (the
        one the next token's KV will go to) comes back as zeros.
        """
        return self.export_later(request_id, start, end).copy()

    def export_later(self, request_id: str, start: int, end: int) -> PendingBlocks:
        seq = self._seq(request_id)
        if request_id in self._paused:
            limit = blocks_for(seq.num_tokens, self.block_size)
        else:
            limit = self.completed_blocks(request_id)
        if not 0 <= start <= end <= limit:
            raise ValueError(f"{self._name}: request {request_id!r}: cannot export blocks [{start}, {end}); {limit} can be")
        held = list(self._blocks.table(request_id)[start:end])
        nbytes = (end - start) * int(np.prod(self._kv.shape[1:]))
        return PendingBlocks(nbytes, self._kv.export(held, end - start))

    def pause(self, request_id: str, *, waiting: bool = False) -> MigrationState:
        """A decoding request leaves the batch with its blocks; with `waiting`, a waiting one the queue."""
        seq = self._seq(request_id)
        rng_state = None if seq.rng is None else {"rng_state": seq.rng.bit_generator.state}
        if waiting:
            if request_id in self._handed or seq.request.status is not RequestStatus.WAITING:
                raise MigrationRefused(f"{self._name}: request {request_id!r} is not in the waiting queue")
            self._dequeue(self._waiting.index(seq))
            self._handed[request_id] = seq
            self._snapshot = None
            return MigrationState.capture(seq.request, rng_state, waiting=True)
        if request_id in self._paused or seq.request.status is not RequestStatus.RUNNING:
            raise MigrationRefused(f"{self._name}: request {request_id!r} is not in the running batch")
        if not _decoding(seq):
            raise MigrationRefused(f"{self._name}: request {request_id!r} is still prefilling")
        self._running.remove(seq)
        self._paused[request_id] = seq
        self._snapshot = None
        return MigrationState.capture(seq.request, rng_state)

    def unpause(self, request_id: str) -> None:
        """Back into the batch (at its end, as a request vLLM re-adds) or the queue (in its place);
        an id aborted meanwhile is ignored."""
        handed = self._handed.pop(request_id, None)
        if handed is not None:
            self._enqueue(handed)
            self._snapshot = None
            return
        seq = self._paused.pop(request_id, None)
        if seq is None:
            self._require_absent(request_id, "unpause")
            return
        self._running.append(seq)
        self._snapshot = None

    def free_migrated(self, request_id: str) -> None:
        """The request now lives on its destination; an id aborted meanwhile is ignored."""
        if self._handed.pop(request_id, None) is not None:
            del self._seqs[request_id]
            self._snapshot = None
            return
        seq = self._paused.pop(request_id, None)
        if seq is None:
            self._require_absent(request_id, "free")
            return
        del self._seqs[request_id]
        self._free(seq)
        self._snapshot = None

    # ------------------------------------------------------------------ migration, destination side
    def reserve_cached(self, migration_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        if not self._prefix_caching:
            return 0
        self._snapshot = None
        return len(self._blocks.reserve_cached(migration_id, salted(block_hashes(tokens, self.block_size), cache_salt)))

    def reserve_blocks(self, migration_id: str, num_blocks: int) -> bool:
        """Adds to the migration's reservation: each stage reserves the blocks it will import."""
        self._snapshot = None
        return self._blocks.reserve(migration_id, num_blocks)

    def release_reservation(self, migration_id: str) -> None:
        self._snapshot = None
        self._blocks.release(migration_id)

    def import_blocks(self, migration_id: str, start: int, buffer: Any) -> None:
        if migration_id not in self._blocks.migrations():
            raise MigrationRefused(f"{self._name}: no reservation for migration {migration_id!r}")
        reserved = self._blocks.reservation(migration_id)
        shape = self._kv.shape[1:]
        if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint8 or buffer.ndim != 3 or buffer.shape[1:] != shape:
            got = f"{buffer.dtype} {buffer.shape}" if isinstance(buffer, np.ndarray) else type(buffer).__name__
            raise MigrationRefused(
                f"{self._name}: migration {migration_id!r}: expected uint8 blocks of shape (n, {shape[0]}, {shape[1]}), got {got}"
            )
        end = start + len(buffer)
        if not 0 <= start <= end <= len(reserved):
            raise MigrationRefused(
                f"{self._name}: migration {migration_id!r}: blocks [{start}, {end}) outside the {len(reserved)} reserved"
            )
        self._kv.load(reserved[start:end], buffer)

    def resume(self, migration_id: str, state: MigrationState) -> None:
        """The reserved blocks become the request's block table (spare ones beyond its tokens are freed)."""
        rid = state.request_id
        if rid in self._seqs:
            raise MigrationRefused(f"{self._name}: request {rid!r} is already here")
        capacity = self.total_blocks * self.block_size
        if len(state.prompt_token_ids) + state.sampling.max_tokens > capacity:
            raise MigrationRefused(f"{self._name}: request {rid!r} can never finish within {capacity} tokens")
        if state.waiting:
            # Nothing computed came along: it queues here in its place to be (re)computed, and the
            # blocks reserved to know it fits go back.
            self._blocks.release(migration_id)
            request = state.to_request()
            seq = _new_seq(request, state.engine_state.get("rng_state"))
            self._seqs[rid] = seq
            self._enqueue(seq)
            self._snapshot = None
            return
        if not state.output_token_ids:
            raise MigrationRefused(f"{self._name}: request {rid!r} has no output yet; only running requests migrate")
        needed = blocks_for(state.num_tokens - 1, self.block_size)
        reserved = len(self._blocks.reservation(migration_id))
        if reserved < needed:
            raise MigrationRefused(
                f"{self._name}: migration {migration_id!r} reserved {reserved} blocks, request {rid!r} needs {needed}"
            )
        request = state.to_request()
        seq = _new_seq(request, state.engine_state.get("rng_state"))
        seq.num_computed = state.num_tokens - 1
        table = self._blocks.adopt(migration_id, rid, blocks_for(state.num_tokens, self.block_size))
        seq.num_blocks = len(table)
        self._held_blocks[seq.priority] += seq.num_blocks
        self._held_count[seq.priority] += 1
        self._seqs[rid] = seq
        self._running.append(seq)
        self._snapshot = None
        if self._prefix_caching:
            self._register_full_blocks(seq)

    # ------------------------------------------------------------------ scheduling
    def _schedule_running(self, now: float) -> tuple[list[_Chunk], list[str]]:
        """Running requests in batch order, each its next tokens within the budget (vLLM v1).

        A request whose tokens need a block when none is free preempts the lowest-priority,
        latest-arrived running request (vLLM's priority policy), handing back the budget of one
        already scheduled this step; when it is its own victim, nobody after it runs this step.
        """
        running, blocks, size = self._running, self._blocks, self.block_size
        budget = self._max_batched_tokens
        chunks: list[_Chunk] = []
        preempted: list[str] = []
        free = blocks.free_blocks  # kept current below: read once per sequence otherwise
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            tokens = seq.num_tokens
            count = tokens - computed
            if count > budget:
                count = budget
            needed = -(-(computed + count) // size) - seq.num_blocks
            while needed > free:
                victim = max(running, key=_queue_key)
                index = running.index(victim)
                del running[index]
                preempted.append(self._preempt(victim, now))
                free = blocks.free_blocks
                if victim is seq:
                    return chunks, preempted
                if index < i:
                    i -= 1
                    chunk = next(c for c in chunks if c.seq is victim)
                    chunks.remove(chunk)
                    budget += chunk.count
            if needed > 0:
                self._allocate(seq, needed)
                free -= needed
            chunks.append(_Chunk(seq, computed, count, computed == tokens - 1))
            budget -= count
            i += 1
        return chunks, preempted

    def _admit(self, chunks: list[_Chunk], now: float) -> None:
        """Head of the queue first while the budget lasts and its whole prompt fits (FCFS: a head
        that does not fit blocks the rest); the last one admitted may get only a first chunk."""
        running, waiting, size = self._running, self._waiting, self.block_size
        if not waiting:
            return
        budget = self._max_batched_tokens - sum(c.count for c in chunks)
        while waiting and budget > 0 and len(running) < self._max_num_seqs:
            seq = waiting[0]
            hit = self._cached_prefix(seq)
            # Blocks for the uncached rest, and the cached ones nobody holds (they leave the free pool).
            if not self._blocks.can_allocate(self._blocks.blocks_to_take(blocks_for(seq.num_tokens, size) - len(hit), hit)):
                break
            computed = len(hit) * size
            count = min(seq.num_tokens - computed, budget)
            self._dequeue(0)
            self._share(seq, hit)
            self._allocate(seq, blocks_for(computed + count, size) - len(hit))
            seq.request.status = RequestStatus.RUNNING
            timing = seq.request.timing
            if timing.first_scheduled is None:
                timing.first_scheduled = now
                if self._prefix_caching:
                    timing.cached_tokens = computed
            running.append(seq)
            chunks.append(_chunk(seq, computed, count))
            budget -= count

    def _cached_prefix(self, seq: _Seq) -> list[int]:
        """Blocks of the prefix cache this waiting request can start from: the longest cached run
        of its full blocks, short of its last token (which is computed to sample the next one)."""
        if not self._prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        version = self._blocks.cache_version
        memo = seq.prefix_memo
        if memo is not None and memo[0] == version and memo[1] == limit:
            return memo[2]
        hit = self._blocks.cached_prefix(self._keys(seq, limit), limit)
        seq.prefix_memo = (version, limit, hit)
        return hit

    def _hashes(self, seq: _Seq, num_blocks: int) -> list[int]:
        """The request's first `num_blocks` block hashes (its tokens cover them), computed once."""
        known = seq.block_hashes
        if len(known) < num_blocks:
            size = self.block_size
            request = seq.request
            tokens = _token_range(request, len(known) * size, num_blocks * size)
            known += block_hashes(tokens, size, parent=known[-1] if known else ROOT_HASH)
        return known

    def _keys(self, seq: _Seq, num_blocks: int) -> list[int]:
        """The prefix cache's keys of the request's first `num_blocks` blocks (at least), computed once."""
        hashes = self._hashes(seq, num_blocks)
        keys = seq.cache_keys
        if keys is not hashes and len(keys) < len(hashes):
            keys += salted(hashes[len(keys):], seq.request.cache_salt)
        return keys

    def _register_full_blocks(self, seq: _Seq) -> None:
        """Cache the request's blocks not cached yet, up to the last one its computed KV fills."""
        full = seq.num_computed // self.block_size
        if full <= seq.registered:
            return
        keys = self._keys(seq, full)
        table = self._blocks.table(seq.request_id)
        for index in range(seq.registered, full):
            self._blocks.register(table[index], keys[index], reported=is_anchor(index, self.block_size))
        seq.registered = full

    def _preempt(self, seq: _Seq, now: float) -> str:
        """Recompute later: free the blocks, back to waiting (its queue key puts it ahead of later arrivals)."""
        self._free(seq)
        seq.num_computed = 0
        request = seq.request
        request.status = RequestStatus.WAITING
        request.timing.preemptions += 1
        request.timing.preempted_at = now
        self._num_preemptions += 1
        self._enqueue(seq)
        return seq.request_id

    # ------------------------------------------------------------------ model
    def _forward(self, chunks: list[_Chunk], sampling: list[_Chunk]) -> list[int]:
        """Write the KV this step computes, then sample one token for each of `sampling`.

        A chunk computes the request's tokens [start, start + count): part or all of a prompt (or
        of prompt + output when it recomputes after a preemption), or the last sampled token of a
        decode. The token at position q comes from the content of slot q - 1 and three earlier
        slots picked by q. A step where nobody samples (prompts mid-prefill) writes their KV all the same.
        """
        content = self._kv.shape[2]
        if content and chunks:
            self._write_kv(chunks)
        if not sampling:
            return []
        if not content and len(sampling) <= _SMALL_BATCH:
            return self._tokens_without_content(sampling)
        n = _u64([c.seq.num_tokens for c in sampling])
        hashes = np.fromiter((c.seq.prompt_hash for c in sampling), dtype=_U64, count=len(sampling))
        if content:
            logits = self._read_kv(sampling, n, hashes)
        else:
            logits = mix(hashes ^ (n * _K_POS))
        if not all(c.seq.greedy for c in sampling):
            logits ^= _u64([0 if c.seq.greedy else self._salt(c.seq, c.seq.num_tokens) for c in sampling])
        return (mix(logits) % self._vocab).tolist()

    def _tokens_without_content(self, sampling: list[_Chunk]) -> list[int]:
        """The content-free tokens of `_forward` for a small batch, in Python integers: the same
        values (a test holds the two paths equal), without the fixed cost of a dozen numpy calls,
        which dominates a step of a few sequences."""
        vocab, tokens = int(self._vocab), []
        for chunk in sampling:
            seq = chunk[0]
            n = seq.num_tokens
            logit = mix_int(seq.prompt_hash ^ ((n * _K_POS_INT) & _MASK64))
            if not seq.greedy:
                logit ^= self._salt(seq, n)
            tokens.append(mix_int(logit) % vocab)
        return tokens

    @staticmethod
    def _salt(seq: _Seq, position: int) -> int:
        """Temperature > 0: a value from (seed, position), or the next draw of the request's RNG."""
        if seq.rng is not None:
            return int(seq.rng.integers(0, 2**63, dtype=np.int64))
        return (seq.seed_key + position) & _MASK64

    def _write_kv(self, chunks: list[_Chunk]) -> None:
        size = self.block_size
        tokens, positions, hashes, blocks = [], [], [], []
        for chunk in chunks:
            seq, start, count = chunk.seq, chunk.start, chunk.count
            request = seq.request
            if chunk.is_decode:
                last = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
                values = _u64([last])
            else:
                values = np.asarray((request.prompt_token_ids + request.output_token_ids)[start : start + count], dtype=_U64)
            tokens.append(values)
            position = np.arange(start, start + count, dtype=np.int64)
            positions.append(position)
            # A slot's content depends on its token, its position and every token before its
            # block (the parent block's hash): requests sharing a prefix write the same bytes.
            first, last = start // size, (start + count - 1) // size
            chain = self._hashes(seq, last)
            parents = _u64([chain[b - 1] if b else ROOT_HASH for b in range(first, last + 1)])
            hashes.append(parents[position // size - first])
            blocks.append(np.asarray(self._blocks.table(seq.request_id), dtype=np.int64)[position // size])
        position = np.concatenate(positions)
        self._kv.write(np.concatenate(blocks), position % size, self._slot_bytes(
            np.concatenate(tokens), position.astype(_U64), np.concatenate(hashes)
        ))

    def _read_kv(self, sampling: list[_Chunk], n: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        size = self.block_size
        picks = np.empty((len(sampling), _NUM_LOOKBACK + 1), dtype=_U64)
        picks[:, 0] = n - _U64(1)
        for k in range(1, _NUM_LOOKBACK + 1):
            picks[:, k] = mix(hashes ^ (n * _K_PICK + _U64(k))) % n
        slots = picks.astype(np.int64)
        tables = [self._blocks.table(c.seq.request_id) for c in sampling]
        read_blocks = [[table[p // size] for p in row] for table, row in zip(tables, slots.tolist())]
        digests = self._kv.read(np.array(read_blocks, dtype=np.int64), slots % size).astype(_U64) @ self._weights
        return mix((digests * self._combine).sum(axis=1) ^ n)

    def _slot_bytes(self, tokens: np.ndarray, positions: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        h = mix(tokens * _K_TOKEN ^ positions * _K_POS ^ hashes)
        return ((h[:, None] * self._spread[None, :]) >> _U64(56)).astype(np.uint8)

    # ------------------------------------------------------------------ helpers
    def _append_tokens(self, sampling: list[_Chunk], tokens: list[int], now: float) -> tuple[list[TokenOutput], list[Request]]:
        """Each sampling sequence's new token, sampled at `now`: the outputs, and the requests it
        finished (their blocks freed). One loop per step: it runs once per token of a simulation."""
        outputs: list[TokenOutput] = []
        finished: list[Request] = []
        for chunk, token in zip(sampling, tokens):
            seq = chunk[0]
            request = seq.request
            sampling_params = request.sampling
            output = request.output_token_ids
            stops = sampling_params.stop_token_ids
            if stops and len(output) < sampling_params.min_tokens and token in stops:
                token = _unstopped(token, stops, int(self._vocab))
            output.append(token)
            seq.num_tokens += 1
            timing = request.timing
            if timing.first_token is None:
                timing.first_token = now
            timing.last_token = now
            if timing.preempted_at is not None:
                timing.preemption_loss += now - timing.preempted_at
                timing.preempted_at = None
            reason = None
            if stops and token in stops:
                reason = FinishReason.STOP
            elif len(output) >= sampling_params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                del self._seqs[seq.request_id]
                self._free(seq)
                self._finish(seq, RequestStatus.FINISHED, reason, now)
                finished.append(request)
            if len(output) == 1 and timing.cached_tokens is not None:
                outputs.append(TokenOutput(seq.request_id, 0, (token,), reason is not None, reason,
                                           cached_tokens=timing.cached_tokens))
            else:
                outputs.append(TokenOutput(seq.request_id, len(output) - 1, (token,), reason is not None, reason))
        return outputs, finished

    def _finish(self, seq: _Seq, status: RequestStatus, reason: FinishReason, now: float) -> None:
        seq.request.status = status
        seq.request.finish_reason = reason
        seq.request.timing.finished = now
        self._snapshot = None

    # ------------------------------------------------------------------ load totals
    # Every change to a request's blocks or to the waiting queue goes through these four (and
    # resume, which adopts a reservation), so the load totals and _Seq.num_blocks stay exact.
    def _allocate(self, seq: _Seq, num_blocks: int) -> None:
        self._blocks.allocate(seq.request_id, num_blocks)
        if not seq.num_blocks:
            self._held_count[seq.priority] += 1
        seq.num_blocks += num_blocks
        self._held_blocks[seq.priority] += num_blocks

    def _share(self, seq: _Seq, blocks: list[int]) -> None:
        """A prefix hit: the request starts with cached blocks (each holder counts them, as every
        engine's per-request block tables do)."""
        seq.registered = len(blocks)
        if blocks:
            self._blocks.share(seq.request_id, blocks)
            self._held_count[seq.priority] += 1
            seq.num_blocks = len(blocks)
            self._held_blocks[seq.priority] += len(blocks)

    def _free(self, seq: _Seq) -> None:
        if self._prefix_caching and seq.num_blocks:
            self._register_full_blocks(seq)
        seq.registered = 0
        if seq.num_blocks:
            self._held_blocks[seq.priority] -= seq.num_blocks
            self._held_count[seq.priority] -= 1
            seq.num_blocks = 0
            self._blocks.free(seq.request_id)

    def _enqueue(self, seq: _Seq) -> None:
        bisect.insort(self._waiting, seq, key=_queue_key)
        self._waiting_tokens += seq.num_tokens
        self._waiting_demand += blocks_for(seq.num_tokens, self._blocks.block_size)
        self._snapshot = None

    def _dequeue(self, index: int) -> None:
        seq = self._waiting.pop(index)
        self._waiting_tokens -= seq.num_tokens
        self._waiting_demand -= blocks_for(seq.num_tokens, self._blocks.block_size)

    def _build_snapshot(self) -> EngineSnapshot:
        running = [self._load(s, True, _decoding(s)) for s in self._running]
        running += [self._load(s, True, False) for s in self._paused.values()]
        return EngineSnapshot(
            total_blocks=self.total_blocks,
            block_size=self.block_size,
            free_blocks=self._blocks.free_blocks,
            reserved_blocks=self._blocks.reserved_blocks,
            running=tuple(running),
            waiting=tuple(self._load(s, False, True) for s in self._waiting),
            num_preemptions=self._num_preemptions,
        )

    def _load(self, seq: _Seq, running: bool, migratable: bool) -> RequestLoad:
        request = seq.request
        return RequestLoad(
            request_id=seq.request_id,
            running=running,
            num_blocks=len(self._blocks.table(seq.request_id)),
            num_tokens=seq.num_tokens,
            num_prompt_tokens=len(request.prompt_token_ids),
            execution_priority=request.execution_priority,
            scheduling_priority=request.scheduling_priority,
            migratable=migratable,
        )

    def _seq(self, request_id: str) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise MigrationRefused(f"{self._name}: no request {request_id!r}")
        return seq

    def _require_absent(self, request_id: str, action: str) -> None:
        if request_id in self._seqs:
            raise MigrationRefused(f"{self._name}: cannot {action} request {request_id!r}: it is not paused")
