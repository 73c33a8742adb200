"""The requester's liveness check on its own, the scheduler's answers scripted (the cluster paths
are test_faults.py's and test_gateway_faults.py's)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from llumdask.config import load_config
from llumdask.plugins.requester import SUSPECT_RECHECK, Requester, _Open
from llumdask.request import Request, SamplingParams


def test_a_holder_whose_token_connection_closed_is_asked_about_until_the_scheduler_drops_it():
    """A SIGKILL closes the token connection at once, and the scheduler may still list the instance
    a moment later: the requester asks again every SUSPECT_RECHECK, not at its next regular check
    (a minute here), and resubmits the request once the scheduler no longer lists its holder."""
    answers = [{"src", "dst"}, {"src", "dst"}, {"src"}]
    asked: list[float] = []
    resubmitted: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        requester = Requester(client=None, config=load_config({"requester": {"liveness-interval": 60}}).requester)
        done = asyncio.Event()

        async def members() -> set[str]:
            asked.append(loop.time())
            return answers[min(len(asked), len(answers)) - 1]

        async def resubmit(entry: _Open) -> None:
            resubmitted.append(entry.request.request_id)
            done.set()

        requester.members, requester._resubmit = members, resubmit
        stream = SimpleNamespace(sequence=SimpleNamespace(owner="dst", done=False, next_index=0))
        requester._open["r"] = _Open(Request("r", [1, 2], SamplingParams(max_tokens=4)), stream, "src")
        watch = asyncio.ensure_future(requester._watch())
        requester._on_sender_closed("src")  # holds nothing open: no reason to ask
        await asyncio.sleep(3 * SUSPECT_RECHECK)
        assert asked == [] and requester._suspects == {}
        requester._on_sender_closed("dst")
        await asyncio.wait_for(done.wait(), 30)  # well before the regular check, a minute on
        watch.cancel()
        assert requester._suspects == {}  # dead: no more checks at the short interval

    asyncio.run(scenario())
    assert resubmitted == ["r"] and len(asked) == 3
