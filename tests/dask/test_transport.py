"""The Dask-comm transport between two real comm servers in one process."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from distributed.core import Server
from distributed.protocol import serialize
from tornado.ioloop import IOLoop

from llumdask.engine.base import PendingBlocks
from llumdask.plugins.control import Op
from llumdask.plugins.transport import CommTransport
from llumdask.protocol import Abort, Committed, PreAlloc, PreAllocReply, StageAck, StageData


class Peer:
    """A comm server with a transport, recording what it receives."""

    def __init__(self, **kwargs) -> None:
        self.received: list[tuple[str, object, object]] = []
        self.lost: list[str] = []
        self.transport = CommTransport(
            IOLoop.current(),
            on_receive=lambda s, m, c: self.received.append((s, m, c)),
            on_peer_lost=self.lost.append,
            **kwargs,
        )
        self.server = Server({Op.MIGRATION: self.transport.handle})

    async def start(self) -> "Peer":
        await self.server.listen("tcp://127.0.0.1:0")
        return self

    @property
    def address(self) -> str:
        return self.server.address

    async def close(self) -> None:
        await self.transport.close()
        await self.server.close()


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_stage_payload_is_an_out_of_band_frame():
    payload = np.arange(1 << 16, dtype=np.uint8)
    _, frames = serialize(StageData("m", 0, 0, 4, payload))
    assert any(np.shares_memory(np.frombuffer(f, dtype=np.uint8), payload) for f in frames)


def test_messages_of_each_migration_arrive_in_order_with_payloads_intact():
    async def main():
        a = await Peer(annotate=lambda m: {"reply_to": "tcp://x:1"} if isinstance(m, PreAlloc) else None).start()
        b = await Peer().start()
        rng = np.random.default_rng(0)
        sent = {}
        try:
            for mid in ("m1", "m2"):
                msgs = [PreAlloc(mid, a.address, b.address, "r-" + mid, 0, 4)]
                for stage in range(20):
                    buf = rng.integers(0, 255, size=(2, 16, 64), dtype=np.uint8)
                    msgs.append(StageData(mid, stage, 2 * stage, 2 * stage + 2, buf))
                msgs.append(Abort(mid, "done"))
                sent[mid] = msgs
            # Interleave the two migrations, and send from another thread as a llumlet host does.
            interleaved = [m for pair in zip(sent["m1"], sent["m2"]) for m in pair]
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: [a.transport.send(a.address, b.address, m) for m in interleaved])
            await until(lambda: len(b.received) == len(interleaved))
            for mid, msgs in sent.items():
                got = [(s, m, c) for s, m, c in b.received if m.migration_id == mid]
                assert all(s == a.address for s, _, _ in got)
                assert [type(m) for _, m, _ in got] == [type(m) for m in msgs]
                assert [getattr(m, "stage", None) for _, m, _ in got] == [getattr(m, "stage", None) for m in msgs]
                for (_, m, _), original in zip(got, msgs):
                    if isinstance(m, StageData):
                        np.testing.assert_array_equal(m.payload, original.payload)
                assert got[0][2] == {"reply_to": "tcp://x:1"} and got[1][2] is None
            # Abort ended both channels.
            await until(lambda: not a.transport.open_channels)
            assert a.lost == [] and b.lost == []
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_pending_stage_is_copied_on_the_copy_thread_in_order():
    """A deferred stage is fused on the transport's copy thread (not the sender's, not the event
    loop's) and arrives as the buffer, between the messages sent around it."""
    async def main():
        a = await Peer().start()
        b = await Peer().start()
        payload = np.arange(4096, dtype=np.uint8)
        copied_on: list[str] = []

        def copy() -> np.ndarray:
            copied_on.append(threading.current_thread().name)
            return payload

        try:
            sent = [PreAlloc("m", a.address, b.address, "r", 0, 1),
                    StageData("m", 0, 0, 1, PendingBlocks(payload.nbytes, copy)), Abort("m", "done")]
            for message in sent:
                a.transport.send(a.address, b.address, message)
            await until(lambda: len(b.received) == 3)
            assert [type(m) for _, m, _ in b.received] == [PreAlloc, StageData, Abort]
            np.testing.assert_array_equal(b.received[1][1].payload, payload)
            assert len(copied_on) == 1 and copied_on[0].startswith("llumdask-kv-copy")
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_replies_flow_back_on_their_own_channel():
    async def main():
        a = await Peer().start()
        b = await Peer().start()
        try:
            a.transport.send(a.address, b.address, PreAlloc("m", a.address, b.address, "r", 0, 1))
            await until(lambda: len(b.received) == 1)
            b.transport.send(b.address, a.address, PreAllocReply("m", 0, True))
            b.transport.send(b.address, a.address, StageAck("m", 0))
            b.transport.send(b.address, a.address, Committed("m", "r"))
            await until(lambda: len(a.received) == 3)
            assert [type(m) for _, m, _ in a.received] == [PreAllocReply, StageAck, Committed]
            a.transport.end_migration(b.address, "m")
            await until(lambda: not a.transport.open_channels and not b.transport.open_channels)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_unreachable_peer_is_reported_lost():
    async def main():
        a = await Peer(connect_timeout=1).start()
        b = await Peer().start()
        dead = b.address
        await b.close()
        try:
            a.transport.send(a.address, dead, PreAlloc("m", a.address, dead, "r", 0, 1))
            await until(lambda: a.lost == [dead])
        finally:
            await a.close()

    asyncio.run(main())
