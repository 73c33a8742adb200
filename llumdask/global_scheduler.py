"""The global scheduler: an instance table turned into dispatch, migration and scaling decisions.

It keeps instance-level state only: each instance's last load report (constant size) plus a
FIFO of the requests dispatched there that no report shows yet. Each decision is one pass over
the instances; the clock is passed in; decisions are returned as plain data and acted on by
the host (the Dask scheduler plugin, or the simulator), never performed here.

Dispatch-time accounting: a dispatched request counts as demand (blocks for its prompt) in its
instance's loads until a report's `num_received` shows the instance has it (or, never received,
for PENDING_EXPIRY); migrations do not count as received. Each instance's two freeness values (`llumdask.load`: the dispatch load that
places requests, the migration load that pairs instances), pending demand included, are cached
and recomputed only when its report, its pending requests or its state change.

Every call takes `now` so that a host passes one clock everywhere; the table records the time
of each instance's last report, and scaling's hysteresis runs on it.

Reports from an instance that was never registered (or was removed) are rejected with
`UnknownInstance`: registration carries capacity and readiness, and a late report from a
removed instance must not bring it back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from llumdask.admission import DepartureRate, RetryQueue, departures
from llumdask.config import LlumdaskConfig
from llumdask.holding import Held, HeldRequests
from llumdask.load import (
    InstanceLoad,
    PooledLoad,
    dispatch_usage,
    headroom_blocks,
    instance_order,
    migration_freeness,
    per_request,
    virtual_usage,
)
from llumdask.policy.candidates import CandidateTable, Reservation
from llumdask.prefix import PrefixEvents, PrefixIndex, anchor_stride
from llumdask.policy.dispatch import DispatchInfo, DispatchPolicy, make_dispatch_policy
from llumdask.policy.migration import MigrationPair, pair_migrations
from llumdask.policy.scaling import ScaleAction, ScaleDecision, ScalingPolicy
from llumdask.request import Priority, blocks_for
from llumdask.room import RoomTrend

__all__ = [
    "DispatchInfo",
    "GlobalScheduler",
    "InstanceView",
    "MigrationPair",
    "NoInstanceAvailable",
    "ScaleDecision",
    "UnknownInstance",
]


# A request dispatched this long ago that an instance's reports never showed received never
# reached it (its requester died on the way, or the instance refused it as malformed or too long
# ever to fit): it stops counting as demand there. Hand-overs take at most the requester's
# rpc-timeout (10 s).
PENDING_EXPIRY = 30.0


class NoInstanceAvailable(RuntimeError):
    """No ready, non-terminating instance to dispatch to."""


class ClusterOverloaded(RuntimeError):
    """Admission by load (`dispatch.admission-freeness`): every instance would queue the request.
    `retry_after`: seconds to wait before sending it again (`llumdask.admission`), None if unknown."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UnknownInstance(KeyError):
    """An instance id the scheduler does not know (never registered, or removed)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class InstanceView:
    """One row of the instance table, for dashboards and notebooks."""

    instance_id: str
    ready: bool
    terminating: bool
    # The migration load's freeness (what pairing compares) and the dispatch load's.
    freeness: float
    dispatch_freeness: float
    load: InstanceLoad
    num_pending: int
    pending_blocks: int
    last_report_at: float | None
    # Virtual usage in blocks (Algorithm 1, pending demand included; inf while terminating).
    virtual_blocks: float
    # Blocks its prefix cache holds, as its reports tell the scheduler's index.
    cached_blocks: int = 0


class _Instance:
    """The scheduler's record of one instance; dispatch policies read it as their `Candidate`."""

    __slots__ = (
        "instance_id", "order", "total_blocks", "block_size", "headroom", "ready", "joined_at", "terminating",
        "drain_order", "heard", "removal_decided", "scaled_in", "load", "last_report_at", "room_trend", "handed",
        "pending", "num_pending", "pending_blocks", "pending_prompt_tokens", "pending_classes", "freeness", "key",
        "dispatch_freeness", "dispatch_surplus", "job",
    )

    def __init__(self, instance_id: str, total_blocks: int, block_size: int, headroom: dict[Priority, int]) -> None:
        self.instance_id = instance_id
        self.order = instance_order(instance_id)
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.headroom = headroom
        self.ready = False
        self.joined_at: float | None = None
        self.terminating = False
        # Drain orders (drain, take back) given so far, and whether the last report was made
        # knowing the latest: one made before it reached the instance (in flight, or made just
        # before) carries a stale `terminating`, and may show it empty while a migration comes in.
        self.drain_order = 0
        self.heard = False
        self.removal_decided = False
        # Draining because scaling chose it: scaling may take it back (an operator's drain never).
        self.scaled_in = False
        # The batch job holding it with others (a SLURM job of several instances), which closes
        # only once all of them are drained; None: it closes on its own.
        self.job: str | None = None
        # Until its first report an instance is known to be empty.
        self.load = InstanceLoad(instance_id, total_blocks, block_size, free_blocks=total_blocks, num_running=0, num_waiting=0)
        self.last_report_at: float | None = None
        self.room_trend = RoomTrend()
        # `handed`: requests the instance has received or is about to, as far as we know. Each
        # pending entry is (its position in that count, prompt blocks, prompt tokens, execution
        # priority, when it was dispatched, its request id).
        self.handed = 0
        self.pending: deque[tuple[int, int, int, Priority, float, str]] = deque()
        self.num_pending = 0
        self.pending_blocks = 0
        self.pending_prompt_tokens = 0
        # Pending requests per execution priority: a class on its way is present for dispatch.
        self.pending_classes: dict[Priority, int] = {}
        self.freeness = 0.0
        self.key: tuple = (0.0, self.order)
        self.dispatch_freeness = self.dispatch_surplus = 0.0
        self.refresh()

    def refresh(self) -> None:
        """Recompute the cached loads after anything they depend on changed."""
        load = self.load
        if self.terminating:
            self.freeness = self.dispatch_freeness = self.dispatch_surplus = -math.inf
        else:
            self.freeness = migration_freeness(load, self.headroom, extra_demand=self.pending_blocks)
            usage = dispatch_usage(load, self.headroom, pending_blocks=self.pending_blocks, classes=self.pending_classes)
            self.dispatch_surplus = load.total_blocks - usage
            self.dispatch_freeness = per_request(self.dispatch_surplus, self.dispatch_requests)
        self.key = (self.freeness, self.order)

    @property
    def dispatch_requests(self) -> int:
        return self.load.num_running + self.load.num_waiting + self.num_pending

    def absent_charge(self, priority: Priority) -> int:
        if self.load.running_count.get(priority, 0) or priority in self.pending_classes:
            return 0
        return self.headroom.get(priority, 0)

    def add_pending(self, info: DispatchInfo, now: float) -> None:
        blocks = blocks_for(info.num_prompt_tokens, self.block_size)
        priority = info.execution_priority
        self.pending.append((self.handed, blocks, info.num_prompt_tokens, priority, now, info.request_id))
        self.handed += 1
        self.num_pending += 1
        self.pending_blocks += blocks
        self.pending_prompt_tokens += info.num_prompt_tokens
        self.pending_classes[priority] = self.pending_classes.get(priority, 0) + 1
        self.refresh()

    def cancel_pending(self, request_id: str, count: int, now: float) -> None:
        """Forget the `count` requests placed here together that will never arrive (their
        requester gave up before handing them over): those placed after them move up in the
        count the instance reports, and those it has received by then leave the queue. Entries of
        theirs the count already took as received (a later request arrived first) are gone from
        the queue, but not from the count."""
        # The placement's first position still queued; none: every entry queued is later.
        first = next((e[0] for e in self.pending if e[5] == request_id), -math.inf)
        kept: deque[tuple[int, int, int, Priority, float, str]] = deque()
        for entry in self.pending:
            position, blocks, tokens, priority, when, entry_id = entry
            if entry_id == request_id:
                self._drop_pending(blocks, tokens, priority)
            elif position > first:
                kept.append((position - count, blocks, tokens, priority, when, entry_id))
            else:
                kept.append(entry)
        self.pending = kept
        self.handed -= count
        self._drop_settled(self.load.num_received, now)
        self.refresh()

    def _drop_settled(self, received: int, now: float) -> None:
        """Drop the pending requests among the first `received` the instance has had, and those
        dispatched more than PENDING_EXPIRY ago that it never received."""
        pending = self.pending
        while pending and (pending[0][0] < received or pending[0][4] < now - PENDING_EXPIRY):
            position, blocks, tokens, priority, _, _ = pending.popleft()
            if position < received:
                self.room_trend.received(blocks, now)
            self._drop_pending(blocks, tokens, priority)

    def _drop_pending(self, blocks: int, tokens: int, priority: Priority) -> None:
        self.num_pending -= 1
        self.pending_blocks -= blocks
        self.pending_prompt_tokens -= tokens
        left = self.pending_classes[priority] - 1
        if left:
            self.pending_classes[priority] = left
        else:
            del self.pending_classes[priority]

    def absorb(self, load: InstanceLoad, now: float) -> None:
        """Take a new report; drop the pending requests it shows the instance has received, and
        those dispatched more than PENDING_EXPIRY ago that it never received."""
        received = load.num_received
        if received < self.load.num_received:
            raise ValueError(
                f"instance {self.instance_id}: num_received went back from {self.load.num_received} to {received}; "
                "a restarted instance must be removed and registered again"
            )
        self._drop_settled(received, now)
        # Requests handed to it by someone else (e.g. before this scheduler started) move the count on.
        self.handed = max(self.handed, received)
        if self.drain_order == 0 < load.drain_order:
            self.drain_order = load.drain_order  # this scheduler restarted: earlier orders stand
        self.heard = load.drain_order == self.drain_order
        if not self.heard:
            if load.terminating != self.terminating:  # stale; the rest of the report is not
                load = replace(load, terminating=self.terminating)
        elif load.terminating:
            self.terminating = True  # drained by an order this scheduler did not give
        self.room_trend.observe(load.free_blocks, now)
        self.load = load
        self.refresh()

    def drain(self, by_scaling: bool) -> bool:
        """Mark it terminating (a new order, unless it already was); `by_scaling`: a scale-in's
        drain, which scaling may take back. Whether that changed its membership."""
        self.scaled_in = by_scaling
        if self.terminating:
            return False
        self.terminating = True
        self._new_order()
        return True

    def resume(self) -> None:
        """Taken back from a scale-in's drain: live again, placeable, counted in the pool, no
        longer a migration source (nor to be removed, where it was found drained meanwhile)."""
        self.terminating = self.scaled_in = self.removal_decided = False
        self.load = replace(self.load, terminating=False)
        self._new_order()

    def _new_order(self) -> None:
        self.drain_order += 1
        self.heard = False
        self.refresh()

    @property
    def pooled(self) -> tuple[InstanceLoad, int, int]:
        """What the pooled load counts of it (`PooledLoad.of`)."""
        return self.load, self.pending_blocks, self.num_pending

    @property
    def drained(self) -> bool:
        """Terminating, seen so by a report made knowing it, and nothing left on it or on its way to it."""
        load = self.load
        return (
            self.terminating
            and self.heard
            and self.num_pending == 0
            and load.num_running == 0
            and load.num_waiting == 0
            and load.num_migrating_out == 0
            and load.num_migrating_in == 0
        )

    def view(self, cached_blocks: int) -> InstanceView:
        return InstanceView(
            self.instance_id, self.ready, self.terminating, self.freeness, self.dispatch_freeness, self.load,
            self.num_pending, self.pending_blocks, self.last_report_at,
            math.inf if self.terminating else virtual_usage(self.load, self.headroom, extra_demand=self.pending_blocks),
            cached_blocks,
        )


class GlobalScheduler:
    """Instance table -> dispatch target, migration pairs, scale decisions. Not thread-safe:
    the host calls it from one thread (the Dask scheduler's event loop)."""

    def __init__(self, config: LlumdaskConfig, dispatch_policy: DispatchPolicy | None = None) -> None:
        """`dispatch_policy` replaces the one `config.dispatch` names (the simulator's oracle)."""
        self._config = config
        self._dispatch_policy = dispatch_policy or make_dispatch_policy(config.dispatch)
        self._scaling_policy = ScalingPolicy(config.scaling)
        self._instances: dict[str, _Instance] = {}
        # Ready, non-terminating instances; rebuilt only when membership changes.
        self._candidates: CandidateTable | None = None
        # Counts membership changes (an instance registered, ready, draining or gone), so that a
        # poller can ask "anything new since epoch n?" and get the lists only when there is.
        self.epoch = 0
        # How fast requests leave, and when each request refused for load should come back.
        self._departures = DepartureRate()
        self._retry = RetryQueue()
        # Instances a scale-out asked for that have not registered yet: capacity on its way, and
        # when they were asked for.
        self.requested = 0
        self._requested_at = 0.0
        # Every instance's prefix cache as its reports tell (empty where engines report none).
        self.prefix = PrefixIndex()
        # Requests waiting here for an instance with room (`dispatch.hold-freeness`).
        self._held = HeldRequests()
        # The tokens an anchor takes off the held requests' floors (`_floor`).
        self._floor_step = 0

    # ------------------------------------------------------------------ instance table

    def register_instance(
        self, instance_id: str, total_blocks: int, block_size: int, now: float, high_priority_headroom: int | None = None
    ) -> None:
        """Add a starting instance; it receives nothing until `mark_ready`.

        `high_priority_headroom`: the tokens of headroom its engine's latency profile derives, used
        unless the configuration sets one (`headroom-tokens`); neither: none.
        """
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"instance_id must be a non-empty string, got {instance_id!r}")
        if instance_id in self._instances:
            raise ValueError(f"instance {instance_id!r} is already registered")
        for name, value in (("total_blocks", total_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"instance {instance_id}: {name} must be an integer >= 1, got {value!r}")
        if high_priority_headroom is not None and not (
            isinstance(high_priority_headroom, int) and not isinstance(high_priority_headroom, bool) and high_priority_headroom >= 0
        ):
            raise ValueError(f"instance {instance_id}: high_priority_headroom must be an integer >= 0, got {high_priority_headroom!r}")
        derived = {Priority.HIGH: high_priority_headroom or 0}
        tokens = {p: t if t is not None else derived.get(p, 0) for p, t in self._config.headroom_tokens.items()}
        headroom = headroom_blocks(tokens, block_size)
        self._instances[instance_id] = _Instance(instance_id, total_blocks, block_size, headroom)
        self.requested = max(self.requested - 1, 0)
        self._membership_changed()

    def set_jobs(self, jobs: Mapping[str, str]) -> None:
        """Name the batch job of each instance that shares one with others (instance id -> job):
        scale-in drains such a job whole and takes it back whole. Unknown instances are ignored."""
        for instance_id, job in jobs.items():
            instance = self._instances.get(instance_id)
            if instance is not None:
                instance.job = job

    def mark_ready(self, instance_id: str, now: float) -> None:
        instance = self._get(instance_id)
        instance.ready = True
        instance.joined_at = now
        self._membership_changed()

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance (closed, or lost), with its pending-dispatch accounting."""
        self._get(instance_id)
        del self._instances[instance_id]
        self.prefix.drop(instance_id)
        self._membership_changed()

    def set_terminating(self, instance_id: str, now: float) -> None:
        """Drain an instance: F = -inf, no new requests, everything migrates out. Idempotent.
        An operator's drain: scaling never takes it back."""
        if self._get(instance_id).drain(by_scaling=False):
            self._membership_changed()

    def drain_order(self, instance_id: str) -> tuple[bool, int]:
        """What to tell the instance after it was drained or taken back: whether it drains, and
        the order's number, which it echoes in its reports (`InstanceLoad.drain_order`)."""
        instance = self._get(instance_id)
        return instance.terminating, instance.drain_order

    def report(self, load: InstanceLoad, now: float, prefix: PrefixEvents | None = None) -> None:
        """Replace an instance's last load report; `prefix`: its prefix-cache changes since the last."""
        instance = self._get(load.instance_id)
        if load.total_blocks != instance.total_blocks or load.block_size != instance.block_size:
            raise ValueError(
                f"instance {load.instance_id}: report has {load.total_blocks} blocks of {load.block_size} tokens, "
                f"registered with {instance.total_blocks} blocks of {instance.block_size}"
            )
        was_terminating = instance.terminating
        if instance.last_report_at is not None:  # a first report is no baseline (a restarted scheduler)
            self._departures.add(departures(instance.load, load), now)
        instance.absorb(load, now)
        cached = self.prefix.apply(load.instance_id, prefix) if prefix else []
        instance.last_report_at = now
        if instance.terminating and not was_terminating:
            self._membership_changed()
        elif self._candidates is not None:
            self._candidates.update(instance)
        if cached and self._held:
            self._held.cached(cached)  # held requests whose prompt's anchors these are take less

    def freeness(self, instance_id: str) -> float:
        """The instance's F, counting requests dispatched there but not yet reported."""
        return self._get(instance_id).freeness

    def instances(self) -> list[InstanceView]:
        """The whole table, in registration order."""
        return [instance.view(self.prefix.held_anchors(instance.instance_id) * anchor_stride(instance.block_size))
                for instance in self._instances.values()]

    @property
    def block_size(self) -> int | None:
        """The KV block size of the instances (the first registered of those known), which
        requesters cut prompts by for the block hashes dispatch matches against the instances'
        caches; None while none is registered. It is the engines' (vLLM's CPU blocks are 128
        tokens), not this process's configuration."""
        first = next(iter(self._instances.values()), None)
        return None if first is None else first.block_size

    def members(self) -> tuple[list[str], list[str]]:
        """Every known instance, and those a request may be placed on (ready, not draining)."""
        placeable = [i.instance_id for i in self._instances.values() if i.ready and not i.terminating]
        return list(self._instances), placeable

    # ------------------------------------------------------------------ decisions

    def dispatch(self, info: DispatchInfo, now: float) -> str | None:
        """Choose the instance for a new request (and the `info.count` - 1 placed with it) and count
        them as pending demand there; None when it is held (`dispatch.hold-freeness`,
        `llumdask.holding`): `release` places it once an instance has room, `withdraw` forgets it."""
        candidates = self._table()
        limit = self._config.dispatch.admission_freeness
        if limit is not None and not info.admitted:
            freest = float(self._freeness_of(candidates, info).max())
            if freest < limit:
                raise ClusterOverloaded(f"every instance would queue request {info.request_id}: the freest would keep "
                                        f"a dispatch freeness of {freest:.1f} with it, below {limit:g}",
                                        self._retry.slot(now, self._departures.per_second(now)))
        if (self._config.dispatch.hold_freeness is None or info.admitted or info.execution_priority is not Priority.NORMAL
                or not self._could_ever_leave_room(candidates, info)):
            # A high-priority request goes at once: its headroom, which migration then clears on
            # its instance, is the room kept for it. One that no instance could take with room
            # to spare even empty queues there (or is refused by the engine) rather than wait forever.
            return self._place_anywhere(candidates, info, now)
        # In line with the held requests: first if it outranks them, else only where it delays
        # none of them (every other change of state was followed by a `release`).
        hold = self._config.dispatch.hold_freeness
        if self._held.would_lead(info):
            target = self._place_held(candidates, info, now, hold)
        else:
            with self._reserved_for(candidates, self._held.first.info, now):
                target = self._place_held(candidates, info, now, hold)
        if target is None:
            self._held.add(info, now, *self._floor(candidates, info))
        return target

    def release(self, now: float) -> list[tuple[DispatchInfo, str]]:
        """Place the held requests that have room now, in order (`llumdask.holding`); the host
        calls it after every report and hands each placed request to its instance."""
        placed: list[tuple[DispatchInfo, str]] = []
        held = self._held
        hold = self._config.dispatch.hold_freeness
        while held and self.has_candidates():
            candidates = self._table()
            chosen = held.first
            if not self._could_ever_leave_room(candidates, chosen.info):
                # The instances it waited for have left: it goes as dispatch sends one that no
                # instance could take with room to spare, rather than wait forever.
                target = self._place_anywhere(candidates, chosen.info, now)
            else:
                first_hold = self._first_hold(chosen, now)
                # Past capacity most reports leave no room for it: the bound spares the computation.
                target = (self._place_held(candidates, chosen.info, now, first_hold)
                          if self._might_keep_hold(candidates, chosen.info, first_hold) else None)
            if target is None:
                with self._reserved_for(candidates, chosen.info, now):
                    # Only those whose floor fits the room some instance keeps (held ones are
                    # normal): after most reports, none.
                    spare = candidates.spare_tokens(hold, Priority.NORMAL)
                    for later in held.within(spare):
                        if later is not chosen and self._might_keep_hold(candidates, later.info, hold):
                            target = self._place_held(candidates, later.info, now, hold)
                            if target is not None:
                                chosen = later
                                break
            if target is None:
                break
            held.remove(chosen.info.request_id)
            placed.append((chosen.info, target))
        return placed

    def withdraw(self, request_id: str) -> bool:
        """Forget a held request (its client gave up); False if it is not held."""
        return self._held.remove(request_id) is not None

    def unplace(self, request_id: str, instance_id: str, count: int, now: float) -> bool:
        """Forget a placement of `count` requests on `instance_id` that will never be handed over
        (a held request placed after its requester gave up), so that the instance is not charged
        for it; False if that instance is gone."""
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        instance.cancel_pending(request_id, count, now)
        if self._candidates is not None:
            self._candidates.update(instance)
        return True

    @property
    def held(self) -> HeldRequests:
        """The requests held for room, in the order they leave (read-only for hosts)."""
        return self._held

    def pair_migrations(self, now: float) -> list[MigrationPair]:
        """This round's migration pairs among ready instances (the host calls it every interval)."""
        return pair_migrations((i for i in self._instances.values() if i.ready), self._config.migration,
                               queue_room=self._config.dispatch.hold_freeness)

    def scale(self, now: float) -> ScaleDecision:
        """Scaling decision at `now`; instances to terminate are marked terminating here already,
        instances to add are counted as `requested` until they register.

        Drained terminating instances are listed in `remove` once each (and in `drained()` until
        they are gone; a batch job's member until its job is taken back, which may be in the same
        call: then it is not listed); the host closes them and calls `remove_instance` (a job
        closes only once all its members are drained). With scaling disabled
        only `remove` is ever filled. No instance is added while requested ones are on their way
        (for `scaling.startup-timeout` at most: one not registered by then failed to start).
        Instances taken back (`resume`) are live again here already; the host tells each one.
        """
        remove = []
        for instance in self._instances.values():
            if instance.drained and not instance.removal_decided:
                instance.removal_decided = True
                remove.append(instance.instance_id)
        scaling = self._config.scaling
        if not scaling.enabled:
            return ScaleDecision(remove=tuple(remove))
        if self.requested and now - self._requested_at > scaling.startup_timeout:
            self.requested = 0
        live = [i for i in self._instances.values() if i.ready and not i.terminating]
        pool = self.pooled_load()
        # Never drain an instance that has just joined: it would be added and removed in turn.
        settled = [i for i in live if i.joined_at is not None and now - i.joined_at >= scaling.scale_in_period]
        # Draining instances hold resources until removed; requested ones will.
        room = scaling.max_instances - len(self._instances) - self.requested
        # Draining by a scale-in, seen so by a report made knowing it (so every report older than
        # the drain is in) and not yet found drained: coming back costs no start-up.
        returnable = [i for i in self._instances.values()
                      if i.scaled_in and i.heard and not i.removal_decided]
        # What a scale-in would drain now (looked for only above the band, where it may be due):
        # none where nothing may (every job waiting on a member that has not settled), so that its
        # timer runs on until something may.
        victims = []
        if live and pool.freeness > scaling.band[1] and len(live) > scaling.min_instances:
            members = [i for i in self._instances.values() if not i.terminating]
            victims = _to_drain(_units(settled, members), pool, scaling.band, len(live) - scaling.min_instances)
        action = self._scaling_policy.observe(
            now,
            pool.freeness if live else None,
            can_add=(room > 0 and not self.requested) or bool(returnable),
            can_terminate=bool(victims),
        )
        if action is ScaleAction.ADD:
            low = scaling.band[0]
            taken, pool = self._take_back(returnable, pool, low)
            short = pool.instances_short(low)
            add = 0 if self.requested else max(0, min(room, short if taken else max(1, short)))
            if add:
                self.requested += add
                self._requested_at = now
            # A job's member found drained just now and taken back with its job stays.
            resumed = tuple(i.instance_id for i in taken)
            return ScaleDecision(add=add, remove=tuple(r for r in remove if r not in resumed), resume=resumed)
        if action is ScaleAction.TERMINATE:
            for victim in victims:
                victim.drain(by_scaling=True)
            self._membership_changed()
            return ScaleDecision(terminate=tuple(i.instance_id for i in victims), remove=tuple(remove))
        return ScaleDecision(remove=tuple(remove))

    def drained(self) -> list[str]:
        """Terminating instances found drained (each listed once in a `remove`), not yet gone, and
        still drained: work that reached one since (a requester cut off from this scheduler hands
        requests to the instances it knew) keeps it from closing until that work has moved away."""
        return [i.instance_id for i in self._instances.values() if i.removal_decided and i.drained]

    def closable(self) -> list[str]:
        """`drained()` less the members of a batch job not drained whole: a job closes with all its
        members (what a retirement may pick, one worker at a time)."""
        drained = self.drained()
        done = set(drained)
        jobs = {i.job for i in self._instances.values() if i.job is not None and i.instance_id not in done}
        return [i for i in drained if self._instances[i].job not in jobs]

    def pooled_load(self) -> PooledLoad:
        """The cluster as one instance, what scaling keeps in its band: live instances and those
        still starting (capacity on its way, nothing on it yet); draining ones are leaving. The
        requests held here count as queued demand: room for them is what scaling out adds."""
        counted = [i for i in self._instances.values() if not i.terminating]
        pool = PooledLoad.of(i.pooled for i in counted)
        if not self._held:
            return pool
        size = self.block_size or self._config.block_size
        blocks = sum(blocks_for(h.info.num_prompt_tokens, size) * h.info.count for h in self._held)
        return replace(pool, surplus=pool.surplus - blocks, requests=pool.requests + sum(h.info.count for h in self._held))

    # ------------------------------------------------------------------ helpers

    def has_candidates(self) -> bool:
        """Whether any instance may take a request now (ready, not draining)."""
        return bool(self._candidate_table())

    def _candidate_table(self) -> CandidateTable:
        """The ready, non-terminating instances, possibly none (rebuilt only after membership changed)."""
        if self._candidates is None:
            self._candidates = CandidateTable(
                [i for i in self._instances.values() if i.ready and not i.terminating], self.prefix)
            if self._held and self._candidates.most_anchor_tokens != self._floor_step:
                # Floors count an anchor as its most tokens on any candidate: changed with them.
                for held in list(self._held):
                    self._held.refloor(held.info.request_id, *self._floor(self._candidates, held.info))
        return self._candidates

    def _table(self) -> CandidateTable:
        """`_candidate_table`, which must not be empty."""
        candidates = self._candidate_table()
        if not candidates:
            raise NoInstanceAvailable(f"no ready, non-terminating instance among {len(self._instances)} registered")
        return candidates

    def _freeness_of(self, candidates: CandidateTable, info: DispatchInfo) -> np.ndarray:
        """Each candidate's dispatch freeness with this request, its cached prefix counted."""
        return candidates.dispatch_freeness(info.num_prompt_tokens, info.execution_priority, self._cached(candidates, info),
                                            info.count)

    def _freest(self, candidates: CandidateTable, info: DispatchInfo) -> int:
        """The slot of the highest `_freeness_of`."""
        return candidates.freest(info.num_prompt_tokens, info.execution_priority, self._cached(candidates, info), info.count)

    def _cached(self, candidates: CandidateTable, info: DispatchInfo) -> np.ndarray | None:
        return candidates.cached_blocks(info.block_hashes) if self._config.dispatch.prefix_aware else None

    def _place(self, candidates: CandidateTable, info: DispatchInfo, chosen: str, now: float) -> str:
        """Put the request (and those placed with it) on the policy's choice, counted as pending there."""
        instance = self._instances.get(chosen)
        if instance is None or not instance.ready or instance.terminating:
            raise RuntimeError(f"dispatch policy {type(self._dispatch_policy).__name__} chose {chosen!r}, not a candidate")
        for _ in range(info.count):
            instance.add_pending(info, now)
        candidates.update(instance)
        return chosen

    def _place_anywhere(self, candidates: CandidateTable, info: DispatchInfo, now: float) -> str:
        """Put the request where the policy chooses, room to spare or not."""
        return self._place(candidates, info, self._dispatch_policy.choose(candidates, info), now)

    def _place_held(self, candidates: CandidateTable, info: DispatchInfo, now: float, hold: float) -> str | None:
        """Place a held request on the policy's choice where it leaves `hold` dispatch freeness,
        the prefix that instance caches not charged (as dispatch charges it); None while there is
        no such room (or the policy would put it elsewhere)."""
        freeness = self._freeness_of(candidates, info)
        if float(freeness[self._freest(candidates, info)]) < hold:
            return None
        chosen = self._dispatch_policy.choose(candidates, info)
        slot = candidates.slot(chosen)
        if slot is None or float(freeness[slot]) < hold:
            return None
        return self._place(candidates, info, chosen, now)

    def _first_hold(self, first: Held, now: float) -> float:
        """The room the first held request waits for: hold-freeness, until it has waited
        `dispatch.hold-limit`; then room for its prompt behind the instance's queue (freeness 0),
        its first token no longer deferred for the room others would grow into."""
        dispatch = self._config.dispatch
        assert dispatch.hold_freeness is not None, "requests are held only while hold-freeness is set"
        if dispatch.hold_limit is not None and now - first.since >= dispatch.hold_limit:
            return 0.0
        return dispatch.hold_freeness

    def _might_keep_hold(self, candidates: CandidateTable, info: DispatchInfo, hold: float) -> bool:
        """False where `_place_held` would surely find no room to keep `hold` for the request: a
        bound that spares the full computation (with prefix-aware dispatch, the prompt up to the
        last anchor any instance caches counted as cached everywhere)."""
        cached = candidates.most_cached_bound(info.block_hashes) if self._config.dispatch.prefix_aware else 0.0
        return candidates.could_keep(hold, info.num_prompt_tokens, info.execution_priority, cached, info.count)

    def _floor(self, candidates: CandidateTable, info: DispatchInfo) -> tuple[float, tuple[int, ...], float]:
        """At most the prompt tokens the request's copies could take on any candidate, where
        `_might_keep_hold` reads it (`HeldRequests.within`): the prompt less all it might find
        cached (with prefix-aware dispatch, up to the last anchor any instance caches, each anchor
        its most tokens on any candidate), once per copy; the anchors past that, and what each
        takes off once cached (`HeldRequests.add`)."""
        step = self._floor_step = candidates.most_anchor_tokens
        copies = info.count
        if not self._config.dispatch.prefix_aware or not info.block_hashes:
            return copies * info.num_prompt_tokens, (), 0.0
        bound = self.prefix.longest_bound(info.block_hashes)
        return copies * (info.num_prompt_tokens - bound * step), tuple(info.block_hashes[bound:]), float(copies * step)

    def _could_ever_leave_room(self, candidates: CandidateTable, info: DispatchInfo) -> bool:
        """Whether an empty candidate would keep hold-freeness with the request (its copies its
        only requests)."""
        hold = self._config.dispatch.hold_freeness
        assert hold is not None
        return candidates.could_ever_keep(hold, info.num_prompt_tokens, info.count)

    def _reserved_for(self, candidates: CandidateTable, first: DispatchInfo, now: float) -> Reservation:
        """Keep for the first held request the instance where it is closest to fitting unless its
        room is shrinking (a context). Where it is, the requests running there growing, the first
        would wait on whatever is reserved, and the reservation would only keep the smaller held
        requests from what may be the only room there is: none is kept then (keeping another
        instance instead would keep room the first may never take)."""
        slot = self._freest(candidates, first)
        shrinking = self._instances[candidates[slot].instance_id].room_trend.shrinking(now)
        return candidates.reserved(None if shrinking else slot)

    def _take_back(self, returnable: list[_Instance], pool: PooledLoad, low: float) -> tuple[list[_Instance], PooledLoad]:
        """Take back instances a scale-in is draining, those holding the most requests first (the
        most left to move, and the least yet moved), each with the rest of its batch job (a scale-in
        drained it whole; a member found drained already is still there, since the job closes
        only whole): at least one, then more while the pooled freeness with them counted stays
        below `low`; and the pool with them."""
        ordered = sorted(returnable, key=lambda i: (-(i.load.num_running + i.load.num_waiting + i.num_pending), i.order))
        taken: list[_Instance] = []
        for instance in ordered:
            if instance in taken:
                continue
            if taken and pool.freeness >= low:
                break
            mates = [m for m in self._instances.values()
                     if m is not instance and m.job is not None and m.job == instance.job and m.scaled_in]
            for back in [instance] + mates:
                back.resume()
                taken.append(back)
                pool += PooledLoad.of([back.pooled])
        if taken:
            self._membership_changed()
        return taken, pool

    def _membership_changed(self) -> None:
        self._candidates = None
        self.epoch += 1

    def _get(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstance(f"unknown instance {instance_id!r}: never registered, or already removed") from None


def _units(settled: list[_Instance], members: list[_Instance]) -> list[list[_Instance]]:
    """What scale-in may drain, each unit whole: an instance on its own, or every member (not
    draining, ready or not) of a batch job (`_Instance.job`) where all of them have been here a
    whole period (one drained alone could not close: it would sit idle until its job-mates
    drained too)."""
    jobs: dict[str, list[_Instance]] = {}
    for instance in members:
        if instance.job is not None:
            jobs.setdefault(instance.job, []).append(instance)
    eligible = {id(i) for i in settled}
    units, seen = [], set()
    for instance in settled:
        if instance.job is None:
            units.append([instance])
        elif instance.job not in seen:
            seen.add(instance.job)
            if all(id(mate) in eligible for mate in jobs[instance.job]):
                units.append(jobs[instance.job])
    return units


def _to_drain(units: list[list[_Instance]], pool: PooledLoad, band: tuple[float, float], most: int) -> list[_Instance]:
    """Instances to drain, whole units (`_units`) the cheapest first (fewest running requests, then
    the freest: one total order): at least one, then as many more as leave the pooled freeness at
    least the band's high, each counted with its own capacity; never more than `most` instances.
    A job of several goes first only where the pooled freeness keeps the band's low without it
    (else the next scale-out would start one again)."""
    low, high = band
    freest_first = sorted(units, key=lambda u: max(i.key for i in u), reverse=True)
    ordered = sorted(freest_first, key=lambda u: sum(i.load.num_running + i.num_pending for i in u))
    victims: list[_Instance] = []
    leaving = 0
    for unit in ordered:
        blocks = sum(i.total_blocks for i in unit)
        if len(victims) + len(unit) > most:
            continue
        if victims and not pool.keeps(high, leaving + blocks):
            if len(unit) > 1:
                continue  # a smaller unit after it may still fit
            break
        if not victims and len(unit) > 1 and not pool.keeps(low, blocks):
            continue
        victims += unit
        leaving += blocks
    return victims
