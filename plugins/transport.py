"""The core's `Transport` over Dask comms, between the workers that host llumlets.

Instance ids are worker addresses, so a receiver id is where to connect. Each migration gets its
own comm in each direction (keyed by receiver and migration id): the receiving worker's server
handles the messages of one comm one after another, so the stages of a migration stay in order
while migrations between the same pair of workers do not wait on each other. A message travels
as `to_serialize(message)`: pickle protocol 5 carries the fused block buffer of a `StageData` as
its own out-of-band frame, written from and read into numpy memory without a copy.

Wire format (one comm message, `reply=False`):
    {"op": "llumnix_migration", "sender": str, "message": <MigrationMessage>,
     "context": dict | None}
`context` is what the sending host attaches to a `PreAlloc` (where the request's tokens go), so
that the destination can stream them once the migration commits.

`send` may be called from any thread (the llumlet runs on its engine thread): it hands the
message to the event loop. A peer that cannot be reached or whose comm breaks is reported once
per failed channel through `on_peer_lost`.

A `StageData` whose payload is `PendingBlocks` (a llumlet with `deferred_copies`) is copied on
this transport's own copy thread right before it is written, so that fusing a stage of hundreds
of MiB never holds up the engine thread's steps: the source's requests, the migrating one
included, keep decoding while their KV is copied out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from distributed.comm import Comm, connect
from distributed.protocol import to_serialize
from tornado.ioloop import IOLoop

from llumdask.engine.base import PendingBlocks
from llumdask.plugins.control import Op
from llumdask.protocol import Abort, Committed, MigrationMessage, PreAllocReply, StageData

logger = logging.getLogger(__name__)


Receive = Callable[[str, MigrationMessage, "Mapping[str, Any] | None"], None]


def _ends_channel(message: MigrationMessage) -> bool:
    """Messages after which the sender says nothing more about this migration."""
    return isinstance(message, (Committed, Abort)) or (isinstance(message, PreAllocReply) and not message.accepted)


class CommTransport:
    """`llumdask.transport.Transport` over one dedicated Dask comm per migration and direction."""

    def __init__(
        self,
        loop: IOLoop,
        on_receive: Receive,
        on_peer_lost: Callable[[str], None],
        annotate: Callable[[MigrationMessage], Mapping[str, Any] | None] | None = None,
        connect_timeout: float | None = None,
        idle_timeout: float = 60.0,
        connection_args: Mapping[str, Any] | None = None,
    ) -> None:
        """`connection_args`: the worker's (its TLS context where the cluster has Dask security)."""
        self._loop = loop
        self._connection_args = dict(connection_args or {})
        self._on_receive = on_receive
        self._on_peer_lost = on_peer_lost
        self._annotate = annotate
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._channels: dict[tuple[str, str], asyncio.Queue] = {}
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="llumdask-kv-copy")
        self._writers: set[asyncio.Task] = set()
        self._closed = False
        self.messages_sent = 0
        self.bytes_sent = 0

    # ------------------------------------------------------------------ sending (any thread)
    def send(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        context = self._annotate(message) if self._annotate is not None else None
        wire = {"op": Op.MIGRATION, "sender": sender, "message": message,
                "context": dict(context) if context else None, "reply": False}
        self._loop.add_callback(self._enqueue, receiver, message, wire)

    def end_migration(self, receiver: str, migration_id: str) -> None:
        """Close the channel of a finished migration once what it holds is written (any thread)."""
        self._loop.add_callback(self._enqueue_end, (receiver, migration_id))

    def _enqueue(self, receiver: str, message: MigrationMessage, wire: dict) -> None:
        if self._closed:
            return
        key = (receiver, message.migration_id)
        queue = self._channels.get(key)
        if queue is None:
            queue = asyncio.Queue()
            self._channels[key] = queue
            task = asyncio.ensure_future(self._write_loop(key, queue))
            self._writers.add(task)
            task.add_done_callback(self._writers.discard)
        queue.put_nowait(wire)
        if _ends_channel(message):
            self._end(key, queue)

    def _enqueue_end(self, key: tuple[str, str]) -> None:
        queue = self._channels.get(key)
        if queue is not None:
            self._end(key, queue)

    def _end(self, key: tuple[str, str], queue: asyncio.Queue) -> None:
        queue.put_nowait(None)
        # Later messages of this migration (there should be none) would open a fresh channel.
        if self._channels.get(key) is queue:
            del self._channels[key]

    async def _write_loop(self, key: tuple[str, str], queue: asyncio.Queue) -> None:
        receiver = key[0]
        comm: Comm | None = None
        try:
            comm = await connect(receiver, timeout=self._connect_timeout, **self._connection_args)
            while True:
                try:
                    wire = await asyncio.wait_for(queue.get(), self._idle_timeout)
                except asyncio.TimeoutError:
                    break
                if wire is None:
                    break
                message = await self._copied(wire["message"])
                nbytes = await comm.write({**wire, "message": to_serialize(message)})
                self.messages_sent += 1
                self.bytes_sent += nbytes
        except (OSError, asyncio.TimeoutError) as exc:  # CommClosedError is an OSError
            logger.info("migration channel %s to %s failed: %s", key[1], receiver, exc)
            if not self._closed:
                self._on_peer_lost(receiver)
        finally:
            if self._channels.get(key) is queue:
                del self._channels[key]
            if comm is not None and not comm.closed():
                await comm.close()

    async def _copied(self, message: MigrationMessage) -> MigrationMessage:
        """The message with a pending stage copied (on the copy thread)."""
        if not (isinstance(message, StageData) and isinstance(message.payload, PendingBlocks)):
            return message
        payload = await asyncio.get_running_loop().run_in_executor(self._copier, message.payload.copy)
        return dataclasses.replace(message, payload=payload)

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    # ------------------------------------------------------------------ receiving (event loop)
    def handle(self, sender: str, message: MigrationMessage, context: Mapping[str, Any] | None = None) -> None:
        """Server handler for `Op.MIGRATION`; install it in the worker's `handlers`."""
        self._on_receive(sender, message, context)

    # ------------------------------------------------------------------ lifecycle
    async def close(self, timeout: float = 5.0) -> None:
        """Flush open channels (up to `timeout`), then stop."""
        for key, queue in list(self._channels.items()):
            self._end(key, queue)
        if self._writers:
            await asyncio.wait(list(self._writers), timeout=timeout)
        self._closed = True
        for task in list(self._writers):
            task.cancel()
        self._copier.shutdown(wait=False, cancel_futures=True)
