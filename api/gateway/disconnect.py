"""Stop work the moment the HTTP client goes away.

A request waiting in an instance's queue sends nothing for a while, so noticing a disconnect
only when the next write fails would leave it holding blocks. Instead the work runs beside a
watcher on the ASGI ``receive`` channel; ``http.disconnect`` cancels the work, whose cleanup
(`Generation.close`) aborts the request on whichever instance owns it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """The result of `work`, or ClientDisconnected (with `work` cancelled and its cleanup done)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let its cleanup (the abort) finish before answering, even if we are cancelled too.
            await asyncio.shield(asyncio.wait({task}))
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
