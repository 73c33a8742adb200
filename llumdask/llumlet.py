"""The llumlet: one instance's agent. Reports load, picks migrants, runs live migration.

Sans-IO: the llumlet never waits. It is driven by four calls from its host (a Dask worker, the
simulator, a test): `step()` after each engine iteration, `on_message()` for each migration
message, `tick()` for timeouts, and `peer_lost()` when a peer dies. It talks to peers only through
the injected `Transport`, so the same code runs on a virtual clock and across processes.

Protocol (paper section 4.2). Source, per stage k: PRE-ALLOC n blocks -> ACK -> send the blocks
completed so far as one fused buffer -> StageAck -> next stage, while the request keeps decoding.
When little is left (or the stage budget is spent) the last stage reserves the tail, plus slack
for the tokens decoded while the reservation travels, and only on its ACK pauses the request and
sends the remaining blocks and its state; the destination resumes it and answers Committed; the
source then frees it. So the pause lasts one round trip. (A tail that outgrew the slack is
reserved again while paused.) Any refusal, abort, timeout, finish, preemption or dead peer ends
the migration with every reserved block released and the request running on its source. The
destination refuses a normal-priority migrant's first stage that would leave its own queue less
room than the scheduler's placement rule leaves a new normal-priority request
(`dispatch.hold-freeness`); a high-priority one, which dispatch never holds, is not checked.

A waiting request (queued, or preempted and re-queued) moves in one round trip: one PRE-ALLOC
for its whole (re)computation, which the destination refuses if its own queue holds an earlier
request; on ACK the source takes it from its queue and sends its state alone; the destination
queues it in its place and releases the reservation, which only made sure it fits.

Stage copies: by default the source fuses a stage's blocks when it sends the stage, on the
thread that drives it. A host whose transport copies `PendingBlocks` payloads itself (see
`deferred_copies`) gets them uncopied instead, so that its engine keeps stepping meanwhile.

Commit ownership: the source stays authoritative until it sees Committed. If it gives up first
(timeout), its Abort makes a destination that already resumed the request drop its copy; greedy
and seeded tokens are identical on both, and receivers drop duplicate sequence numbers.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from llumdask.config import LlumdaskConfig
from llumdask.engine.base import Engine, MigrationRefused, MigrationState, StepResult, TokenOutput
from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixEvents
from llumdask.protocol import Abort, Committed, MigrationMessage, PreAlloc, PreAllocReply, StageAck, StageData
from llumdask.request import Priority, Request, RequestStatus, blocks_for
from llumdask.transport import Transport

# Committed incoming migrations remembered so that a late Abort from their source can be honoured.
_COMMITTED_MEMORY = 1024


class MigrationEventKind(enum.Enum):
    STARTED = "started"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class MigrationEvent:
    kind: MigrationEventKind
    migration_id: str
    request_id: str
    source: str
    destination: str
    time: float
    stages: int = 0
    blocks: int = 0
    bytes: int = 0
    downtime: float = 0.0
    # Of the downtime: the source's part (pause to the last stage handed to the transport) and
    # the destination's (that stage received to the request resumed); the rest is the transport,
    # both ways. Where an O(n) part of a downtime lives.
    downtime_source: float = 0.0
    downtime_destination: float = 0.0
    reason: str = ""
    # Of `blocks`, those the destination had cached: never copied, no bytes.
    reused_blocks: int = 0
    # A waiting request's: no KV moved, no downtime (it was not running).
    waiting: bool = False


class _Phase(enum.Enum):
    AWAIT_PREALLOC = "await-prealloc"
    AWAIT_STAGE_ACK = "await-stage-ack"
    AWAIT_COMMIT = "await-commit"


@dataclass
class _Outgoing:
    """Source-side state of one migration."""

    migration_id: str
    request_id: str
    destination: str
    started: float
    preemptions_at_start: int
    deadline: float
    phase: _Phase = _Phase.AWAIT_PREALLOC
    stage: int = 0
    sent_blocks: int = 0
    stage_blocks: int = 0
    last: bool = False
    bytes: int = 0
    reused_blocks: int = 0
    state: MigrationState | None = None
    paused_at: float | None = None
    # When the last stage (with the request's state) went to the transport.
    handed_at: float | None = None
    # Taken from the waiting queue: one PreAlloc for its whole computation, no KV to copy.
    waiting: bool = False
    # The migrant's, for the destination's check of its queue's room.
    execution_priority: Priority = Priority.NORMAL


@dataclass
class _Incoming:
    """Destination-side state of one migration."""

    migration_id: str
    request_id: str
    source: str
    deadline: float
    reserved_blocks: int = 0


def _noop(_: Any) -> None:
    return None


class Llumlet:
    """Per-instance agent; every method must be called from one thread at a time."""

    def __init__(
        self,
        instance_id: str,
        engine: Engine,
        transport: Transport,
        config: LlumdaskConfig,
        clock: Callable[[], float],
        on_tokens: Callable[[TokenOutput], None] | None = None,
        on_event: Callable[[MigrationEvent], None] | None = None,
        deferred_copies: bool = False,
    ) -> None:
        """`deferred_copies`: stages leave as `PendingBlocks` that the transport copies
        (`Engine.export_later`), instead of buffers fused here."""
        self.instance_id = instance_id
        self.engine = engine
        self._transport = transport
        self._migration = config.migration
        self._hold_freeness = config.dispatch.hold_freeness
        self._clock = clock
        self._on_tokens = on_tokens or _noop
        self._on_event = on_event or _noop
        self._deferred_copies = deferred_copies
        self._received = 0
        self._migration_numbers = itertools.count()
        self._terminating = False
        self._drain_order = 0
        self._outgoing: dict[str, _Outgoing] = {}
        self._outgoing_by_request: dict[str, str] = {}
        self._incoming: dict[str, _Incoming] = {}
        self._committed_in: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ serving
    def add_request(self, request: Request) -> None:
        """Accept a dispatched request (the engine validates that it can ever fit). Received
        whether the engine takes it or not: the scheduler stops counting it as on its way."""
        try:
            self.engine.add_request(request)
        finally:
            self._received += 1

    def received_unadded(self, count: int) -> None:
        """Requests handed over that the engine did not add (refused unseen with another of their
        call, or running here already): received too, so that the scheduler stops counting them
        as on their way."""
        self._received += count

    def abort_request(self, request_id: str) -> None:
        migration_id = self._outgoing_by_request.get(request_id)
        if migration_id is not None:
            self._abort_outgoing(self._outgoing[migration_id], "request aborted", notify=True)
        self.engine.abort_request(request_id)

    def step(self) -> StepResult:
        """One engine iteration; forward tokens; abort migrations whose request finished or was preempted."""
        result = self.engine.step()
        on_tokens = self._on_tokens
        if on_tokens is not _noop:
            for output in result.outputs:
                on_tokens(output)
        if self._outgoing:
            for out in list(self._outgoing.values()):
                if out.state is None:
                    reason = self._source_lost_reason(out)
                    if reason:
                        self._abort_outgoing(out, reason, notify=True)
        return result

    def set_terminating(self, flag: bool, order: int = 0) -> None:
        """A terminating instance reports infinite usage (drained by migration) and takes no migrants.
        `order`: the scheduler's number for this drain order, echoed in every report from now on."""
        self._terminating = flag
        self._drain_order = order

    @property
    def terminating(self) -> bool:
        return self._terminating

    def load_report(self) -> InstanceLoad:
        """O(priorities): built from the engine's load totals, never from per-request loads."""
        totals = self.engine.load_totals()
        # Every field of LoadTotals is the InstanceLoad field of the same name.
        return InstanceLoad(
            instance_id=self.instance_id,
            num_running=totals.num_running,
            num_migrating_out=len(self._outgoing),
            num_migrating_in=len(self._incoming),
            num_received=self._received,
            terminating=self._terminating,
            drain_order=self._drain_order,
            timestamp=self._clock(),
            **totals._asdict(),
        )

    def prefix_events(self) -> PrefixEvents | None:
        """The engine's prefix-cache changes since the last call (sent beside each load report)."""
        return self.engine.prefix_events()

    def migrations_in_flight(self) -> int:
        return len(self._outgoing) + len(self._incoming)

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    # ------------------------------------------------------------------ source side
    def choose_migrant(self, take_waiting: bool = False) -> tuple[str, bool] | None:
        """With `take_waiting` (the destination queues nothing), the head of the waiting queue
        first: here it waits behind the load migration drains, there it starts at once, and it
        moves without KV (Llumnix's first-come-waiting rule; a request preempted here waits too).
        Else a running request: lower execution priority first, then shorter sequence (cheapest
        to move, least harm). (request id, whether it waits)."""
        snap = self.engine.snapshot()
        if take_waiting and snap.waiting:
            head = snap.waiting[0]
            if head.migratable and head.request_id not in self._outgoing_by_request:
                return head.request_id, True
        candidates = [
            r for r in snap.running if r.migratable and r.request_id not in self._outgoing_by_request
        ]
        if not candidates:
            return None
        best = min(candidates, key=lambda r: (int(r.execution_priority), r.num_tokens, r.request_id))
        return best.request_id, False

    def migrate_out(self, destination: str, request_id: str | None = None, *, take_waiting: bool = False) -> str | None:
        """Start migrating one request (`choose_migrant`'s, or the running `request_id`); None when
        nothing can move now."""
        if destination == self.instance_id or len(self._outgoing) >= self._migration.max_concurrent:
            return None
        waiting = False
        if request_id is None:
            chosen = self.choose_migrant(take_waiting)
            if chosen is None:
                return None
            request_id, waiting = chosen
        elif request_id in self._outgoing_by_request or not self._is_migratable(request_id):
            return None
        now = self._clock()
        request = self.engine.get_request(request_id)
        assert request is not None
        migration_id = f"{self.instance_id}:{next(self._migration_numbers)}:{request_id}"
        out = _Outgoing(
            migration_id=migration_id,
            request_id=request_id,
            destination=destination,
            started=now,
            preemptions_at_start=request.timing.preemptions,
            deadline=now + self._migration.handshake_timeout,
            execution_priority=request.execution_priority,
            waiting=waiting,
        )
        self._outgoing[migration_id] = out
        self._outgoing_by_request[request_id] = migration_id
        self._emit(MigrationEventKind.STARTED, out)
        if out.waiting:
            # Room for its whole (re)computation: the check that it fits there now; nothing is copied.
            self._prealloc(out, blocks_for(request.num_tokens, self.engine.block_size), queue_key=request.queue_key())
        else:
            self._next_stage(out)
        return migration_id

    def _next_stage(self, out: _Outgoing) -> None:
        """Either another copy stage while decoding goes on, or the last stage's reservation:
        the tail it will have, plus slack, reserved before the pause (`_pause_for_last_stage`).
        The first also offers the destination the migrant's computed blocks' tokens."""
        completed = self.engine.completed_blocks(out.request_id)
        remaining = completed - out.sent_blocks
        out.last = remaining <= self._migration.last_stage_blocks or out.stage >= self._migration.max_stages - 1
        request = self.engine.get_request(out.request_id)
        assert request is not None
        if out.last:
            tail = blocks_for(request.num_tokens, self.engine.block_size) - out.sent_blocks
            remaining = tail + self._migration.last_stage_slack_blocks
        out.stage_blocks = remaining
        prefix = ()
        if out.stage == 0:
            prefix = tuple(request.prompt_token_ids + request.output_token_ids)[: completed * self.engine.block_size]
        self._prealloc(out, remaining, prefix, request.cache_salt)

    def _prealloc(self, out: _Outgoing, num_blocks: int, prefix_tokens: tuple[int, ...] = (),
                  cache_salt: str | None = None, queue_key: tuple[int, float, str] | None = None) -> None:
        out.phase = _Phase.AWAIT_PREALLOC
        out.deadline = self._clock() + self._migration.handshake_timeout
        self._send(
            out.destination,
            PreAlloc(out.migration_id, self.instance_id, out.destination, out.request_id, out.stage, num_blocks,
                     prefix_tokens, cache_salt, queue_key, out.execution_priority),
        )

    def _pause_for_last_stage(self, out: _Outgoing) -> bool:
        """Pause the request now that its tail is reserved; False when the migration ended instead
        (it cannot pause, or its tail outgrew the reservation and more is being reserved)."""
        try:
            out.state = self.engine.pause(out.request_id)
        except MigrationRefused as exc:
            self._abort_outgoing(out, f"source cannot pause: {exc}", notify=True)
            return False
        out.paused_at = self._clock()
        tail = blocks_for(out.state.num_tokens, self.engine.block_size) - out.sent_blocks
        reserved, out.stage_blocks = out.stage_blocks, tail
        if tail > reserved:
            self._prealloc(out, tail - reserved)
            return False
        return True

    def _on_prealloc_reply(self, out: _Outgoing, reply: PreAllocReply) -> None:
        if not reply.accepted:
            # A refusing destination has already released everything it held for this migration.
            self._abort_outgoing(out, f"destination refused: {reply.reason}", notify=False)
            return
        if reply.reused_blocks:  # already there: this stage starts after them
            out.reused_blocks += reply.reused_blocks
            out.sent_blocks += reply.reused_blocks
            out.stage_blocks -= reply.reused_blocks
        if out.state is None:
            reason = self._source_lost_reason(out)
            if reason:
                self._abort_outgoing(out, reason, notify=True)
                return
            if out.waiting:
                self._hand_over_waiting(out)
                return
            if out.last and not self._pause_for_last_stage(out):
                return
        start, end = out.sent_blocks, out.sent_blocks + out.stage_blocks
        pending = self.engine.export_later(out.request_id, start, end)
        out.bytes += pending.nbytes
        payload = pending if self._deferred_copies else pending.copy()
        out.phase = _Phase.AWAIT_COMMIT if out.state is not None else _Phase.AWAIT_STAGE_ACK
        out.deadline = self._clock() + self._migration.handshake_timeout
        self._send(out.destination, StageData(out.migration_id, out.stage, start, end, payload, out.state))
        if out.state is not None:
            out.handed_at = self._clock()

    def _hand_over_waiting(self, out: _Outgoing) -> None:
        """Room is reserved there: take the request out of the queue and send its state alone."""
        try:
            out.state = self.engine.pause(out.request_id, waiting=True)
        except MigrationRefused as exc:
            self._abort_outgoing(out, f"source cannot hand it over: {exc}", notify=True)
            return
        out.phase = _Phase.AWAIT_COMMIT
        out.deadline = self._clock() + self._migration.handshake_timeout
        self._send(out.destination, StageData(out.migration_id, out.stage, 0, 0, None, out.state))

    def _on_stage_ack(self, out: _Outgoing, ack: StageAck) -> None:
        out.sent_blocks += out.stage_blocks
        out.stage += 1
        reason = self._source_lost_reason(out)
        if reason:
            self._abort_outgoing(out, reason, notify=True)
            return
        self._next_stage(out)

    def _on_committed(self, out: _Outgoing, msg: Committed) -> None:
        self.engine.free_migrated(out.request_id)
        self._forget_outgoing(out)
        now = self._clock()
        if out.paused_at is None:  # a waiting request: it was not running, no downtime
            self._emit(MigrationEventKind.COMMITTED, out)
            return
        assert out.handed_at is not None, "Committed answers the last stage, which set handed_at"
        self._emit(MigrationEventKind.COMMITTED, out, downtime=now - out.paused_at,
                   downtime_source=out.handed_at - out.paused_at, downtime_destination=msg.taken_over)

    def _source_lost_reason(self, out: _Outgoing) -> str:
        """Why a migration can no longer go on from the source ("" when it can)."""
        request = self.engine.get_request(out.request_id)
        if request is None or request.status.is_done:
            return "request finished"
        if out.waiting:  # whether it still waits is checked as it is taken from the queue
            return ""
        if request.status is not RequestStatus.RUNNING or request.timing.preemptions != out.preemptions_at_start:
            return "request preempted"
        return ""

    def _abort_outgoing(self, out: _Outgoing, reason: str, *, notify: bool) -> None:
        if notify:
            self._send(out.destination, Abort(out.migration_id, reason))
        if out.state is not None:
            self.engine.unpause(out.request_id)
        self._forget_outgoing(out)
        self._emit(MigrationEventKind.ABORTED, out, reason=reason)

    def _forget_outgoing(self, out: _Outgoing) -> None:
        del self._outgoing[out.migration_id]
        del self._outgoing_by_request[out.request_id]

    def pinned(self, request_id: str) -> bool:
        """Running here and pinned: its sampling options cannot move exactly."""
        return any(r.request_id == request_id and r.pinned for r in self.engine.snapshot().running)

    def _is_migratable(self, request_id: str) -> bool:
        """Running, and able to move now (not pinned by its sampling, not paused)."""
        return any(r.request_id == request_id and r.migratable for r in self.engine.snapshot().running)

    # ------------------------------------------------------------------ destination side
    def _on_prealloc(self, sender: str, msg: PreAlloc) -> None:
        inc = self._incoming.get(msg.migration_id)
        first = inc is None
        if first:
            refusal = self._refuse_new_migrant() or self._refuse_to_queue(msg.queue_key)
            if refusal:
                self._send(sender, PreAllocReply(msg.migration_id, msg.stage, False, refusal))
                return
            inc = _Incoming(msg.migration_id, msg.request_id, sender, deadline=0.0)
            self._incoming[msg.migration_id] = inc
        reused = self.engine.reserve_cached(msg.migration_id, msg.prefix_tokens, msg.cache_salt) if msg.prefix_tokens else 0
        needed = msg.num_blocks - reused
        # Checked before blocks are taken: taking them may evict cached prefixes, and a refusal
        # would hand them back uncached.
        refusal = self._refuse_queue_room(needed, msg.execution_priority) if first else ""
        if not refusal and not self.engine.reserve_blocks(msg.migration_id, needed):
            refusal = "out of blocks"
        if refusal:
            self._drop_incoming(inc)
            self._send(sender, PreAllocReply(msg.migration_id, msg.stage, False, refusal))
            return
        inc.reserved_blocks += msg.num_blocks
        inc.deadline = self._clock() + self._migration.handshake_timeout
        self._send(sender, PreAllocReply(msg.migration_id, msg.stage, True, reused_blocks=reused))

    def _refuse_new_migrant(self) -> str:
        if self._terminating:
            return "destination is terminating"
        if len(self._incoming) >= self._migration.max_concurrent:
            return "destination at max concurrent migrations"
        return ""

    def _refuse_queue_room(self, blocks: int, priority: Priority) -> str:
        """Why a migrant whose first stage takes `blocks` here would take room this instance's own
        queue needs ("" when it would not, or when the blocks are not there at all: that refusal is
        the reservation's, "out of blocks").

        A normal-priority migrant is let in by the scheduler's placement rule for a new
        normal-priority request (`dispatch.hold-freeness`): the free blocks left after its first
        stage, less every waiting request's demand, must keep that many per request, the migrant
        counted. A high-priority one is not checked, as dispatch never holds one. Pairing reads
        reports a step old and ranks destinations by the head of their line (its own check of
        their queues is an approximation from those reports); without this,
        migrants move into the room that queued requests (just dispatched, or preempted) were
        about to start in, and those wait behind them: the first-token tail near capacity."""
        hold = self._hold_freeness
        if hold is None or priority != Priority.NORMAL:
            return ""
        totals = self.engine.load_totals()
        left = totals.free_blocks - blocks
        requests = totals.num_running + totals.num_waiting + 1
        if 0 <= left and left - totals.waiting_demand < hold * requests:
            return "destination needs its room for its queue"
        return ""

    def _refuse_to_queue(self, queue_key: tuple[int, float, str] | None) -> str:
        """Why a waiting migrant would gain nothing here ("" when it would): it would queue behind
        a request of this queue."""
        if queue_key is None:
            return ""
        waiting = self.engine.snapshot().waiting
        if not waiting:
            return ""
        head = self.engine.get_request(waiting[0].request_id)
        if head is not None and head.queue_key() < queue_key:
            return "destination queues earlier requests"
        return ""

    def _on_stage_data(self, sender: str, msg: StageData) -> None:
        received = self._clock()
        inc = self._incoming.get(msg.migration_id)
        if inc is None:
            self._send(sender, Abort(msg.migration_id, "unknown migration at destination"))
            return
        try:
            if msg.payload is not None:
                self.engine.import_blocks(msg.migration_id, msg.start_block, msg.payload)
            if msg.state is not None:
                self.engine.resume(msg.migration_id, msg.state)
        except MigrationRefused as exc:
            self._drop_incoming(inc)
            self._send(sender, Abort(msg.migration_id, f"destination failed: {exc}"))
            return
        if msg.state is None:
            inc.deadline = self._clock() + self._migration.handshake_timeout
            self._send(sender, StageAck(msg.migration_id, msg.stage))
            return
        del self._incoming[msg.migration_id]
        self._remember_committed(msg.migration_id, msg.state.request_id)
        self._send(sender, Committed(msg.migration_id, msg.state.request_id, self._clock() - received))

    def _on_abort_at_destination(self, msg: Abort) -> None:
        inc = self._incoming.get(msg.migration_id)
        if inc is not None:
            self._drop_incoming(inc)
            return
        request_id = self._committed_in.pop(msg.migration_id, None)
        if request_id is not None:
            # The source gave up before it saw our Committed and goes on with the request itself;
            # a migration of our copy onward (it may already have started) ends with it.
            self.abort_request(request_id)

    def _drop_incoming(self, inc: _Incoming) -> None:
        self.engine.release_reservation(inc.migration_id)
        self._incoming.pop(inc.migration_id, None)

    def _remember_committed(self, migration_id: str, request_id: str) -> None:
        self._committed_in[migration_id] = request_id
        while len(self._committed_in) > _COMMITTED_MEMORY:
            self._committed_in.popitem(last=False)

    # ------------------------------------------------------------------ driving
    def on_message(self, sender: str, message: MigrationMessage) -> None:
        """Route one migration message to its role's handler; stale messages are dropped."""
        if isinstance(message, PreAlloc):
            self._on_prealloc(sender, message)
        elif isinstance(message, StageData):
            self._on_stage_data(sender, message)
        elif isinstance(message, (PreAllocReply, StageAck, Committed)):
            out = self._outgoing.get(message.migration_id)
            if out is None or out.destination != sender:
                return
            if isinstance(message, PreAllocReply) and out.phase is _Phase.AWAIT_PREALLOC:
                self._on_prealloc_reply(out, message)
            elif isinstance(message, StageAck) and out.phase is _Phase.AWAIT_STAGE_ACK:
                self._on_stage_ack(out, message)
            elif isinstance(message, Committed) and out.phase is _Phase.AWAIT_COMMIT:
                self._on_committed(out, message)
        elif isinstance(message, Abort):
            out = self._outgoing.get(message.migration_id)
            if out is not None and out.destination == sender:
                self._abort_outgoing(out, f"destination aborted: {message.reason}", notify=False)
            else:
                self._on_abort_at_destination(message)
        else:
            raise TypeError(f"not a migration message: {type(message).__name__}")

    def tick(self) -> None:
        """Expire handshakes: the source aborts (request continues here), the destination releases."""
        now = self._clock()
        for out in [o for o in self._outgoing.values() if now > o.deadline]:
            self._abort_outgoing(out, f"timeout waiting in {out.phase.value}", notify=True)
        for inc in [i for i in self._incoming.values() if now > i.deadline]:
            self._drop_incoming(inc)

    def peer_lost(self, instance_id: str) -> None:
        """A peer died: nothing more will come from it; abort and release without messaging it."""
        for out in [o for o in self._outgoing.values() if o.destination == instance_id]:
            self._abort_outgoing(out, f"destination {instance_id} lost", notify=False)
        for inc in [i for i in self._incoming.values() if i.source == instance_id]:
            self._drop_incoming(inc)

    # ------------------------------------------------------------------ helpers
    def _send(self, receiver: str, message: MigrationMessage) -> None:
        self._transport.send(self.instance_id, receiver, message)

    def _emit(self, kind: MigrationEventKind, out: _Outgoing, *, downtime: float = 0.0, downtime_source: float = 0.0,
              downtime_destination: float = 0.0, reason: str = "") -> None:
        self._on_event(
            MigrationEvent(
                kind=kind,
                migration_id=out.migration_id,
                request_id=out.request_id,
                source=self.instance_id,
                destination=out.destination,
                time=self._clock(),
                stages=out.stage + (1 if kind is MigrationEventKind.COMMITTED else 0),
                blocks=out.sent_blocks + (out.stage_blocks if kind is MigrationEventKind.COMMITTED else 0),
                bytes=out.bytes,
                downtime=downtime,
                downtime_source=downtime_source,
                downtime_destination=downtime_destination,
                reason=reason,
                reused_blocks=out.reused_blocks,
                waiting=out.waiting,
            )
        )
