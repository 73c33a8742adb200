"""The llumlet on a Dask worker: a `WorkerPlugin` hosting one engine instance and its llumlet.

The llumlet is sans-IO and single-threaded; this host drives it. Every llumlet (and engine) call
runs on one dedicated thread (`EngineThread`), in submission order between engine steps, so
steps never block the worker's event loop (heartbeats would stall), the engine steps back to
back without waiting for the loop, and migration messages of one comm are handled in order.
The event loop does the I/O with the scheduler and the peers: load reports, migration comms
(`CommTransport`). Tokens go from the engine thread itself to the requesters (`TokenPusher`).

The engine shares the GIL with the event loop, so every wake-up of the loop takes time from the
engine's steps (a diagnosis, from per-thread /proc counters read by hand around one
`gateway_overhead` level, tiny model, 8 streams: the loop slept and woke ~900 times a second, and
the engine thread ran 82% of the time where vLLM's own engine ran 89%). So the engine
thread sends the tokens itself, writes the load report itself every `report-interval` (once a
second when nothing changed; the loop only passes it on to the scheduler), and Dask's own timers that a llumlet worker does not need are
slowed (`DaskTimers`).

What the engine thread does between steps (stepping, the output cadence, the route table that
says where each request's tokens go, the report cadence) is `LlumletDriver`'s, which does no
I/O; this host wires it to the worker: thread, comms, handlers, registration.

Worker RPC handlers (a refusal, in brackets, is raised again at the caller; see plugins/control.py):
    llumnix_add(requests, reply_to, resubmission, hand_over=None)
                                               -> {"accepted": True} [RequestRejected] (all or none;
                                                  refused if its hand-over was aborted first)
    llumnix_abort(request_id, hand_over=None)  -> {"aborted": bool}
    llumnix_where(request_ids)                 -> {"here": [id, ...], "moved": {id: destination}, "gone": [id, ...]}
    llumnix_migrate_out(request_id, destination) -> {"migration_id": str} [MigrationNotStarted]
    llumnix_worker_status()                    -> see `LlumletHost.status`
    llumnix_migration(sender, message, context) (one-way, see plugins/transport.py)
Stream ops from the scheduler: llumnix_migrate_to, llumnix_set_terminating, llumnix_peer_lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, TypeVar

from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import IOLoop

from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.base import Engine
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.protocol import MigrationMessage
from llumdask.plugins.control import (
    SCHEDULER_TO_WORKER,
    Aborted,
    Accepted,
    MigrationNotStarted,
    MigrationPinned,
    MigrationStarted,
    NoLlumdaskScheduler,
    Op,
    RequestRejected,
    call,
    refusal,
    reply,
)
from llumdask.plugins.dask_timers import DaskTimers
from llumdask.plugins.engine_thread import EngineThread
from llumdask.plugins.llumlet_driver import LlumletDriver
from llumdask.plugins.streams import TokenPusher
from llumdask.plugins.transport import CommTransport
from llumdask.plugins.wire import event_to_msg, request_from_msg

logger = logging.getLogger(__name__)

PLUGIN_NAME = "llumdask"
T = TypeVar("T")

def _ignore(**_: Any) -> None:
    return None


def make_engine(config: LlumdaskConfig, instance_id: str, clock: Callable[[], float]) -> Engine:
    """The engine named by `llumdask.engine`.

    The sim engine runs in real time here: the host's clock is the wall clock, so a step must
    take its modelled duration for token timestamps, streaming and migration races to be real.

    vLLM runs inside this worker process (its EngineCore and, on one device, its model runner),
    so a daemonic worker hosts it as it is. Split over several devices, vLLM starts a process
    per device, which a daemonic process may not do.
    """
    if config.engine == "sim":
        from llumdask.engine.sim import SimEngine

        real_time = replace(config, sim_engine=replace(config.sim_engine, real_time=True))
        return SimEngine.from_config(real_time, clock=clock, instance_id=instance_id)
    if config.engine == "vllm":
        from llumdask.engine.vllm.factory import create_engine, worker_processes

        if worker_processes(config.vllm_engine) and multiprocessing.current_process().daemon:
            raise RuntimeError(
                "this vLLM instance spans several devices, so vLLM starts worker processes, which a "
                "daemonic Dask worker cannot: set distributed.worker.daemon to False "
                "(DASK_DISTRIBUTED__WORKER__DAEMON=False for `dask worker`)"
            )
        return create_engine(config.vllm_engine, clock)
    raise ValueError(f"llumdask.engine {config.engine!r} is not an engine; use 'sim' or 'vllm'")


def close_engine(engine: Engine) -> None:
    """Release what an engine holds beyond Python objects (vLLM: its engine core and KV cache),
    so that removing the plugin from a running worker frees the memory. Not every engine has any."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


class LlumletHost:
    """Runs one llumlet on a worker: engine thread, comms, handlers, registration."""

    def __init__(self, worker, config: LlumdaskConfig) -> None:
        self.worker = worker
        self.config = config
        self.instance_id: str = worker.address
        self.loop: IOLoop = worker.loop
        migration = config.migration
        self.driver = LlumletDriver(
            stream_interval=config.stream_interval,
            report_interval=config.report_interval,
            route_expiry=2 * migration.handshake_timeout * (migration.max_stages + 1),
            push_tokens=lambda due: self.pusher.push(due),
            send_load=lambda load: self.loop.add_callback(self._send_load, load),
            publish_event=lambda event: self.loop.add_callback(self._publish_event, event),
            calls_waiting=lambda: self._engine_thread.calls_waiting,
            max_failed_steps=config.max_failed_steps,
            on_broken=lambda failures: self.loop.add_callback(self._leave, failures),
        )
        self._engine_thread = EngineThread(f"llumlet {self.instance_id}", self.driver.step_once, config.report_interval)
        self._registrar: asyncio.Task | None = None
        self._dask_timers = DaskTimers(worker)
        self.registered = False
        self.started_at = time.time()
        self.events: deque[dict] = deque(maxlen=256)
        # Used on the engine thread only.
        self.pusher = TokenPusher(self.instance_id, on_unreachable=self.driver.drop_requests_of,
                                  connect_timeout=migration.handshake_timeout,
                                  ssl_context=worker.connection_args.get("ssl_context"))
        self.transport = CommTransport(
            self.loop,
            on_receive=self._on_migration_message,
            on_peer_lost=self._peer_lost,
            annotate=self.driver.annotate,
            connect_timeout=migration.handshake_timeout,
            connection_args=worker.connection_args,
        )

    @property
    def llumlet(self) -> Llumlet | None:
        return self.driver.llumlet

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._engine_thread.start()
        engine = await self._call(make_engine, self.config, self.instance_id, time.time)
        self.driver.attach(Llumlet(
            self.instance_id, engine, self.transport, self.config, time.time,
            on_tokens=self.driver.on_tokens, on_event=self.driver.on_event, deferred_copies=True,
        ))
        self.worker.handlers.update(
            {
                Op.ADD: self.add,
                Op.WHERE: self.where,
                Op.ABORT: self.abort,
                Op.MIGRATE_OUT: self.migrate_out,
                Op.WORKER_STATUS: self.status,
                Op.MIGRATION: self.transport.handle,
            }
        )
        self.worker.stream_handlers.update(
            {Op.MIGRATE_TO: self.migrate_to, Op.SET_TERMINATING: self.set_terminating, Op.PEER_LOST: self.peer_lost}
        )
        self._engine_thread.wake()
        self._registrar = asyncio.ensure_future(self._register())

    async def _leave(self, failures: int) -> None:
        """The engine is broken: the worker closes (its teardown unregisters the instance); under
        a nanny a fresh worker, and engine, takes its place."""
        if self.worker.status != Status.running:
            return
        logger.error("%s: %d engine steps in a row failed; the instance leaves the cluster", self.instance_id, failures)
        await self.worker.close(nanny=False, reason="llumdask-engine-broken")

    async def close(self) -> None:
        self._dask_timers.restore()
        if self._registrar is not None and not self._registrar.done():
            self._registrar.cancel()
            await asyncio.gather(self._registrar, return_exceptions=True)
        if self.registered and self.worker.status == Status.running:
            try:
                await asyncio.wait_for(call(self.worker.scheduler, Op.UNREGISTER, instance=self.instance_id), 5)
            except (OSError, asyncio.TimeoutError):
                logger.info("could not unregister %s from the scheduler", self.instance_id)
        self.registered = self.driver.reporting = False
        for name in (Op.ADD, Op.ABORT, Op.MIGRATE_OUT, Op.WORKER_STATUS, Op.MIGRATION):
            self.worker.handlers.pop(name, None)
        # Stream ops stay handled (ignored): the scheduler may still send some before it learns
        # that this llumlet is gone, and an op without a handler would disconnect the worker.
        for name in SCHEDULER_TO_WORKER:
            self.worker.stream_handlers[name] = _ignore
        await self.transport.close()
        if self.llumlet is not None:
            await self._call(close_engine, self.llumlet.engine)
        await self._call(self.pusher.close)
        await asyncio.get_running_loop().run_in_executor(None, self._engine_thread.stop)

    async def _register(self) -> None:
        """Register once this worker is known to the scheduler and the scheduler plugin answers."""
        engine = self._llumlet().engine
        delay = 0.05
        while self.worker.status != Status.running:
            await asyncio.sleep(delay)
        self._dask_timers.slow_down()  # the worker starts its timers just before it runs
        while True:
            try:
                answer = await call(
                    self.worker.scheduler, Op.REGISTER,
                    instance=self.instance_id, total_blocks=engine.total_blocks, block_size=engine.block_size,
                    high_priority_headroom=engine.high_priority_headroom,
                )
            except (OSError, NoLlumdaskScheduler) as exc:
                # Without the scheduler plugin (yet), load reports would get this worker
                # disconnected: wait for it.
                logger.info("registering %s failed: %s", self.instance_id, exc)
                answer = None
            if answer is not None and answer.registered:
                break
            delay = min(delay * 2, 2.0)
            await asyncio.sleep(delay)
        load = await self._call(self.driver.report_once)
        # From now on the engine thread reports every report-interval.
        self.registered = self.driver.reporting = True
        self._send_load(load)
        await call(self.worker.scheduler, Op.READY, instance=self.instance_id)

    # ------------------------------------------------------------------ engine thread
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the engine thread after everything submitted before it."""
        return await asyncio.wrap_future(self._engine_thread.submit(fn, *args))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire-and-forget on the engine thread; failures are logged."""
        self._engine_thread.submit(fn, *args).add_done_callback(self._log_failure)

    @staticmethod
    def _log_failure(future) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.error("llumlet call failed", exc_info=future.exception())

    def _llumlet(self) -> Llumlet:
        if self.llumlet is None:
            raise RuntimeError("the llumlet host has not started")
        return self.llumlet

    # ------------------------------------------------------------------ event-loop side
    def _send_load(self, load: dict) -> None:
        if self.registered:
            self.worker.batched_send({"op": Op.LOAD, "load": load})

    def _on_migration_message(self, sender: str, message: MigrationMessage, context: dict | None) -> None:
        self._submit(self.driver.deliver, sender, message, context)

    def _peer_lost(self, peer: str) -> None:
        self._submit(self._llumlet().peer_lost, peer)

    def _publish_event(self, event: MigrationEvent) -> None:
        msg = event_to_msg(event)
        self.events.append(msg)
        if event.kind is not MigrationEventKind.STARTED:
            self.transport.end_migration(event.destination, event.migration_id)
        if self.registered:
            self.worker.batched_send({"op": Op.EVENT, "event": msg})

    # ------------------------------------------------------------------ RPC handlers
    async def add(self, requests: list[dict], reply_to: str, resubmission: bool = False,
                  hand_over: str | None = None) -> dict:
        """Requests placed together (the choices of one completion) come in one call, so that the
        engine thread adds them between the same two steps and one step prefills them all.
        `hand_over`: the requester's id of this hand-over, named again by its abort should it give
        up on it (`LlumletDriver.add`)."""
        try:
            if hand_over is not None and not isinstance(hand_over, str):
                raise TypeError(f"hand_over must be a string, got {type(hand_over).__name__}")
            parsed = [request_from_msg(request) for request in requests]
        except (KeyError, TypeError, ValueError) as exc:
            # Received all the same, so that the scheduler stops counting them as on their way.
            await self._call(self.driver.received_unread, len(requests) if isinstance(requests, list) else 1)
            return refusal(RequestRejected(f"malformed request: {exc}"))
        try:
            await self._call(self.driver.add, parsed, reply_to, bool(resubmission), hand_over)
        except ValueError as exc:
            return refusal(RequestRejected(str(exc)))
        return reply(Accepted(True))

    async def abort(self, request_id: str, hand_over: str | None = None) -> dict:
        return reply(Aborted(await self._call(self.driver.abort, request_id,
                                              hand_over if isinstance(hand_over, str) else None)))

    async def where(self, request_ids: list[str]) -> dict:
        return reply(await self._call(self.driver.whereabouts, list(request_ids)))

    async def migrate_out(self, request_id: str, destination: str) -> dict:
        migration_id = await self._call(self._llumlet().migrate_out, destination, request_id)
        if migration_id is None:
            if await self._call(self._llumlet().pinned, request_id):
                return refusal(MigrationPinned(
                    f"{request_id!r} is pinned to {self.instance_id}: its sampling options cannot move exactly"))
            return refusal(MigrationNotStarted(
                f"{self.instance_id} did not start it: the request is not running here, cannot move exactly "
                "(pinned by its sampling options), is already migrating, or migrations are at their limit"))
        return reply(MigrationStarted(migration_id))

    async def status(self) -> dict:
        return await self._call(self._status)

    def _status(self) -> dict:
        """Engine-level facts for tests and operators: integrity, blocks, work in flight."""
        llumlet = self._llumlet()
        try:
            llumlet.check_integrity()
            integrity_error = None
        except AssertionError as exc:
            integrity_error = str(exc) or "integrity check failed"
        snap = llumlet.engine.snapshot()
        return {
            "instance": self.instance_id,
            "started_at": self.started_at,
            "registered": self.registered,
            "integrity_error": integrity_error,
            "total_blocks": snap.total_blocks,
            "free_blocks": snap.free_blocks,
            "reserved_blocks": snap.reserved_blocks,
            "num_running": len(snap.running),
            "num_waiting": len(snap.waiting),
            "has_work": llumlet.engine.has_work(),
            "migrations_in_flight": llumlet.migrations_in_flight(),
            "terminating": llumlet.terminating,
            "routes": len(self.driver.routes),
            "open_channels": self.transport.open_channels,
            "events": list(self.events),
        }

    # ------------------------------------------------------------------ stream handlers (from the scheduler)
    def migrate_to(self, destination: str, take_waiting: bool = False) -> None:
        self._submit(functools.partial(self._llumlet().migrate_out, destination, take_waiting=take_waiting))

    def set_terminating(self, flag: bool, order: int = 0) -> None:
        self._submit(self._llumlet().set_terminating, flag, order)

    def peer_lost(self, peer: str) -> None:
        self._peer_lost(peer)


class LlumletWorkerPlugin(WorkerPlugin):
    """Installs a `LlumletHost` on each worker. Idempotent: registering it again keeps the engine."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, config_overrides: dict | None = None) -> None:
        # Overrides travel pickled; the config is read on the worker, where dask.config applies.
        self._overrides = dict(config_overrides or {})
        self.host: LlumletHost | None = None
        # Why this worker hosts no instance. Dask logs a failed setup and keeps the worker
        # running, so whoever waits for the instance asks here (`startup_error`) to stop waiting.
        self.startup_error: str | None = None

    async def setup(self, worker) -> None:
        self.host = LlumletHost(worker, load_config(self._overrides))
        try:
            await self.host.start()
        except Exception as exc:
            self.startup_error = f"{type(exc).__name__}: {exc}"
            raise

    async def teardown(self, worker) -> None:
        if self.host is not None:
            await self.host.close()
            self.host = None


def startup_error(dask_worker) -> str | None:
    """For `Client.run`: why this worker's instance failed to start; None when it has not failed."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return plugin.startup_error if isinstance(plugin, LlumletWorkerPlugin) else None


async def dask_setup(worker) -> None:
    """`dask worker --preload llumdask.plugins.worker`: configured from dask.config."""
    await worker.plugin_add(LlumletWorkerPlugin(), name=PLUGIN_NAME, catch_errors=False)
