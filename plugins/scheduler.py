"""The global scheduler on the Dask scheduler: a thin `SchedulerPlugin` around `GlobalScheduler`.

The plugin only translates: comm messages in, `GlobalScheduler` calls, small messages out. It
never sees tokens or KV blocks. Instance ids are worker addresses. An instance is dispatched to
only after its llumlet said "ready" (the plugin's `add_worker` runs before a worker's plugins are
set up). Everything it receives and sends is msgpack-native (scheduler comms do not deserialize).

RPC handlers (`plugins/control.py` names them; a refusal, in brackets, is raised again at the caller):
    llumnix_register(instance, total_blocks, block_size, high_priority_headroom) -> {"registered": bool}
    llumnix_ready(instance)                              -> {"ready": bool}
    llumnix_unregister(instance)                         -> {"removed": bool}
    llumnix_dispatch(request_id, num_prompt_tokens, max_tokens, execution_priority,
                     admitted=False, block_hashes=(), count=1,
                     answer_within=None, attempt=None)   -> {"instance": str | None, "no_instance": bool}
                                                            [NoInstanceAvailable, ClusterOverloaded]
        (None: held for room; asked again with the same id it answers once placed, waiting up
        to HOLD_ANSWER s each time (half of answer_within, the asker's timeout, at most); a held
        request not asked about for HOLD_LEASE s is withdrawn;
        no_instance: held while no instance may take a request)
    llumnix_withdraw(request_id, attempt=None)           -> {"withdrawn": bool} (the requester gave
        up on its dispatch numbered `attempt`: the held request, or a placement it never got
        (made since its last ask, or answered lately), is forgotten; nothing of another attempt)
    llumnix_status()                                     -> {"instances": [row, ...], "migrations": {...}}
    llumnix_members(epoch=None)                          -> {"epoch": str, "alive": [id, ...] | None,
                                                             "placeable": [id, ...] | None} (None: unchanged)
    llumnix_migrations(limit=50)                         -> [event, ...] (the latest outcomes, oldest first)
    llumnix_drain(instance)                              -> {"draining": True} [UnknownInstance]
    llumnix_migrate(request_id, destination, source=None) -> {"migration_id": str} [MigrationNotStarted]
    llumnix_adaptive_target(jobs=None)                   -> {"target": int, "drained": [worker name, ...]}
        (`jobs`: worker name -> its batch job, where jobs hold several; drained and taken back whole)
With `scaling.enabled` the plugin also answers Dask's own `adaptive_target` (an int), for
autoscalers that take no Adaptive class (the Kubernetes operator); `valid_workers_downscaling`
offers only drained instances to any retirement, so scale-in never drops a request.
Stream ops from workers: llumnix_load(load), llumnix_event(event).
Stream ops to workers: llumnix_migrate_to(destination), llumnix_set_terminating(flag, order),
llumnix_peer_lost(peer).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from distributed.core import CommClosedError
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from llumdask.config import LlumdaskConfig, load_config
from llumdask.global_scheduler import (
    ClusterOverloaded,
    DispatchInfo,
    GlobalScheduler,
    InstanceView,
    NoInstanceAvailable,
    UnknownInstance,
)
from llumdask.llumlet import MigrationEventKind
from llumdask.load import InstanceLoad
from llumdask.prefix import PrefixEvents
from llumdask.plugins.control import (
    AdaptiveTarget,
    Draining,
    InstanceState,
    Members,
    MigrationNotStarted,
    MigrationPinned,
    Op,
    Placed,
    Ready,
    Registered,
    Removed,
    Withdrawn,
    call,
    refusal,
    reply,
)
from llumdask.plugins.dashboard import add_page
from llumdask.plugins.history import ClusterHistory, Sample
from llumdask.plugins.metrics import SchedulerMetrics

logger = logging.getLogger(__name__)

PLUGIN_NAME = "llumdask"
# How long a dispatch of a held request waits for its placement before answering "held" (and at
# most half the asker's dispatch timeout, so a held request never looks like a silent scheduler),
# and how long a held request is kept without being asked about (its requester is gone).
HOLD_ANSWER = 1.0
HOLD_LEASE = 5.0
# How long a placement told to its requester can still be withdrawn (at least; three times the
# asker's timeout where that is longer, up to the most): an answer lost on its way (the requester
# timed out first) would otherwise charge its instance for a request it never gets.
ANSWER_KEPT, ANSWER_KEPT_MOST = 5.0, 60.0


@dataclass
class _Waiting:
    """A held request's placement to come, until when its requester is taken to be there, how
    many requests it places (its choices), and the requester's number for its latest ask."""

    placement: asyncio.Future
    lease: float
    count: int
    attempt: int | None


@dataclass
class _Answered:
    """A placement told to its requester's dispatch `attempt`, withdrawable until `until` (monotonic)."""

    instance: str
    count: int
    attempt: int | None
    until: float


def instance_row(view: InstanceView, state: InstanceState) -> dict[str, Any]:
    """One instance as a msgpack-native row (for the notebook table and dashboards)."""
    load = view.load
    return {
        "instance": view.instance_id,
        "state": state.value,
        "ready": view.ready,
        "freeness": view.freeness,
        "dispatch_freeness": view.dispatch_freeness,
        "total_blocks": load.total_blocks,
        "free_blocks": load.free_blocks,
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "num_pending": view.num_pending,
        "num_migrating_out": load.num_migrating_out,
        "num_migrating_in": load.num_migrating_in,
        "num_preemptions": load.num_preemptions,
        "num_received": load.num_received,
        "cached_blocks": view.cached_blocks,
        "last_report_at": view.last_report_at,
    }


class LlumnixSchedulerPlugin(SchedulerPlugin):
    """Hosts the `GlobalScheduler` on the Dask scheduler's event loop."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, config_overrides: dict | None = None) -> None:
        # Overrides travel pickled; the config itself is read on the scheduler, where it runs.
        self._overrides = dict(config_overrides or {})
        self.config: LlumdaskConfig | None = None
        self.global_scheduler: GlobalScheduler | None = None
        self.scheduler = None
        self._periodic: PeriodicCallback | None = None
        self._last_pairs: dict[str, str] = {}
        self.scaling_log: deque[dict] = deque(maxlen=100)
        self.recent_migrations: deque[dict] = deque(maxlen=200)  # outcomes, for the dashboard page
        self.dashboard_page: str | None = None
        self.metrics: SchedulerMetrics | None = None  # made at start: a registered plugin is pickled first
        # Epochs of a restarted scheduler must not match the ones a requester saw before.
        self._incarnation = uuid.uuid4().hex[:12]
        self._waiting: dict[str, _Waiting] = {}  # held requests, by id
        self._answered: dict[str, _Answered] = {}  # placements told lately, by request id
        self.history = ClusterHistory()

    # ------------------------------------------------------------------ plugin hooks
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.config = load_config(self._overrides)
        self.global_scheduler = GlobalScheduler(self.config)
        scheduler.handlers.update(
            {
                Op.REGISTER: self.register,
                Op.READY: self.ready,
                Op.UNREGISTER: self.unregister,
                Op.DISPATCH: self.dispatch,
                Op.WITHDRAW: self.withdraw,
                Op.STATUS: self.status,
                Op.MEMBERS: self.members,
                Op.MIGRATIONS: self.migrations,
                Op.DRAIN: self.drain,
                Op.MIGRATE: self.migrate,
                Op.ADAPTIVE_TARGET: self.adaptive_target,
            }
        )
        if self.config.scaling.enabled:
            # The RPC and the HTTP API (/api/v1/adaptive_target, which calls the method) alike.
            scheduler.handlers["adaptive_target"] = self.dask_adaptive_target
            scheduler.adaptive_target = self.dask_adaptive_target
        scheduler.stream_handlers.update({Op.LOAD: self.on_load, Op.EVENT: self.on_event})
        self._periodic = PeriodicCallback(self.tick, self.config.migration.interval * 1000)
        self._periodic.start()
        self.dashboard_page = add_page(scheduler, self)
        self.metrics = SchedulerMetrics(self.global_scheduler.instances, lambda: len(self._scheduler().held))
        self.metrics.install()

    async def close(self) -> None:
        if self._periodic is not None:
            self._periodic.stop()
            self._periodic = None
        if self.metrics is not None:
            self.metrics.uninstall()

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        """Only drained instances may be retired, a batch job's only once all its members are:
        closing any other would drop its requests (a job closes with all its workers)."""
        closable = set(self._scheduler().closable())
        return [ws for ws in workers if ws.address in closable]

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        """A worker left: forget its instance and tell the others, whose migrations with it abort."""
        if self._forget(worker):
            for peer in self._instance_ids():
                self._send(peer, {"op": Op.PEER_LOST, "peer": worker})

    # ------------------------------------------------------------------ RPC handlers
    def register(self, instance: str, total_blocks: int, block_size: int, high_priority_headroom: int | None = None) -> dict:
        """A llumlet announces its capacity (and its profile's headroom); a restarted one replaces
        its previous record."""
        self._forget(instance)
        self._scheduler().register_instance(instance, total_blocks, block_size, time.time(), high_priority_headroom)
        return reply(Registered(True))

    def ready(self, instance: str) -> dict:
        try:
            self._scheduler().mark_ready(instance, time.time())
        except UnknownInstance:
            return reply(Ready(False))
        return reply(Ready(True))

    def unregister(self, instance: str) -> dict:
        return reply(Removed(self._forget(instance)))

    async def dispatch(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        execution_priority: int = 0,
        admitted: bool = False,
        block_hashes: Sequence[int] = (),
        count: int = 1,
        answer_within: float | None = None,
        attempt: int | None = None,
    ) -> dict:
        """`answer_within`: the requester's dispatch timeout; a held request's answer comes in half
        of it at most, or it would read as a silent scheduler. `attempt`: the requester's number
        for this dispatch, which its withdrawal names."""
        waiting = self._waiting.get(request_id)
        if waiting is None:
            info = DispatchInfo(request_id, num_prompt_tokens, max_tokens, execution_priority, admitted,
                                tuple(block_hashes), count)
            try:
                instance = self._scheduler().dispatch(info, time.time())
            except (NoInstanceAvailable, ClusterOverloaded) as exc:
                self._metrics().dispatches["refused"] += count
                return refusal(exc)
            if instance is not None:
                self._metrics().dispatches["placed"] += count
                return self._answer(request_id, instance, count, attempt, answer_within)
            self._metrics().dispatches["held"] += count
            waiting = self._waiting[request_id] = _Waiting(asyncio.get_running_loop().create_future(), 0.0, count,
                                                           attempt)
        waiting.lease = time.monotonic() + HOLD_LEASE
        waiting.attempt = attempt  # asked again after a withdrawal that never came: the latest asker's
        try:
            wait = HOLD_ANSWER if answer_within is None else min(HOLD_ANSWER, answer_within / 2)
            instance = await asyncio.wait_for(asyncio.shield(waiting.placement), wait)
        except asyncio.TimeoutError:
            return reply(Placed(None, no_instance=not self._scheduler().has_candidates()))
        self._waiting.pop(request_id, None)
        return self._answer(request_id, instance, waiting.count, attempt, answer_within)

    def _answer(self, request_id: str, instance: str, count: int, attempt: int | None,
                answer_within: float | None) -> dict:
        """The placement's answer, remembered in case its requester withdraws it (the answer lost)."""
        kept = min(max(ANSWER_KEPT, 3 * answer_within), ANSWER_KEPT_MOST) if answer_within is not None else ANSWER_KEPT
        self._answered.pop(request_id, None)
        self._answered[request_id] = _Answered(instance, count, attempt, time.monotonic() + kept)
        return reply(Placed(instance))

    def withdraw(self, request_id: str, attempt: int | None = None) -> dict:
        """The requester gave up on its dispatch `attempt` (it timed out, or its caller left):
        forget the held request, or the placement made for it that it never got (since its last
        ask, or an answer lost on its way), which will never be handed over; the requests behind
        it may go now. Nothing of another attempt is forgotten (a placement handed over before)."""
        waiting = self._waiting.get(request_id)
        answered = self._answered.get(request_id)
        if waiting is not None and waiting.attempt == attempt:
            del self._waiting[request_id]
            forgotten = self._forget_held(request_id, waiting)
        elif waiting is None and answered is not None and answered.attempt == attempt:
            del self._answered[request_id]
            forgotten = self._unplace(request_id, answered.instance, answered.count)
        else:
            forgotten = False
        if forgotten:
            self.release()
        return reply(Withdrawn(forgotten))

    def release(self) -> None:
        """Held requests that have room now go where the scheduler puts them."""
        for info, instance in self._scheduler().release(time.time()):
            self._metrics().dispatches["placed"] += info.count
            waiting = self._waiting.get(info.request_id)
            if waiting is not None and not waiting.placement.done():
                waiting.placement.set_result(instance)

    def expire_held(self) -> None:
        """Withdraw held requests whose requester stopped asking (and forget answered ones it never
        fetched); placements told long enough ago are no longer withdrawable."""
        now = time.monotonic()
        for request_id, waiting in list(self._waiting.items()):
            if waiting.lease < now:
                del self._waiting[request_id]
                self._forget_held(request_id, waiting)
        # Oldest first: one kept longer at the front keeps those behind it as long (harmless: only
        # the dispatch that never got them would withdraw them), and an expiry costs no sweep.
        while self._answered and next(iter(self._answered.values())).until < now:
            del self._answered[next(iter(self._answered))]

    def _forget_held(self, request_id: str, waiting: _Waiting) -> bool:
        """Withdraw a held request, or, placed already but never fetched, its placement's charge."""
        placement = waiting.placement
        if self._scheduler().withdraw(request_id):
            placement.cancel()
        elif not placement.done() or placement.cancelled():
            return False
        else:
            return self._unplace(request_id, placement.result(), waiting.count)
        self._metrics().dispatches["withdrawn"] += waiting.count
        return True

    def _unplace(self, request_id: str, instance: str, count: int) -> bool:
        """Uncharge a placement never handed over; False if its instance is gone, and the charge with it."""
        if not self._scheduler().unplace(request_id, instance, count, time.time()):
            return False
        self._metrics().dispatches["withdrawn"] += count
        return True

    def status(self) -> dict:
        metrics = self._metrics()
        return {
            "instances": [instance_row(view, self._state_of(view)) for view in self._scheduler().instances()],
            "migrations": {"committed": metrics.migrations["committed"],
                           "aborted": metrics.migrations["aborted"],
                           "started": metrics.migrations["started"],
                           "downtime": metrics.downtime,
                           "refused": dict(metrics.refused)},
            "scaling": {"adds_wanted": self._scheduler().requested, "drained": sorted(self._scheduler().drained()),
                        "log": list(self.scaling_log)},
            "held": {"requests": len(self._scheduler().held), "oldest_s": self._scheduler().held.oldest(time.time())},
        }

    def members(self, epoch: str | None = None) -> dict:
        """The instance ids (all, and those a request may go to), or only the epoch when the caller's
        `epoch` is current: what a requester polls every second to notice a dead instance."""
        scheduler = self._scheduler()
        current = f"{self._incarnation}:{scheduler.epoch}"
        block_size = scheduler.block_size or self.config.block_size
        if epoch == current:
            return reply(Members(current, None, None, block_size))
        alive, placeable = scheduler.members()
        return reply(Members(current, tuple(alive), tuple(placeable), block_size))

    def migrations(self, limit: int = 50) -> list[dict]:
        """The latest `limit` migration outcomes (committed and aborted), oldest first."""
        return list(self.recent_migrations)[-limit:] if limit > 0 else []

    def drain(self, instance: str) -> dict:
        """Operator drain: F = -inf, no new requests, its requests migrate out."""
        try:
            self._scheduler().set_terminating(instance, time.time())
        except UnknownInstance as exc:
            return refusal(exc)
        self._tell_drain_order(instance)
        return reply(Draining(True))

    async def migrate(self, request_id: str, destination: str, source: str | None = None) -> dict:
        """Operator-forced migration of one request; the source llumlet runs it.

        Without a source every other ready instance is asked in turn: the one running the request
        starts the migration, the others refuse (requests are not tracked here after dispatch).
        """
        known = {view.instance_id: view for view in self._scheduler().instances()}
        roles = (("destination", destination),) if source is None else (("source", source), ("destination", destination))
        for role, instance in roles:
            if instance not in known or not known[instance].ready:
                return self._refuse(MigrationNotStarted(f"{role} {instance!r} is not a ready instance"))
        if source == destination:
            return self._refuse(MigrationNotStarted("source and destination are the same instance"))
        if known[destination].terminating:
            return self._refuse(MigrationNotStarted(f"destination {destination!r} is terminating"))
        sources = [source] if source is not None else [i for i, v in known.items() if v.ready and i != destination]
        refused = MigrationNotStarted(f"request {request_id!r} is not running (or cannot move now) on any other instance")
        for candidate in sources:
            try:
                return reply(await call(self.scheduler.rpc(candidate), Op.MIGRATE_OUT, request_id=request_id,
                                        destination=destination))
            except MigrationPinned as exc:
                refused = exc
                break
            except MigrationNotStarted as exc:
                if source is not None:
                    refused = exc
        return self._refuse(refused)

    def _refuse(self, exc: MigrationNotStarted) -> dict:
        """An operator migration's refusal, counted by reason."""
        self._metrics().refused["pinned" if isinstance(exc, MigrationPinned) else "not_started"] += 1
        return refusal(exc)

    def adaptive_target(self, jobs: dict | None = None) -> dict:
        """`jobs`: worker name -> the name of the batch job it shares with others (the caller's
        cluster knows them), which scale-in drains and takes back whole."""
        if isinstance(jobs, dict):
            self._scheduler().set_jobs({ws.address: str(jobs[str(ws.name)]) for ws in self.scheduler.workers.values()
                                        if str(ws.name) in jobs})
        return reply(self._adaptive_target())

    def _adaptive_target(self) -> AdaptiveTarget:
        """Workers to keep (all but the drained, plus the instances asked for whose worker has not
        arrived: a requested instance counts until it registers, its worker from arrival on)
        and which may close."""
        scheduler, workers = self._scheduler(), self.scheduler.workers
        registered = {view.instance_id for view in scheduler.instances()}
        arriving = sum(1 for w in workers if w not in registered)
        drained = [w for w in scheduler.drained() if w in workers]
        return AdaptiveTarget(len(workers) - len(drained) + max(scheduler.requested - arriving, 0),
                              tuple(workers[w].name for w in drained))

    def dask_adaptive_target(self, target_duration: Any = None) -> int:
        """Dask's `adaptive_target` handler, answered from the freeness band. An autoscaler that
        reads only this number (the Kubernetes operator) retires workers only while it is below
        their count and starts them only while it is above: while no more instances are asked for
        than are drained, the drained close first (the asked for are left out until they are
        gone; counted together one of each would cancel out until the ask expired,
        `scaling.startup-timeout`); more asked for start first (the target is above the count,
        and the operator's minimum cannot hold it at the count)."""
        plan = self._adaptive_target()
        kept = len(self.scheduler.workers) - len(plan.drained)
        return kept if plan.drained and plan.target - kept <= len(plan.drained) else plan.target

    # ------------------------------------------------------------------ stream handlers
    # A stream handler that raises makes Dask drop the sending worker: these log and go on.
    def on_load(self, load: dict, worker: str | None = None) -> None:
        try:
            prefix = load.pop("prefix", None)
            self._scheduler().report(InstanceLoad.from_dict(load), time.time(),
                                     None if prefix is None else PrefixEvents.from_dict(prefix))
            self.release()
        except UnknownInstance:
            logger.debug("load report from unregistered instance %s ignored", load.get("instance_id"))
        except (KeyError, TypeError, ValueError):
            logger.exception("bad load report from %s ignored", worker)

    def on_event(self, event: dict, worker: str | None = None) -> None:
        self._metrics().on_migration_event(event)
        if event.get("kind") != MigrationEventKind.STARTED.value:
            self.recent_migrations.append(dict(event))

    # ------------------------------------------------------------------ periodic decisions
    def tick(self) -> None:
        self.pair()
        self.scale()
        self.expire_held()
        self.release()  # after instances joined or left
        now = time.time()
        if self.history.due(now):
            self.history.record(self.sample(now))

    def sample(self, now: float) -> Sample:
        """The cluster now, for the dashboard's time series."""
        scheduler, metrics = self._scheduler(), self._metrics()
        views = scheduler.instances()
        return Sample(
            time=now,
            pooled_freeness=scheduler.pooled_load().freeness,
            ready_instances=sum(v.ready for v in views),
            dispatches=metrics.dispatches["placed"],
            committed=metrics.migrations["committed"],
            aborted=metrics.migrations["aborted"],
            downtime=metrics.downtime,
            used_pct={v.instance_id: 100.0 * v.load.used_blocks / max(v.load.total_blocks, 1) for v in views},
        )

    def scale(self) -> None:
        """Act on the scaling decision: drain victims and take back draining ones (each told
        over its stream); instances asked for and drained ones are the global scheduler's to
        count, and Dask's adaptive deployment acts on them."""
        now = time.time()
        decision = self._scheduler().scale(now)
        for victim in decision.terminate:
            self._tell_drain_order(victim)
            self._log_scaling(now, "terminate", victim)
        for instance in decision.resume:
            self._tell_drain_order(instance)
            self._log_scaling(now, "resume", instance)
        if decision.add:
            self._log_scaling(now, "add", None)
        for instance in decision.remove:
            self._log_scaling(now, "remove", instance)

    def _tell_drain_order(self, instance: str) -> None:
        flag, order = self._scheduler().drain_order(instance)
        self._send(instance, {"op": Op.SET_TERMINATING, "flag": flag, "order": order})

    def _log_scaling(self, now: float, action: str, instance: str | None) -> None:
        self.scaling_log.append({"time": now, "action": action, "instance": instance})
        self._metrics().scaling[action] += 1

    def pair(self) -> None:
        """Every migration interval: pair sources with destinations and tell each source."""
        scheduler = self._scheduler()
        pairs = scheduler.pair_migrations(time.time()) if self.config.migration.enabled else []
        self._last_pairs = {p.source: p.destination for p in pairs}
        for p in pairs:
            self._send(p.source, {"op": Op.MIGRATE_TO, "destination": p.destination, "take_waiting": p.take_waiting})

    # ------------------------------------------------------------------ helpers
    def _scheduler(self) -> GlobalScheduler:
        if self.global_scheduler is None:
            raise RuntimeError("the llumdask scheduler plugin has not started")
        return self.global_scheduler

    def _metrics(self) -> SchedulerMetrics:
        if self.metrics is None:
            raise RuntimeError("the llumdask scheduler plugin has not started")
        return self.metrics

    def _instance_ids(self) -> list[str]:
        return [view.instance_id for view in self._scheduler().instances()]

    def _forget(self, instance: str) -> bool:
        try:
            self._scheduler().remove_instance(instance)
        except UnknownInstance:
            return False
        self._last_pairs.pop(instance, None)
        return True

    def _state_of(self, view: InstanceView) -> InstanceState:
        if not view.ready:
            return InstanceState.STARTING
        if view.terminating:
            return InstanceState.TERMINATING
        if view.instance_id in self._last_pairs:
            return InstanceState.SOURCE
        if view.instance_id in self._last_pairs.values():
            return InstanceState.DESTINATION
        return InstanceState.NORMAL

    def _send(self, worker: str, msg: dict) -> None:
        """Fire-and-forget to a worker's llumlet over the scheduler's batched stream."""
        stream = self.scheduler.stream_comms.get(worker) if self.scheduler is not None else None
        if stream is None:
            return
        try:
            stream.send(msg)
        except CommClosedError:
            logger.info("could not send %s to %s: stream closed", msg["op"], worker)


async def dask_setup(scheduler) -> None:
    """`dask scheduler --preload llumdask.plugins.scheduler`: configured from dask.config."""
    scheduler.add_plugin(LlumnixSchedulerPlugin(), name=PLUGIN_NAME, idempotent=True)
