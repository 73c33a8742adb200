"""The Engine contract: what a llumlet needs from an instance, at block granularity.

Both engines implement it: `sim` (vLLM's block manager, batching and preemption with a latency
model instead of a model) and `vllm` (a real vLLM instance). The llumlet never touches tensors;
the engine never knows about other instances.

Migration primitives follow the paper's protocol (section 4.2):
reserve_blocks / import_blocks on the destination, completed_blocks / export_blocks / pause /
unpause / free_migrated on the source, resume on the destination at COMMIT. A destination first
reuses what its prefix cache holds of the migrant (`reserve_cached`): those blocks are not copied. `export_later`
splits block fusion in two, so that a host can copy a stage out while its engine keeps stepping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

from llumdask.prefix import PrefixEvents
from llumdask.request import FinishReason, Priority, Request, RequestStatus, RequestTiming, SamplingParams, blocks_for


class TokenLogprob(NamedTuple):
    """One position's log probabilities: of the token there, and the most likely alternatives
    (token id, log probability), most likely first, as many as the request asked for (the i-th
    has rank i + 1). `rank` is the token's own in the vocabulary (1: the likeliest), None where
    the engine does not say."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


class TokenOutput(NamedTuple):
    """New tokens of one request from one step. `first_index` is the position of
    `token_ids[0]` in the request's output: the sequence number the frontend orders by.
    `logprobs` is one entry per token when the request asked for them; `prompt_logprobs` one
    per prompt token (None for the first, which nothing predicts), on the request's first output;
    `cached_tokens`, on the first output too, the prompt tokens the engine found in its prefix
    cache (None: the engine does not say).

    A named tuple rather than a frozen dataclass: one is made per request per step, the most
    made object of a simulation, and a tuple is built several times faster."""

    request_id: str
    first_index: int
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int | None = None


class StepResult(NamedTuple):
    """What one engine step did. A named tuple, as `TokenOutput`: one is made per step of every
    instance, the second most made object of a simulation."""

    outputs: tuple[TokenOutput, ...] = ()
    preempted: tuple[str, ...] = ()
    # Seconds the step took (modeled by the sim engine, measured by a real one).
    duration: float = 0.0
    num_prefill_tokens: int = 0
    batch_size: int = 0
    # Requests that finished in this step, with their final timing: the engine forgets them now.
    finished: tuple[Request, ...] = ()


@dataclass(frozen=True)
class RequestLoad:
    """One request's share of an instance's load, for Algorithm 1 and for picking a migrant."""

    request_id: str
    running: bool
    num_blocks: int
    num_tokens: int
    num_prompt_tokens: int
    execution_priority: Priority
    scheduling_priority: Priority
    migratable: bool = True
    # Never migratable: its sampling options cannot move exactly (seeded sampling on vLLM, ...).
    pinned: bool = False


@dataclass(frozen=True)
class EngineSnapshot:
    total_blocks: int
    block_size: int
    free_blocks: int
    reserved_blocks: int
    # Running requests in batch order, waiting requests in queue order (head first).
    running: tuple[RequestLoad, ...] = ()
    waiting: tuple[RequestLoad, ...] = ()
    num_preemptions: int = 0


class LoadTotals(NamedTuple):
    """An instance's load as sums: exactly what Algorithm 1 and the load report read.

    Why it exists: a llumlet reports load after every step, and the snapshot builds one
    `RequestLoad` per request. Engines keep these sums current (or gather them in one pass without
    per-request objects), so a report costs O(priorities) instead of O(requests). The snapshot
    stays for what needs individual requests (picking a migrant, tests); `from_snapshot` is the
    reference definition every engine's `load_totals()` must equal.

    Running requests are counted by execution priority, paused ones (the last stage of a
    migration out) included: they still hold their blocks. Priorities with no running request
    are absent from both maps. Every field is the `InstanceLoad` field of the same name (the
    llumlet copies them over by name). A named tuple: one is made per load report.
    """

    total_blocks: int
    block_size: int
    free_blocks: int
    reserved_blocks: int
    # Physical blocks held by running requests, and how many there are, per execution priority.
    # A block shared through the prefix cache counts once (`physical_split`).
    running_blocks: dict[Priority, int]
    running_count: dict[Priority, int]
    num_waiting: int
    # Blocks the head-of-line waiting request still needs for its tokens (0 when nothing waits).
    head_of_line_demand: int
    # Blocks every waiting request still needs, and the tokens those blocks are for (prefill work
    # not yet done). A waiting request may hold blocks already (on vLLM until its first step, a
    # migrant's copied KV or a rolled-back request's own): those are counted as taken, not again
    # as demand.
    waiting_demand: int
    pending_prefill_tokens: int
    num_preemptions: int
    # Running requests pinned by their sampling options (the sim engine pins none).
    num_pinned: int = 0

    @property
    def num_running(self) -> int:
        return sum(self.running_count.values())

    @classmethod
    def tally(
        cls,
        *,
        total_blocks: int,
        block_size: int,
        free_blocks: int,
        reserved_blocks: int,
        running: Iterable[tuple[Priority, int]],
        waiting: Sequence[tuple[int, int]],
        num_preemptions: int,
        num_pinned: int = 0,
    ) -> "LoadTotals":
        """Sum per-request figures: `running` as (execution priority, blocks held), `waiting` as
        (tokens, blocks held) in queue order (head first)."""
        running_blocks: dict[Priority, int] = {}
        running_count: dict[Priority, int] = {}
        for priority, blocks in running:
            running_blocks[priority] = running_blocks.get(priority, 0) + blocks
            running_count[priority] = running_count.get(priority, 0) + 1
        demand = [max(0, blocks_for(n, block_size) - held) for n, held in waiting]
        return cls(
            total_blocks=total_blocks,
            block_size=block_size,
            free_blocks=free_blocks,
            reserved_blocks=reserved_blocks,
            running_blocks=physical_split(running_blocks, total_blocks - free_blocks - reserved_blocks),
            running_count=running_count,
            num_waiting=len(demand),
            head_of_line_demand=demand[0] if demand else 0,
            waiting_demand=sum(demand),
            pending_prefill_tokens=sum(max(0, n - held * block_size) for n, held in waiting),
            num_preemptions=num_preemptions,
            num_pinned=num_pinned,
        )

    @classmethod
    def from_snapshot(cls, snapshot: "EngineSnapshot") -> "LoadTotals":
        """The totals recounted request by request (O(requests)): the reference for checks."""
        return cls.tally(
            total_blocks=snapshot.total_blocks,
            block_size=snapshot.block_size,
            free_blocks=snapshot.free_blocks,
            reserved_blocks=snapshot.reserved_blocks,
            running=[(r.execution_priority, r.num_blocks) for r in snapshot.running],
            waiting=[(w.num_tokens, w.num_blocks) for w in snapshot.waiting],
            num_preemptions=snapshot.num_preemptions,
            num_pinned=sum(r.pinned for r in snapshot.running),
        )


def physical_split(held: dict[Priority, int], physical: int) -> dict[Priority, int]:
    """Blocks held per priority as block tables count them (a block shared by k requests k
    times), brought down to the `physical` blocks they occupy: each priority keeps its share,
    rounded down, and the rounding's remainder goes to the priority holding most (then the
    higher). Unchanged when nothing is shared."""
    logical = sum(held.values())
    if logical <= physical:
        return held
    split = {p: n * physical // logical for p, n in held.items()}
    largest = max(held, key=lambda p: (held[p], int(p)))
    split[largest] += physical - sum(split.values())
    return split


@dataclass
class MigrationState:
    """Everything the destination needs to continue a request exactly where the source paused it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    scheduling_priority: Priority
    execution_priority: Priority
    arrival_time: float
    # Timing travels with the request so metrics span its whole life, across instances.
    timing: RequestTiming | None = None
    cache_salt: str | None = None
    # Engine-specific continuation (RNG state, counters); opaque to the llumlet.
    engine_state: dict[str, Any] = field(default_factory=dict)
    # Taken from the waiting queue: no KV came along, the destination queues it to compute.
    waiting: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def capture(cls, request: Request, engine_state: dict[str, Any] | None = None, *,
                waiting: bool = False) -> "MigrationState":
        """The source side: a copy of the request's continuation (nothing shared with the original)."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling=request.sampling,
            scheduling_priority=request.scheduling_priority,
            execution_priority=request.execution_priority,
            arrival_time=request.arrival_time,
            timing=dataclasses.replace(request.timing),
            cache_salt=request.cache_salt,
            engine_state=engine_state or {},
            waiting=waiting,
        )

    def to_request(self) -> Request:
        """The destination side: the request this state continues (waiting or running as it left),
        its timing carried over and its migrations counted one more."""
        request = Request(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling=self.sampling,
            scheduling_priority=self.scheduling_priority,
            execution_priority=self.execution_priority,
            arrival_time=self.arrival_time,
            output_token_ids=list(self.output_token_ids),
            status=RequestStatus.WAITING if self.waiting else RequestStatus.RUNNING,
            cache_salt=self.cache_salt,
        )
        if self.timing is not None:
            request.timing = dataclasses.replace(self.timing)
        request.timing.migrations += 1
        return request


@dataclass(frozen=True)
class PendingBlocks:
    """A stage's blocks, chosen on the engine's thread and copied by `copy()` later, on any
    thread, while the engine goes on stepping.

    Safe because the blocks are final: a running request's completed blocks are never written
    again, and a paused request's blocks stay held until COMMIT, which needs the copy delivered.
    Should the request let go of its blocks first (finished, preempted, aborted, rolled back),
    the copy may read blocks already reused; the source then aborts the migration (at its next
    step or stage ack), so such a copy never reaches a resumed request.
    """

    nbytes: int
    copy: Callable[[], Any]


class MigrationRefused(Exception):
    """A migration primitive cannot proceed (no blocks, request gone, not migratable)."""


@runtime_checkable
class Engine(Protocol):
    """One model instance. All methods are synchronous and called from one thread at a time."""

    @property
    def block_size(self) -> int: ...

    @property
    def total_blocks(self) -> int: ...

    @property
    def high_priority_headroom(self) -> int | None:
        """Tokens of high-priority headroom derived from this engine's latency profile
        (`llumdask.engine.headroom`); None for an engine without one."""

    # ------------------------------------------------------------------ serving
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it can never fit (prompt + max_tokens > capacity)."""

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks; unknown ids are ignored."""

    def step(self) -> StepResult:
        """Schedule, run one iteration (prefills and one decode token per running request), postprocess."""

    def has_work(self) -> bool: ...

    def snapshot(self) -> EngineSnapshot:
        """Every request's load, one `RequestLoad` each: O(requests)."""

    def load_totals(self) -> LoadTotals:
        """The snapshot's sums (`LoadTotals.from_snapshot`) without building it: cheap enough for
        a load report after every step."""

    def prefix_events(self) -> PrefixEvents | None:
        """Prefix-cache changes since the last call, for the global scheduler's index (the
        hashes of `llumdask.prefix`); None where the engine reports none."""

    def get_request(self, request_id: str) -> Request | None: ...

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used + reserved == total and no block has two owners."""

    # ------------------------------------------------------------------ migration, source side
    def completed_blocks(self, request_id: str) -> int:
        """Blocks of the request whose every slot holds computed KV (safe to copy now)."""

    def export_blocks(self, request_id: str, start: int, end: int) -> Any:
        """Block fusion: the request's blocks [start, end) gathered into one contiguous buffer."""

    def export_later(self, request_id: str, start: int, end: int) -> PendingBlocks:
        """`export_blocks` checked now, copied when the result's `copy()` runs (any thread)."""

    def pause(self, request_id: str, *, waiting: bool = False) -> MigrationState:
        """Take a running request out of the batch (blocks kept), or with `waiting` one out of the
        waiting queue (holding nothing), and return its continuation state."""

    def unpause(self, request_id: str) -> None:
        """Rollback: put a paused request back where it was taken from, as if nothing happened."""

    def free_migrated(self, request_id: str) -> None:
        """After COMMIT: forget a paused request and free its blocks (a waiting one held none)."""

    # ------------------------------------------------------------------ migration, destination side
    def reserve_cached(self, migration_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Open an incoming migration's reservation with the blocks of the longest prefix of
        `tokens` (the migrant's whole blocks of computed KV) this instance caches under the
        migrant's `cache_salt`: held from now on, never copied; how many (0 without a prefix
        cache). Before any `reserve_blocks`."""

    def reserve_blocks(self, migration_id: str, num_blocks: int) -> bool:
        """Set aside blocks for an incoming migration; False when they are not free."""

    def release_reservation(self, migration_id: str) -> None:
        """Free every block reserved or imported under this migration (abort path); idempotent."""

    def import_blocks(self, migration_id: str, start: int, buffer: Any) -> None:
        """Write a fused buffer into the migration's blocks, starting at block index `start`."""

    def resume(self, migration_id: str, state: MigrationState) -> None:
        """COMMIT: turn the migration's blocks into a running request continuing from `state`; a
        waiting `state` instead joins the queue in its place and its reservation is released."""
