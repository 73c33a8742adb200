"""KV transfer throughput between two processes: llumdask's Dask-comm transport vs a raw TCP socket.

The llumdask side is the real migration path: `plugins.transport.CommTransport` on both ends,
a `StageData` carrying the payload as a pickle-5 out-of-band frame, answered by a `StageAck`
on the receiver's own channel. Each transfer is one migration: a PreAlloc round trip opens the
channels (not timed), then the clock runs from sending the StageData to receiving its StageAck.
The baseline is a plain blocking socket: an 8-byte length, `sendall` of the same numpy buffer,
`recv_into` a fresh numpy buffer of that size, a one-byte ack. Both receivers allocate a new
buffer per message; both ends set TCP_NODELAY. The two are interleaved per repetition.

    python -m llumdask.benchmarks.transfer --out DIR [--sizes-mib 1,4,16,64,256] [--repeats 5]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from distributed.core import Server
from tornado.ioloop import IOLoop

from llumdask.benchmarks.common import int_list, parser, ratio, report, summarize
from llumdask.plugins.control import Op
from llumdask.plugins.transport import CommTransport
from llumdask.protocol import Abort, MigrationMessage, PreAlloc, PreAllocReply, StageAck, StageData

MIB = 1 << 20
_HEADER = struct.Struct("!Q")

COLUMNS = (
    ("size_mib", "MiB", "{}"),
    ("dask_mb_s", "dask MB/s", "{:.0f}"),
    ("raw_mb_s", "raw MB/s", "{:.0f}"),
    ("dask_over_raw", "dask/raw", "{:.2f}"),
    ("dask_ms_p50", "dask ms p50", "{:.1f}"),
    ("raw_ms_p50", "raw ms p50", "{:.1f}"),
    ("repeats", "repeats", "{}"),
)


# ---------------------------------------------------------------------------- receiver process
def _receiver_main(conn: Connection) -> None:
    asyncio.run(_receive(conn))


async def _receive(conn: Connection) -> None:
    """Answer PreAlloc and StageData like a destination llumlet would, and serve the raw socket."""
    loop = asyncio.get_running_loop()
    transport: CommTransport

    def on_receive(sender: str, message: MigrationMessage, context: Any) -> None:
        me = server.address
        if isinstance(message, PreAlloc):
            transport.send(me, sender, PreAllocReply(message.migration_id, message.stage, True))
        elif isinstance(message, StageData):
            expected = message.end_block - message.start_block
            if message.payload.nbytes != expected:
                raise AssertionError(f"stage of {message.payload.nbytes} bytes, expected {expected}")
            transport.send(me, sender, StageAck(message.migration_id, message.stage))
            transport.end_migration(sender, message.migration_id)

    transport = CommTransport(IOLoop.current(), on_receive, on_peer_lost=lambda peer: None)
    server = Server({Op.MIGRATION: transport.handle})
    await server.listen("tcp://127.0.0.1:0")
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_raw, args=(raw,), daemon=True).start()
    conn.send((server.address, raw.getsockname()[1]))
    await loop.run_in_executor(None, conn.recv)  # until told to stop
    await transport.close()
    await server.close()


def _serve_raw(listener: socket.socket) -> None:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(_HEADER.size)
    while _recv_exactly(sock, memoryview(header)):
        (size,) = _HEADER.unpack(header)
        buffer = np.empty(size, dtype=np.uint8)
        if not _recv_exactly(sock, memoryview(buffer)):
            return
        sock.sendall(b"\x01")


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


# ---------------------------------------------------------------------------- sender (this process)
class DaskSender:
    """A source-side transport plus a server for the replies, awaiting them by migration id."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._waiting: dict[str, asyncio.Future] = {}
        self.transport = CommTransport(IOLoop.current(), self._on_receive, on_peer_lost=self._lost)
        self.server = Server({Op.MIGRATION: self.transport.handle})
        self._numbers = 0

    async def start(self) -> "DaskSender":
        await self.server.listen("tcp://127.0.0.1:0")
        return self

    def _on_receive(self, sender: str, message: MigrationMessage, context: Any) -> None:
        future = self._waiting.pop(message.migration_id, None)
        if future is not None and not future.done():
            future.set_result(message)

    def _lost(self, peer: str) -> None:
        for future in self._waiting.values():
            future.set_exception(ConnectionError(f"lost {peer}"))

    async def _exchange(self, message: MigrationMessage) -> MigrationMessage:
        future = asyncio.get_running_loop().create_future()
        self._waiting[message.migration_id] = future
        self.transport.send(self.server.address, self.peer, message)
        return await asyncio.wait_for(future, 120)

    async def transfer(self, payload: np.ndarray) -> float:
        """Seconds from sending one StageData of `payload` to its StageAck."""
        self._numbers += 1
        mid = f"bench-{self._numbers}"
        me = self.server.address
        reply = await self._exchange(PreAlloc(mid, me, self.peer, "request", 0, payload.nbytes))
        assert isinstance(reply, PreAllocReply) and reply.accepted
        start = time.perf_counter()
        ack = await self._exchange(StageData(mid, 0, 0, payload.nbytes, payload))
        elapsed = time.perf_counter() - start
        assert isinstance(ack, StageAck)
        self.transport.send(me, self.peer, Abort(mid, "done"))  # closes this migration's channel
        return elapsed

    async def close(self) -> None:
        await self.transport.close()
        await self.server.close()


def raw_transfer(sock: socket.socket, payload: np.ndarray) -> float:
    start = time.perf_counter()
    sock.sendall(_HEADER.pack(payload.nbytes))
    sock.sendall(memoryview(payload))
    if sock.recv(1) != b"\x01":
        raise ConnectionError("raw receiver closed")
    return time.perf_counter() - start


async def measure(sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child,), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    try:
        dask_address, raw_port = await loop.run_in_executor(None, parent.recv)
        sender = await DaskSender(dask_address).start()
        sock = socket.create_connection(("127.0.0.1", raw_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Random bytes: like fp16 KV, nothing for a compressor to gain.
        data = np.random.default_rng(0).integers(0, 256, max(sizes_mib) * MIB, dtype=np.uint8)
        rows = []
        for size in sizes_mib:
            payload = data[: size * MIB]
            await sender.transfer(payload)  # warm-up: first-use allocations on both sides
            await loop.run_in_executor(None, raw_transfer, sock, payload)
            dask_s, raw_s = [], []
            for _ in range(repeats):
                dask_s.append(await sender.transfer(payload))
                raw_s.append(await loop.run_in_executor(None, raw_transfer, sock, payload))
            rows.append(_row(size, dask_s, raw_s))
            print(f"  {size} MiB: dask {rows[-1]['dask_mb_s']:.0f} MB/s, raw {rows[-1]['raw_mb_s']:.0f} MB/s",
                  flush=True)
        sock.close()
        await sender.close()
    finally:
        parent.send("stop")
        await loop.run_in_executor(None, proc.join, 30)
        if proc.is_alive():
            proc.terminate()
    return rows


def _row(size_mib: int, dask_s: list[float], raw_s: list[float]) -> dict[str, Any]:
    nbytes = size_mib * MIB

    def mb_s(seconds: list[float]) -> float:
        return nbytes / float(np.median(seconds)) / 1e6

    dask, raw = summarize(dask_s, 1e3), summarize(raw_s, 1e3)
    return {"size_mib": size_mib, "dask_mb_s": mb_s(dask_s), "raw_mb_s": mb_s(raw_s),
            "dask_over_raw": ratio(mb_s(dask_s), mb_s(raw_s)), "dask_ms_p50": dask["p50"],
            "raw_ms_p50": raw["p50"], "dask_ms": dask, "raw_ms": raw, "repeats": len(dask_s)}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int_list, default=int_list("1,4,16,64,256"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sizes, repeats = (args.sizes_mib[:2], 2) if args.quick else (args.sizes_mib, args.repeats)
    rows = asyncio.run(measure(sizes, repeats))
    report("transfer", args.out, rows, COLUMNS,
           {"path": "CommTransport StageData->StageAck vs raw socket", "repeats": repeats},
           ["MB/s from the median time of a transfer (payload sent until its ack arrived), 1 MB = 1e6 B."])
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
