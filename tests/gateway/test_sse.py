"""SSE events survive line splitting by any client, whatever characters the model generates."""

import json

from hypothesis import given
from hypothesis import strategies as st

from llumdask.api.gateway.sse import event


@given(st.text())
def test_an_event_is_one_line_whatever_the_text(text):
    encoded = event({"choices": [{"text": text}]}).decode()
    assert encoded.endswith("\n\n")
    (line,) = encoded[: -2].splitlines()
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_separator_characters_are_escaped():
    assert "\u2028" not in event({"text": "a\u2028b\x85c"}).decode()


def test_a_write_the_client_never_takes_ends_the_stream_after_the_write_timeout(caplog):
    """The ASGI server holds `send` while its buffers are full; past the write timeout the
    response gives up, closes its event source and reports the stream incomplete."""
    import asyncio

    from llumdask.api.gateway.sse import EventStreamResponse

    closed: list[bool] = []
    finished: list[bool] = []

    async def events():
        try:
            for k in range(1000):
                yield event({"k": k})
        finally:
            finished.append(True)

    async def on_close(complete: bool) -> None:
        closed.append(complete)

    async def receive():
        await asyncio.sleep(3600)  # the client never disconnects either

    sent: list[dict] = []

    async def send(message):
        if len(sent) >= 3:
            await asyncio.sleep(3600)  # buffers full: this write never completes
        sent.append(message)

    async def run() -> float:
        started = asyncio.get_running_loop().time()
        await EventStreamResponse(events(), on_close, write_timeout=0.2)({"type": "http"}, receive, send)
        return asyncio.get_running_loop().time() - started

    took = asyncio.run(run())
    assert closed == [False] and finished == [True] and len(sent) == 3
    assert 0.2 <= took < 2.0
    # Said in the log (a TimeoutError is an OSError: it once went unsaid as a disconnect).
    assert "read none of its stream for 0.2 s" in caplog.text
