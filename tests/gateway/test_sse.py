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
