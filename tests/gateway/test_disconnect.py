"""A client that leaves aborts its request at once: while streaming, and while waiting for a whole answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from gatewayfakes import MODEL
from waiting import wait_until

from llumdask.api.gateway import create_app
from llumdask.api.gateway.disconnect import ClientDisconnected, until_disconnect
from llumdask.engine.base import TokenLogprob


def test_stream_closed_by_the_client_aborts_the_request(make_client, backend):
    backend.stall_after = 1  # the test client buffers nothing: the server writes as we read
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 20}
    with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert backend.stalled.wait(10)
        assert backend.aborted == []
    wait_until(lambda: backend.aborted == [backend.submitted[0].request_id])
    text = client.get("/metrics").text
    assert 'llumdask_gateway_errors_total{code="client_disconnected"} 1.0' in text
    assert "llumdask_gateway_requests_in_flight 0.0" in text


def leave_when(app, body: dict, left: Callable[[], bool]) -> list[dict]:
    """Raw ASGI: a client sends `body` to /v1/completions, then disconnects once `left()` holds;
    the messages the app sent."""
    sent: list[dict] = []

    async def scenario() -> None:
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            while not left():
                await asyncio.sleep(0.001)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        async with app.router.lifespan_context(app) as state:
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": dict(state)}
            await asyncio.wait_for(app(scope, receive, send), 10)

    asyncio.run(scenario())
    return sent


def test_non_streaming_request_is_aborted_when_the_client_leaves(backend, tokenizer):
    """The client sends its body, then disconnects while the answer is being generated."""
    backend.stall_after = 1
    sent = leave_when(create_app(backend.open, tokenizer), {"model": MODEL, "prompt": "Hi", "max_tokens": 20},
                      backend.stalled.is_set)
    assert backend.aborted == [backend.submitted[0].request_id]
    assert sent[0]["status"] == 499  # nobody reads it; the point is that nothing hangs


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_while_its_request_waits_for_room_gives_up_its_place(backend, tokenizer, stream):
    """Past capacity a request may wait long before an instance takes it (held at the scheduler):
    a client gone meanwhile is answered at once, and the backend's placement is cancelled (the
    Dask backend withdraws it, or aborts it where it was being handed over)."""
    backend.submit_delay = lambda prompt: 60.0
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 20, "stream": stream}
    sent = leave_when(create_app(backend.open, tokenizer), body, lambda: bool(backend.submitted))
    assert backend.aborted == [backend.submitted[0].request_id]
    assert sent[0]["status"] == 499


def test_a_beam_search_left_mid_placement_aborts_every_request_it_placed(backend, tokenizer):
    """The client leaves while both beams' second steps are being placed, one placement slower
    than the other: the quicker is aborted once placed, the slower's placement is cancelled (the
    search ends when the quicker one is, while the slower is still being placed)."""
    backend.next_token = lambda prompt: (40, TokenLogprob(-0.5, ((40, -0.5), (41, -0.9)), rank=1))
    backend.submit_delay = lambda prompt: {40: 0.05, 41: 0.3}.get(prompt[-1], 0.0)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "n": 2, "use_beam_search": True}
    # Placed: the first step's request, then both beams' second.
    leave_when(create_app(backend.open, tokenizer), body, lambda: len(backend.submitted) >= 3)
    first, *second = [s.request_id for s in backend.submitted]
    assert len(second) == 2 and set(second) <= set(backend.aborted) and first not in backend.aborted


def test_until_disconnect_returns_the_result_when_the_client_stays():
    async def scenario():
        async def receive():
            await asyncio.sleep(3600)

        async def work():
            return 42

        return await until_disconnect(receive, work())

    assert asyncio.run(scenario()) == 42


def test_until_disconnect_cancels_the_work_and_waits_for_its_cleanup():
    cleaned = []

    async def scenario():
        async def receive():
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def work():
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.01)  # an abort RPC, say
                cleaned.append(True)

        await until_disconnect(receive, work())

    with pytest.raises(ClientDisconnected):
        asyncio.run(scenario())
    assert cleaned == [True]


def test_until_disconnect_passes_errors_of_the_work_through():
    async def scenario():
        async def receive():
            await asyncio.sleep(3600)

        async def work():
            raise ValueError("boom")

        await until_disconnect(receive, work())

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(scenario())
