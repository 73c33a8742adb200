"""Server-sent events as OpenAI streams them: ``data: {json}`` events, then ``data: [DONE]``.

`EventStreamResponse` stops the event source as soon as the client disconnects (see
disconnect.py), whether the stream is writing or waiting for the next token, or once a write has
waited `write_timeout` seconds for a client that does not read (the server's buffers full: the
ASGI server holds `send` until they drain), and then always runs `on_close`, even if the source
never started (an unstarted generator runs no `finally`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from llumdask.api.gateway.disconnect import ClientDisconnected, until_disconnect

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    """ASCII-escaped JSON: a raw U+0085, U+2028 or U+2029 in generated text would split the event
    for clients that break lines the way `str.splitlines` does."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse:
    """An ASGI response streaming the encoded events of `events` (each a complete SSE event)."""

    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        # Proxies such as nginx would otherwise buffer the stream.
        (b"x-accel-buffering", b"no"),
    ]

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[bool], Awaitable[None]],
                 write_timeout: float | None = None) -> None:
        """`on_close(complete)`: complete is True when every event reached the client."""
        self._events = events
        self._on_close = on_close
        self._write_timeout = write_timeout
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        complete = False
        try:
            await until_disconnect(receive, self._pump(send))
            complete = True
        except TimeoutError:  # first: it is an OSError too
            # (The ASGI server then logs that the response did not complete, and closes the connection.)
            logger.warning("a client read none of its stream for %s s: its request is aborted", self._write_timeout)
        except (ClientDisconnected, OSError):
            pass  # nobody is listening
        finally:
            await self._on_close(complete)

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.headers})
            # One deadline, armed only while a write waits (not while the next token does): a
            # timer per event, where `wait_for` would add a task per event to the token path.
            async with asyncio.timeout(None) as deadline:
                async for chunk in self._events:
                    if self._write_timeout is not None:
                        deadline.reschedule(loop.time() + self._write_timeout)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(None)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._events.aclose()
