"""Token streams: the owning instance pushes batches straight to the requester's listener.

Tokens never pass through the scheduler, nor through Dask Events or Queues (an RPC per item, or
dropped early messages), nor through the worker's event loop: the owner's engine thread writes
them on one TCP connection per requester (`TokenPusher`), and the requester runs a small asyncio
server (`TokenListener`). The owner changes when a migration commits, so the last tokens of the
source and the first of the destination may arrive interleaved or twice: `TokenSequence` puts
them back in order by sequence number and drops duplicates. The owner is whoever sent the
furthest tokens; a destination also claims the request at its commit with a message carrying no
tokens, so that the requester watches the new owner before its first token. `TokenSequence` is pure (no I/O);
`TokenStream` adds waiting on an asyncio loop.

Authentication: a listener has a random key, and its address (the "route" a request carries to
its instance and on through migrations) is `tcp://host:port#key`. A connection's first frame must
be a hello with that key, or the listener closes it before it reads anything else: whoever cannot
see the route (it travels in Dask's comms, under the cluster's security) cannot write into a
stream. Keys never appear in logs (`without_key`). Where the cluster has Dask security (TLS), the
channel uses the same credentials: the listener serves TLS with the client's certificate
(`tls://` routes) and requires the pusher's worker certificate, both checked against the
cluster's CA.

Wire format: frames, each a 4-byte big-endian length and then a msgpack list of messages; the
first frame of a connection is [{"op": "llumnix_tokens_hello", "key": str, "instance": str}],
every later one a list of token messages:
    {"op": "llumnix_tokens", "request_id": str, "first_index": int, "token_ids": [int, ...],
     "finished": bool, "finish_reason": "length" | "stop" | "abort" | None, "instance": str,
     "logprobs": [[logprob, [[token id, logprob], ...], rank | null], ...] (one per token; only if asked for),
     "prompt_logprobs": [null | [logprob, [[token id, logprob], ...], rank | null], ...] (first batch only),
     "cached_tokens": int (first batch only, where the engine reports its prefix cache hits)}
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import select
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any
from dataclasses import dataclass

import msgpack
from distributed.comm.addressing import get_address_host_port

from llumdask.engine.base import TokenLogprob, TokenOutput
from llumdask.plugins.control import Op
from llumdask.request import FinishReason

logger = logging.getLogger(__name__)

_FRAME_HEADER = struct.Struct("!I")
# A listener refuses bigger frames (a hand-off carries a few tokens per request).
MAX_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class TokenBatch:
    """One token message: a TokenOutput plus the instance that produced it (the current owner)."""

    request_id: str
    first_index: int
    token_ids: tuple[int, ...]
    instance: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int | None = None

    @classmethod
    def from_output(cls, output: TokenOutput, instance: str) -> "TokenBatch":
        return cls(output.request_id, output.first_index, tuple(output.token_ids), instance,
                   output.finished, output.finish_reason, output.logprobs, output.prompt_logprobs,
                   output.cached_tokens)

    def to_msg(self) -> dict:
        msg = {
            "op": Op.TOKENS,
            "request_id": self.request_id,
            "first_index": self.first_index,
            "token_ids": list(self.token_ids),
            "finished": self.finished,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "instance": self.instance,
        }
        if self.logprobs is not None:
            msg["logprobs"] = list(self.logprobs)
        if self.prompt_logprobs is not None:
            msg["prompt_logprobs"] = list(self.prompt_logprobs)
        if self.cached_tokens is not None:
            msg["cached_tokens"] = self.cached_tokens
        return msg

    @classmethod
    def from_msg(cls, msg: Mapping) -> "TokenBatch":
        reason = msg.get("finish_reason")
        token_ids = tuple(int(t) for t in msg["token_ids"])
        logprobs = msg.get("logprobs")
        if logprobs is not None:
            logprobs = tuple(_token_logprob(entry) for entry in logprobs)
            if len(logprobs) != len(token_ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        prompt = msg.get("prompt_logprobs")
        cached = msg.get("cached_tokens")
        return cls(
            request_id=msg["request_id"],
            first_index=int(msg["first_index"]),
            token_ids=token_ids,
            instance=msg["instance"],
            finished=bool(msg["finished"]),
            finish_reason=None if reason is None else FinishReason(reason),
            logprobs=logprobs,
            prompt_logprobs=None if prompt is None else tuple(None if e is None else _token_logprob(e) for e in prompt),
            cached_tokens=None if cached is None else int(cached),
        )


def _token_logprob(entry: Iterable) -> TokenLogprob:
    logprob, top, *rest = entry  # a rank-less entry (a worker of an older release) is read too
    rank = rest[0] if rest else None
    return TokenLogprob(float(logprob), tuple((int(t), float(lp)) for t, lp in top), None if rank is None else int(rank))


class TokenOutbox:
    """Tokens on their way from the engine thread to their requesters, held up to `interval` s.

    Every hand-off is a send that wakes the requester (and its client); with engine steps of a
    few milliseconds those wake-ups, not the tokens, are what streaming costs. So the tokens of
    several steps may go in one hand-off, but a request's first token and its end never wait
    (time to first token and completion are not delayed). Not thread-safe: the engine thread
    adds and takes.
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        self._interval = interval
        self._clock = clock
        self._held: list[tuple[str, TokenOutput]] = []
        self._urgent = False
        self._last = float("-inf")

    def add(self, reply_to: str, output: TokenOutput) -> None:
        self._held.append((reply_to, output))
        if output.finished or output.first_index == 0:
            self._urgent = True

    def take(self, force: bool = False) -> list[tuple[str, TokenOutput]]:
        """What is due now (everything held, or nothing): when forced, urgent, or the interval
        has passed since the last hand-off."""
        if not self._held:
            return []
        now = self._clock()
        if not (force or self._urgent or now - self._last >= self._interval):
            return []
        held, self._held, self._urgent = self._held, [], False
        self._last = now
        return held


class TokenSequence:
    """Reassembles one request's output from batches that may arrive out of order or twice.

    `add` returns the tokens that became deliverable (contiguous from the last delivered one).
    A duplicate index is dropped; if it carries a different token it is counted in `conflicts`
    (greedy and seeded sampling make both owners agree, so a conflict is a bug worth seeing).
    The sequence is done once a finished batch fixed the length and every token up to it arrived.
    Log probabilities, when the request asked for them, travel and are kept beside their tokens
    (`logprobs`), the prompt's with the first batch (`prompt_logprobs`), and so do the prompt's
    tokens found in the first instance's prefix cache (`cached_tokens`).
    """

    def __init__(self, start_index: int = 0) -> None:
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        self._start = start_index
        self._next = start_index
        self._pending: dict[int, int] = {}
        self._delivered: list[int] = []
        self._pending_logprobs: dict[int, TokenLogprob] = {}
        self._delivered_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.cached_tokens: int | None = None
        self._length: int | None = None
        self.finish_reason: FinishReason | None = None
        self.conflicts = 0
        # The instance that sent the furthest tokens: a migration's source may send its last ones
        # (held up to a stream interval) after the destination's first, and must not win back.
        self.owner: str | None = None
        self._furthest = start_index

    @property
    def next_index(self) -> int:
        """Sequence number of the next token to deliver (= tokens delivered so far, plus the start)."""
        return self._next

    @property
    def delivered(self) -> list[int]:
        return list(self._delivered)

    @property
    def done(self) -> bool:
        return self._length is not None and self._next >= self._length

    def logprobs(self, start: int, end: int) -> list[TokenLogprob]:
        """The log probabilities of delivered tokens [start, end) (by sequence number)."""
        return self._delivered_logprobs[start - self._start : end - self._start]

    def add(self, batch: TokenBatch) -> list[int]:
        if batch.first_index < 0:
            raise ValueError(f"request {batch.request_id}: negative first_index {batch.first_index}")
        end = batch.first_index + len(batch.token_ids)
        # A batch without tokens is an owner's claim (a migration's destination at its commit):
        # it wins from where the tokens are.
        if end > self._furthest or batch.finished or (not batch.token_ids and end >= self._furthest):
            self.owner = batch.instance
            self._furthest = max(self._furthest, end)
        for offset, token in enumerate(batch.token_ids):
            self._accept(batch.first_index + offset, token)
        if batch.logprobs is not None:
            for offset, logprob in enumerate(batch.logprobs):
                if batch.first_index + offset >= self._next:
                    self._pending_logprobs.setdefault(batch.first_index + offset, logprob)
        if batch.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = batch.prompt_logprobs
        if batch.cached_tokens is not None and self.cached_tokens is None:
            self.cached_tokens = batch.cached_tokens
        if batch.finished and self._length is None:
            self._length = end
            self.finish_reason = batch.finish_reason
        return self._drain()

    def _accept(self, index: int, token: int) -> None:
        if index < self._next:
            known = self._delivered[index - self._start] if index >= self._start else token
        else:
            known = self._pending.setdefault(index, token)
        if known != token:
            self.conflicts += 1

    def _drain(self) -> list[int]:
        new: list[int] = []
        while self._next in self._pending:
            new.append(self._pending.pop(self._next))
            logprob = self._pending_logprobs.pop(self._next, None)
            if logprob is not None:
                self._delivered_logprobs.append(logprob)
            self._next += 1
        self._delivered.extend(new)
        return new


class TokenStream:
    """Async view of one request's tokens; lives on the listener's event loop."""

    def __init__(self, request_id: str, start_index: int = 0) -> None:
        self.request_id = request_id
        self.sequence = TokenSequence(start_index)
        self._ready: list[int] = []
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    def push(self, batch: TokenBatch) -> None:
        new = self.sequence.add(batch)
        if new or self.sequence.done:
            self._ready.extend(new)
            self._changed.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error (request refused, requester closing)."""
        self._error = error
        self._changed.set()

    @property
    def done(self) -> bool:
        return self.sequence.done and not self._ready

    async def next_tokens(self) -> list[int]:
        """Wait for the next contiguous run of tokens; [] once the request has finished."""
        while not self._ready:
            if self._error is not None:
                raise self._error
            if self.sequence.done:
                return []
            self._changed.clear()
            await self._changed.wait()
        ready, self._ready = self._ready, []
        return ready

    async def __aiter__(self) -> AsyncIterator[int]:
        while tokens := await self.next_tokens():
            for token in tokens:
                yield token


def split_route(route: str) -> tuple[str, str]:
    """A listener's route -> (its address, its key); no key: ''."""
    address, _, key = route.partition("#")
    return address, key


def without_key(route: str) -> str:
    """A route as logs may show it."""
    return split_route(route)[0]


class TokenListener:
    """The requester's end: a TCP server that routes token frames to open streams.

    Must be started and used on one event loop. `on_sender_closed(instance)` is called when an
    owner's connection closes, so that the requester can notice a dead instance. Connections that
    do not open with this listener's key are closed unread and counted in `refused`.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:0",
                 on_sender_closed: Callable[[str], None] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: serve TLS with it (a Dask client's listen context); the route is then tls://."""
        self._bind = split_route(address)[0]
        self._ssl = ssl_context
        self._key = secrets.token_urlsafe(24)
        self._server: asyncio.Server | None = None
        self._address: str | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._streams: dict[str, TokenStream] = {}
        self._on_sender_closed = on_sender_closed
        self.dropped = 0
        self.refused = 0

    async def start(self) -> "TokenListener":
        host, port = get_address_host_port(self._bind)
        self._server = await asyncio.start_server(self._handle_connection, host, port, ssl=self._ssl)
        bound_port = self._server.sockets[0].getsockname()[1]
        scheme = "tls" if self._ssl is not None else "tcp"
        self._address = f"{scheme}://[{host}]:{bound_port}" if ":" in host else f"{scheme}://{host}:{bound_port}"
        return self

    @property
    def address(self) -> str:
        """The route to this listener: where tokens go and the key that lets a sender in."""
        if self._address is None:
            raise RuntimeError("the token listener is not started")
        return f"{self._address}#{self._key}"

    def open(self, request_id: str, start_index: int = 0) -> TokenStream:
        if request_id in self._streams:
            raise ValueError(f"request {request_id} already has an open token stream")
        stream = TokenStream(request_id, start_index)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def streams(self) -> dict[str, TokenStream]:
        return dict(self._streams)

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        sender: str | None = None
        try:
            if not self._admits(await _read_frame(reader, limit=1024)):
                self.refused += 1
                logger.warning("token listener refused a connection from %s without its key",
                               writer.get_extra_info("peername"))
                return
            while True:
                for msg in await _read_frame(reader, limit=MAX_FRAME_BYTES):
                    if not isinstance(msg, dict) or msg.get("op") != Op.TOKENS:
                        logger.warning("token listener dropped an unexpected message: %r", msg)
                        continue
                    batch = TokenBatch.from_msg(msg)
                    sender = batch.instance
                    self._route(batch)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the owner closed its end (or died)
        except asyncio.CancelledError:
            # Cancelled with its loop (a client's process exiting without close()): end as a closed
            # connection does. Nobody awaits this task, and Python 3.11's start_server prints a
            # traceback for a handler that ends cancelled.
            pass
        except (ValueError, TypeError, KeyError) as exc:  # msgpack's unpack errors are ValueErrors
            logger.warning("token listener closed a connection that sent a bad frame: %s", exc)
        finally:
            self._connections.discard(writer)
            writer.close()
            if sender is not None and self._on_sender_closed is not None:
                self._on_sender_closed(sender)

    def _admits(self, hello: Any) -> bool:
        """Whether a connection's first frame is a hello with this listener's key."""
        if not (isinstance(hello, list) and len(hello) == 1 and isinstance(hello[0], dict)):
            return False
        key = hello[0].get("key")
        return hello[0].get("op") == Op.TOKENS_HELLO and isinstance(key, str) and hmac.compare_digest(
            key.encode(), self._key.encode())

    def _route(self, batch: TokenBatch) -> None:
        stream = self._streams.get(batch.request_id)
        if stream is None:
            self.dropped += 1
            return
        stream.push(batch)

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.fail(RuntimeError("token listener closed"))
        self._streams.clear()
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
            self._server = None


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """One frame, unpacked; a length over `limit` is a ValueError before anything more is read."""
    (size,) = _FRAME_HEADER.unpack(await reader.readexactly(_FRAME_HEADER.size))
    if size > limit:
        raise ValueError(f"a token frame of {size} bytes (limit {limit})")
    return msgpack.unpackb(await reader.readexactly(size))


class TokenPusher:
    """The owner's end, used on the engine thread: one blocking TCP connection per requester.

    The engine thread sends the tokens itself: a hand-off to the worker's event loop woke the
    loop, which then held the GIL the engine needed (a diagnosis with py-spy and /proc counters,
    tiny model, 32 streams: the wake-up alone was 5% of the engine thread's samples, and the
    loop's sends with Dask's BatchedSend another tenth of the process's CPU). A send is one frame per requester per hand-off; the kernel's socket
    buffer absorbs a requester that reads late. A requester that cannot be reached (no
    connection within `connect_timeout`, or a send not done within `send_timeout`, i.e. it
    stopped reading) is reported with `on_unreachable(address)` and its connection dropped; a
    later push tries to connect again. A requester that closed is forgotten before the next push
    (one poll over every connection: requesters never write, so readable means closed), because a
    new requester may listen at its address: a frame sent on the old connection would vanish and
    the next send fail as if the new requester were unreachable, aborting its requests. Not
    thread-safe: one thread pushes and closes.
    """

    def __init__(self, instance: str, on_unreachable: Callable[[str], None] | None = None,
                 connect_timeout: float = 5.0, send_timeout: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: for tls:// routes (a Dask worker's connection context)."""
        self.instance = instance
        self._ssl = ssl_context
        self._on_unreachable = on_unreachable
        self._connect_timeout = connect_timeout
        self._send_timeout = send_timeout
        self._sockets: dict[str, socket.socket] = {}
        self._closed = select.poll()  # every connection, for POLLIN (its requester closed it)
        self._addresses: dict[int, str] = {}  # connection fd -> requester address

    def push(self, outbox: Iterable[tuple[str, TokenOutput]]) -> None:
        """Send token outputs, each to its requester's route, one frame per requester."""
        for fd, _ in self._closed.poll(0):
            address = self._addresses[fd]
            if _peer_closed(self._sockets[address], self._send_timeout):
                self._drop(address)
        by_requester: dict[str, list[dict]] = {}
        for reply_to, output in outbox:
            by_requester.setdefault(reply_to, []).append(TokenBatch.from_output(output, self.instance).to_msg())
        for address, msgs in by_requester.items():
            self._send(address, encode_frame(msgs))

    def _send(self, address: str, frame: bytes) -> None:
        """`address`: a listener's route (its address and key)."""
        try:
            sock = self._sockets.get(address)
            if sock is None:
                where, key = split_route(address)
                sock = socket.create_connection(get_address_host_port(where), timeout=self._connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame is a message
                if where.startswith("tls://"):
                    if self._ssl is None:
                        raise ValueError("a tls:// requester, and this instance has no TLS context")
                    sock = self._ssl.wrap_socket(sock)
                sock.settimeout(self._send_timeout)
                self._sockets[address] = sock
                self._addresses[sock.fileno()] = address
                self._closed.register(sock, select.POLLIN)
                sock.sendall(encode_frame([{"op": Op.TOKENS_HELLO, "key": key, "instance": self.instance}]))
            sock.sendall(frame)
        except (OSError, ValueError) as exc:  # socket.timeout is an OSError; ValueError: a bad address
            logger.warning("requester %s is unreachable: %s", without_key(address), exc)
            self._drop(address)
            if self._on_unreachable is not None:
                self._on_unreachable(address)

    def _drop(self, address: str) -> None:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            self._closed.unregister(sock)
            del self._addresses[sock.fileno()]
            sock.close()

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)


def _peer_closed(sock: socket.socket, timeout: float) -> bool:
    """A pusher's connection polled readable: requesters never write, so a plain socket is closed;
    a TLS one may also have received a TLS record (a TLS 1.3 session ticket), which reads as nothing."""
    if not isinstance(sock, ssl.SSLSocket):
        return True
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except ssl.SSLWantReadError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def encode_frame(msgs: list[dict]) -> bytes:
    """A token frame: its length (4 bytes, big-endian), then a msgpack list of token messages."""
    payload = msgpack.packb(msgs)
    return _FRAME_HEADER.pack(len(payload)) + payload
