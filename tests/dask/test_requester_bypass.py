"""The requester's choice between the scheduler and bypass mode, on its own (the cluster paths are
test_scheduler_outage.py's): while the scheduler does not answer it hands requests to the instances
it knows, and once none is left it asks the scheduler again instead of waiting out the period."""

from __future__ import annotations

import asyncio

import pytest

from llumdask.plugins.requester import NoInstanceAvailable, Requester
from llumdask.request import Request, SamplingParams


def request(number: int) -> Request:
    return Request(f"r{number}", [1, 2, 3], SamplingParams(max_tokens=4))


def test_bypass_uses_known_instances_and_asks_the_scheduler_again_when_none_is_left():
    asked: list[str] = []
    answers: list[object] = [asyncio.TimeoutError(), "new", OSError("refused")]

    async def scenario() -> list[object]:
        requester = Requester(client=None)  # no cluster: the scheduler's answers are scripted

        async def dispatch(req: Request, admitted: bool, count: int, attempt: int) -> str:
            asked.append(req.request_id)
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        requester._dispatch = dispatch
        requester._known = ["old-a", "old-b"]
        got: list[object] = [await requester._choose(request(0), False, 1)]  # no answer: bypass
        got.append(await requester._choose(request(1), False, 1))  # still bypassing: not asked
        requester._known.clear()  # both died with the scheduler (their hand-overs failed)
        got.append(await requester._choose(request(2), False, 1))  # asked again: its answer, its dispatch's number
        with pytest.raises(NoInstanceAvailable):
            await requester._choose(request(3), False, 1)  # asked, no answer, nothing known
        got.append(requester.bypassed)
        return got

    # Bypass mode's choices are no dispatch of the scheduler's: nothing of them to withdraw there.
    assert asyncio.run(scenario()) == [("old-a", None), ("old-b", None), ("new", 1), 2]
    assert asked == ["r0", "r2", "r3"]


def test_an_instance_whose_token_connection_closed_leaves_the_bypass_rotation_until_listed_again():
    requester = Requester(client=None)
    requester._known, requester._epoch = ["old-a", "old-b"], "e1"
    requester._on_sender_closed("old-a")
    assert requester._known == ["old-b"]
    assert requester._epoch is None  # the next membership poll brings the whole list again
