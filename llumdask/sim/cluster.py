"""Discrete-event cluster: the production core (global scheduler, llumlets, sim engines) on a virtual clock.

Nothing here decides anything: dispatch, pairing and scaling come from `GlobalScheduler`, which
migrant and how it moves from `Llumlet`, batching and preemption from `SimEngine`. The simulator
only supplies time: engine steps last their modelled duration, messages take latency plus bytes
over bandwidth, load reports arrive `report_delay` late, new instances take `startup_delay`.

Migration messages are handled when they arrive, also while the instance is in the middle of a
step: KV copies and handshakes run beside the model's compute, as in Llumnix. A request paused or
resumed mid-step leaves or joins the batch from the next step on.

Load reports leave an instance between steps, at most every `report_interval`, as a llumlet's
engine thread writes them: a busy instance reports when a step ends, an idle one on the interval.
An engine step is computed when it starts, so a report taken during it would show its outcome
early; none is.
"""

from __future__ import annotations

import heapq
import math
import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from llumdask.config import LlumdaskConfig
from llumdask.engine.latency import LatencyProfile
from llumdask.engine.base import RequestLoad
from llumdask.engine.sim import SimEngine
from llumdask.global_scheduler import ClusterOverloaded, DispatchInfo, GlobalScheduler, NoInstanceAvailable
from llumdask.llumlet import Llumlet, MigrationEvent
from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixEvents, dispatch_keys
from llumdask.protocol import MigrationMessage, StageData
from llumdask.request import Request, SamplingParams, blocks_for
from llumdask.sim.metrics import ClusterSample
from llumdask.sim.oracle import ClairvoyantDispatch, Holdings
from llumdask.sim.workload import TraceRequest, prompt_tokens

# An idle engine that still holds work it cannot schedule (waiting behind a reservation) polls.
_IDLE_POLL = 0.005


@dataclass(frozen=True)
class SimulatorSettings:
    """The simulated cluster's fabric; every field is a knob a user tunes before touching GPUs."""

    report_delay: float = 0.0
    dispatch_delay: float = 0.0
    bandwidth: float = 8e9  # bytes/s between instances: 64 Gb/s as in the paper's testbed
    stage_overhead: float = 0.001  # per StageData: launch, gather into the fused buffer, handshake
    message_latency: float = 0.0002  # control messages (PRE-ALLOC, ACK, COMMIT)
    sample_interval: float = 1.0  # metric samples of cluster memory and instance count
    scale_interval: float = 1.0

    def __post_init__(self) -> None:
        # Stated as what passes: NaN fails every comparison, and an infinite delay never fires.
        for name in ("report_delay", "dispatch_delay", "stage_overhead", "message_latency"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("bandwidth", "sample_interval", "scale_interval"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass
class SimInstance:
    instance_id: str
    llumlet: Llumlet
    busy_until: float = 0.0
    step_scheduled: bool = False
    alive: bool = True
    reported_at: float = -math.inf


@dataclass
class SimOutcome:
    """What a run produced, for metrics: every request, cluster samples, migration events."""

    requests: list[Request]
    samples: list[ClusterSample]
    migrations: list[MigrationEvent]
    duration: float
    rejected: list[str] = field(default_factory=list)
    # Preemptions at whose step another instance (ready, not draining) had the free blocks for the
    # victim's whole sequence beyond its own queue's demand and the prompts on their way to it:
    # memory the cluster had, but not where the request grew (what placement and migration could
    # have spared).
    preemptions_with_room: int = 0


class _EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time, self.now), next(self._seq), action))

    def run_next(self) -> bool:
        if not self._heap:
            return False
        self.now, _, action = heapq.heappop(self._heap)
        action()
        return True


class SimTransport:
    """Delays each message by latency (+ modelled bytes over bandwidth for KV stages), FIFO per pair."""

    def __init__(self, cluster: "SimCluster", bytes_per_block: int) -> None:
        self._cluster = cluster
        self._bytes_per_block = bytes_per_block
        self._pair_clock: dict[tuple[str, str], float] = {}
        self.bytes_moved = 0
        self._bytes_by_migration: dict[str, int] = {}

    def bytes_of(self, migration_id: str) -> int:
        """Modelled KV bytes sent so far for one migration (the engine's own arrays may be empty)."""
        return self._bytes_by_migration.get(migration_id, 0)

    def send(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        settings = self._cluster.settings
        delay = settings.message_latency
        if isinstance(message, StageData):
            nbytes = (message.end_block - message.start_block) * self._bytes_per_block
            self.bytes_moved += nbytes
            self._bytes_by_migration[message.migration_id] = self.bytes_of(message.migration_id) + nbytes
            delay += settings.stage_overhead + nbytes / settings.bandwidth
        pair = (sender, receiver)
        arrival = max(self._cluster.events.now + delay, self._pair_clock.get(pair, 0.0))
        self._pair_clock[pair] = arrival
        self._cluster.events.at(arrival, lambda: self._cluster.deliver(sender, receiver, message))


class SimCluster:
    def __init__(
        self,
        config: LlumdaskConfig,
        profile: LatencyProfile,
        num_instances: int,
        settings: SimulatorSettings | None = None,
        on_finish: Callable[[Request], None] | None = None,
        clairvoyant: bool = False,
    ) -> None:
        """`clairvoyant`: dispatch by the oracle (`llumdask.sim.oracle`), which reads every
        instance's requests from here, instead of the configured policy."""
        if num_instances < 1:
            raise ValueError("num_instances must be >= 1")
        self.config = config
        self.profile = profile
        self.settings = settings or SimulatorSettings()
        self.events = _EventQueue()
        self.scheduler = GlobalScheduler(config, ClairvoyantDispatch(self._holdings, profile) if clairvoyant else None)
        self.transport = SimTransport(self, profile.model_kv_bytes_per_token * config.block_size)
        self.instances: dict[str, SimInstance] = {}
        self.requests: dict[str, Request] = {}
        self.migrations: list[MigrationEvent] = []
        self.samples: list[ClusterSample] = []
        self.rejected: list[str] = []
        self.preemptions_with_room = 0
        self._loads: dict[str, InstanceLoad] = {}
        self._unfinished = 0
        self._in_transit: dict[str, list[Request]] = {}  # dispatched, not yet handed over (dispatch_delay)
        self._held: dict[str, Request] = {}  # waiting at the scheduler for an instance with room
        self._names = itertools.count()
        self._on_finish = on_finish
        # The workload being run, each conversation turn's follower, each request's index in it.
        self._workload: list[TraceRequest] = []
        self._followers: dict[int, int] = {}
        self._index: dict[str, int] = {}
        # Prompts are hashed for dispatch only where the instances cache prefixes.
        self._hash_prompts = config.sim_engine.prefix_caching
        for _ in range(num_instances):
            self._start_instance(ready_at=0.0)

    # ------------------------------------------------------------------ instances
    def _start_instance(self, ready_at: float) -> str:
        instance_id = f"instance-{next(self._names)}"
        engine_config = replace(self.config.sim_engine, real_time=False)
        engine = SimEngine(engine_config, block_size=self.config.block_size, clock=self._clock, instance_id=instance_id)
        llumlet = Llumlet(
            instance_id,
            engine,
            self.transport,
            self.config,
            self._clock,
            on_event=self._record_migration,
        )
        self.instances[instance_id] = SimInstance(instance_id, llumlet)
        self.scheduler.register_instance(
            instance_id, engine.total_blocks, engine.block_size, self.events.now, engine.high_priority_headroom
        )
        self.events.at(ready_at, lambda: self._ready(instance_id))
        return instance_id

    def _ready(self, instance_id: str) -> None:
        self.scheduler.mark_ready(instance_id, self.events.now)
        self._report(self.instances[instance_id])

    def _clock(self) -> float:
        return self.events.now

    def _record_migration(self, event: MigrationEvent) -> None:
        """Events carry the modelled bytes: large simulations hold no real KV bytes to count."""
        self.migrations.append(replace(event, bytes=self.transport.bytes_of(event.migration_id)))

    def _wake(self, inst: SimInstance) -> None:
        if inst.alive and not inst.step_scheduled:
            inst.step_scheduled = True
            self.events.at(inst.busy_until, lambda: self._step(inst))

    def _step(self, inst: SimInstance) -> None:
        inst.step_scheduled = False
        if inst.alive and inst.llumlet.engine.has_work():
            if self.events.now - inst.reported_at >= self.config.report_interval:
                self._report(inst)  # between the last step and this one
            result = inst.llumlet.step()
            if result.preempted:
                self._count_room_elsewhere(inst, result.preempted)
            for request in result.finished:
                self._finished(request)
            inst.busy_until = self.events.now + (result.duration or _IDLE_POLL)
            self._wake(inst)

    def _count_room_elsewhere(self, inst: SimInstance, preempted: tuple[str, ...]) -> None:
        """Count the preempted requests another instance could have taken whole: one a request may
        be placed on (ready, not draining), with the blocks free beyond its own queue's demand and
        the prompts on their way to it (each victim counted takes its blocks off that room). A
        preempted request waits in its engine's queue, so the engine still knows its length."""
        block_size = self.config.block_size
        rooms = []
        for instance_id in self.scheduler.members()[1]:
            if instance_id != inst.instance_id:
                totals = self.instances[instance_id].llumlet.engine.load_totals()
                coming = sum(blocks_for(r.num_prompt_tokens, block_size) for r in self._in_transit.get(instance_id, ()))
                rooms.append(totals.free_blocks - totals.waiting_demand - coming)
        for request_id in preempted:
            request = inst.llumlet.engine.get_request(request_id)
            assert request is not None
            need = blocks_for(request.num_tokens, block_size)
            best = max(range(len(rooms)), key=rooms.__getitem__, default=None)
            if best is not None and need <= rooms[best]:
                self.preemptions_with_room += 1
                rooms[best] -= need

    def deliver(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        inst = self.instances.get(receiver)
        if inst is not None and inst.alive and sender in self.instances:
            inst.llumlet.on_message(sender, message)
            self._wake(inst)

    def _finished(self, request: Request) -> None:
        """Keep the finishing engine's Request: after a migration it is a new object with the full timing."""
        known = self.requests[request.request_id]
        if known is not request and known.status.is_done:
            return  # a second copy: its migration was rolled back after the destination had resumed it
        self.requests[request.request_id] = request
        self._unfinished -= 1
        self._next_turn(request)
        if self._on_finish is not None:
            self._on_finish(request)

    # ------------------------------------------------------------------ periodic loops
    def _report(self, inst: SimInstance) -> None:
        inst.reported_at = self.events.now
        load = inst.llumlet.load_report()
        prefix = inst.llumlet.prefix_events()
        self._loads[inst.instance_id] = load
        if self.settings.report_delay:
            self.events.at(self.events.now + self.settings.report_delay, lambda: self._receive_report(load, prefix))
        else:  # fresh reports: no event needed (hundreds of thousands in a long run)
            self._receive_report(load, prefix)

    def _receive_report(self, load: InstanceLoad, prefix: PrefixEvents | None) -> None:
        inst = self.instances.get(load.instance_id)
        if inst is not None and inst.alive:
            self.scheduler.report(load, self.events.now, prefix)
            for info, target in self.scheduler.release(self.events.now):
                self._send(self._held.pop(info.request_id), target)

    def _report_loop(self) -> None:
        """Instances between steps (idle ones, or waiting on a reservation) report on the interval;
        one in the middle of a step reports when the step ends."""
        now, interval = self.events.now, self.config.report_interval
        for inst in self.instances.values():
            if inst.alive and inst.busy_until <= now and now - inst.reported_at >= interval - 1e-12:
                self._report(inst)
        self._repeat(interval, self._report_loop)

    def _pairing_loop(self) -> None:
        for inst in self.instances.values():
            if inst.alive:
                inst.llumlet.tick()
        for pair in self.scheduler.pair_migrations(self.events.now):
            source = self.instances[pair.source]
            if source.alive and source.llumlet.migrate_out(pair.destination, take_waiting=pair.take_waiting):
                self._wake(source)
        self._repeat(self.config.migration.interval, self._pairing_loop)

    def _scaling_loop(self) -> None:
        decision = self.scheduler.scale(self.events.now)
        for _ in range(decision.add):
            self._start_instance(ready_at=self.events.now + self.config.scaling.startup_delay)
        for instance_id in (*decision.terminate, *decision.resume):
            self.instances[instance_id].llumlet.set_terminating(*self.scheduler.drain_order(instance_id))
        for instance_id in decision.resume:  # its held requests placed on it at once
            self._report(self.instances[instance_id])
        for instance_id in decision.remove:
            self.instances[instance_id].alive = False
            self.scheduler.remove_instance(instance_id)
            self._loads.pop(instance_id, None)
        self._repeat(self.settings.scale_interval, self._scaling_loop)

    def _sample_loop(self) -> None:
        held = self.scheduler.held
        held_demand = blocks_for(held.first.info.num_prompt_tokens, self.config.block_size) if held else 0
        self.samples.append(ClusterSample.from_loads(self.events.now, list(self._loads.values()), held_demand))
        idle = all(not i.llumlet.engine.has_work() and not i.llumlet.migrations_in_flight() for i in self.instances.values() if i.alive)
        waiting_for_nothing = self._pending_arrivals == 0 and not any(self._in_transit.values()) and not self._held
        if idle and self._unfinished > 0 and waiting_for_nothing and self.scheduler_has_ready():
            raise RuntimeError(f"simulation stalled at t={self.events.now:.1f}s: {self._unfinished} requests never finished")
        self._repeat(self.settings.sample_interval, self._sample_loop)

    def _repeat(self, interval: float, loop: Callable[[], None]) -> None:
        if self._unfinished > 0 or self._pending_arrivals > 0:
            self.events.at(self.events.now + interval, loop)

    def _holdings(self, instance_id: str) -> Holdings:
        """(tokens now, tokens still to generate) of each request on the instance or on its way:
        what only a simulator knows, for the clairvoyant oracle."""
        snapshot = self.instances[instance_id].llumlet.engine.snapshot()

        def held(loads: Sequence[RequestLoad]) -> list[tuple[int, int]]:
            return [(r.num_tokens, self.requests[r.request_id].sampling.max_tokens - (r.num_tokens - r.num_prompt_tokens))
                    for r in loads]

        coming = [(r.num_prompt_tokens, r.sampling.max_tokens) for r in self._in_transit.get(instance_id, ())]
        return Holdings(held(snapshot.running), held(snapshot.waiting) + coming)

    def scheduler_has_ready(self) -> bool:
        return any(view.ready for view in self.scheduler.instances())

    # ------------------------------------------------------------------ workload
    def _arrive(self, trace: TraceRequest, index: int, history: Sequence[int] = ()) -> None:
        request_id = f"req-{index}"
        self._pending_arrivals -= 1
        prompt = prompt_tokens(trace, index, history)
        request = Request(
            request_id,
            prompt,
            SamplingParams(max_tokens=trace.output_len, ignore_eos=True),
            scheduling_priority=trace.priority,
            execution_priority=trace.priority,
            arrival_time=self.events.now,
        )
        # As the requester does: the prompt's block hashes travel with the dispatch, not its tokens.
        hashes = dispatch_keys(prompt, self.config.block_size, request.cache_salt) if self._hash_prompts else ()
        info = DispatchInfo(request_id, trace.input_len, trace.output_len, trace.priority, block_hashes=hashes)
        try:
            target = self.scheduler.dispatch(info, self.events.now)
        except ClusterOverloaded:
            self.rejected.append(request_id)  # refused for load: the client was told to come back
            self._end_conversation(index)
            return
        except NoInstanceAvailable:
            # No ready instance (all starting or draining): retry shortly, as a frontend would.
            self._pending_arrivals += 1
            self.events.at(self.events.now + _IDLE_POLL * 10, lambda: self._arrive(trace, index, history))
            return
        self.requests[request_id] = request
        self._index[request_id] = index
        self._unfinished += 1
        if target is None:
            self._held[request_id] = request  # the scheduler places it when an instance has room
        else:
            self._send(request, target)

    def _send(self, request: Request, target: str) -> None:
        request.timing.dispatched = self.events.now
        self._in_transit.setdefault(target, []).append(request)
        self.events.at(self.events.now + self.settings.dispatch_delay, lambda: self._admit(target, request))

    def _admit(self, target: str, request: Request) -> None:
        self._in_transit[target].remove(request)
        inst = self.instances[target]
        try:
            inst.llumlet.add_request(request)
        except ValueError:
            self.rejected.append(request.request_id)
            self._unfinished -= 1
            self._end_conversation(self._index[request.request_id])
            return
        self._wake(inst)

    def _next_turn(self, request: Request) -> None:
        """A conversation goes on: its next turn resends this one's prompt and answer after a think time."""
        follower = self._followers.get(self._index[request.request_id])
        if follower is not None:
            trace = self._workload[follower]
            history = request.prompt_token_ids + request.output_token_ids
            ended = request.timing.finished if request.timing.finished is not None else self.events.now
            self.events.at(ended + trace.think, lambda: self._arrive(trace, follower, history))

    def _end_conversation(self, index: int) -> None:
        """A turn that never ran: the turns after it are never sent."""
        while (index := self._followers.get(index)) is not None:
            self._pending_arrivals -= 1

    def run(self, workload: list[TraceRequest]) -> SimOutcome:
        """Replay the workload to completion; the global scheduler sees reports at the configured interval."""
        self._pending_arrivals = len(workload)
        self._workload = workload
        self._followers = {trace.after: index for index, trace in enumerate(workload) if trace.after is not None}
        for index, trace in enumerate(workload):
            if trace.after is None:
                self.events.at(trace.arrival, lambda t=trace, i=index: self._arrive(t, i))
        self.events.at(0.0, self._report_loop)
        self.events.at(0.0, self._sample_loop)
        if self.config.migration.enabled:
            self.events.at(self.config.migration.interval, self._pairing_loop)
        if self.config.scaling.enabled:
            self.events.at(self.settings.scale_interval, self._scaling_loop)
        while self.events.run_next():
            pass
        for inst in self.instances.values():
            if inst.alive:
                inst.llumlet.check_integrity()
        # The run ends with its last completion; periodic loops may tick once more after it.
        done = [r.timing.finished for r in self.requests.values() if r.timing.finished is not None]
        return SimOutcome(
            requests=[r for r in self.requests.values()],
            samples=[s for s in self.samples if not done or s.time <= max(done)],
            migrations=self.migrations,
            duration=max(done, default=self.events.now),
            rejected=self.rejected,
            preemptions_with_room=self.preemptions_with_room,
        )
