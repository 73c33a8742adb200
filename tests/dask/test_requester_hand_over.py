"""The requester's hand-over of a placed request, on its own (the instances' answers scripted): a
hand-over left unanswered may have added the request all the same, so it is aborted there before
the request goes anywhere again, and placed again as admitted (it had its turn)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import llumdask.plugins.requester as requester_module
from llumdask.config import load_config
from llumdask.plugins.control import Op, RequestRejected
from llumdask.plugins.requester import Requester
from llumdask.request import Request, SamplingParams


class ScriptedCluster:
    """The scheduler's choices in turn, and the instances' answers to ADD and ABORT, logged as
    (instance, op) when it ended (ADD: when it started, with its resubmission flag), and the
    scheduler's withdrawals as ("scheduler", "withdraw", dispatch number)."""

    def __init__(self, choices: list[str], add: dict[str, object], abort_takes: float = 0.0) -> None:
        self.choices = choices
        self.add = add  # by instance: "ok", "hang", or an exception to raise
        self.abort_takes = abort_takes
        self.admitted: list[bool] = []
        self.attempts: list[int] = []
        self.log: list[tuple[str, str]] = []
        self.hand_overs: list[tuple[str, object]] = []  # (op, the hand-over it names) of each ADD and ABORT
        self.adding = asyncio.Event()

    async def dispatch(self, request: Request, admitted: bool, count: int, attempt: int) -> str:
        self.admitted.append(admitted)
        self.attempts.append(attempt)
        return self.choices.pop(0)

    async def call(self, instance: str, op: Op, **kwargs: object) -> object:
        if op is Op.WITHDRAW:
            self.log.append((instance, "withdraw", kwargs["attempt"]))
            return SimpleNamespace(withdrawn=True)
        if op is Op.ADD:
            self.log.append((instance, "add", kwargs["resubmission"]))
            self.hand_overs.append(("add", kwargs["hand_over"]))
            self.adding.set()
            answer = self.add[instance]
            if answer == "hang":
                await asyncio.sleep(3600)
            if isinstance(answer, BaseException):
                raise answer
            return SimpleNamespace(accepted=True)
        assert op is Op.ABORT
        self.hand_overs.append(("abort", kwargs["hand_over"]))
        await asyncio.sleep(self.abort_takes)
        self.log.append((instance, "abort"))
        return SimpleNamespace(aborted=True)


class Listener:
    address = "tcp://127.0.0.1:1"

    async def close(self) -> None:
        pass


def requester_on(cluster: ScriptedCluster, monkeypatch) -> Requester:
    monkeypatch.setattr(requester_module, "call", cluster.call)
    config = load_config({"requester": {"rpc-timeout": 1.0, "placement-timeout": 30}}).requester
    requester = Requester(client=SimpleNamespace(rpc=lambda instance: instance, scheduler="scheduler"), config=config)
    requester._dispatch, requester._listener = cluster.dispatch, Listener()
    return requester


def cancel_placing(cluster: ScriptedCluster, monkeypatch, when: Callable[[], bool]) -> None:
    """Place a request, cancel its caller once a hand-over started and `when()` holds, then close."""

    async def scenario() -> None:
        requester = requester_on(cluster, monkeypatch)
        placing = asyncio.ensure_future(requester._place([request()]))
        await cluster.adding.wait()
        while not when():
            await asyncio.sleep(0.01)
        placing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await placing
        await requester.close()

    asyncio.run(scenario())


def request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=4))


def test_an_unanswered_hand_over_is_aborted_there_before_the_request_is_handed_over_again(monkeypatch):
    """The same instance chosen again: its abort of the first hand-over (slow here) ends before the
    second hand-over starts, or it would end the request the second one added."""
    cluster = ScriptedCluster(["a", "a"], {"a": "hang"}, abort_takes=0.5)

    async def scenario() -> str:
        requester = requester_on(cluster, monkeypatch)
        placing = asyncio.ensure_future(requester._place([request()]))
        await cluster.adding.wait()
        cluster.add["a"] = "ok"  # answers the next hand-over
        return await asyncio.wait_for(placing, 10)

    assert asyncio.run(scenario()) == "a"
    # The second hand-over may find the first one's request there (its abort failed): it goes on then.
    assert cluster.log == [("a", "add", False), ("a", "abort"), ("a", "add", True)]
    assert cluster.admitted == [False, True]  # placed again as admitted: never refused for load nor held again


def test_the_abort_of_an_unanswered_hand_over_names_it_so_that_its_late_add_is_refused(monkeypatch):
    """The instance may read the abort before the add (two connections): naming the hand-over lets
    it refuse the add then, and a later hand-over of the same request is another one."""
    cluster = ScriptedCluster(["a", "a"], {"a": "hang"})

    async def scenario() -> None:
        requester = requester_on(cluster, monkeypatch)
        placing = asyncio.ensure_future(requester._place([request()]))
        await cluster.adding.wait()
        cluster.add["a"] = "ok"
        await asyncio.wait_for(placing, 10)
        await requester.close()

    asyncio.run(scenario())
    (add1, first), (abort, named), (add2, second) = cluster.hand_overs
    assert (add1, abort, add2) == ("add", "abort", "add")
    assert isinstance(first, str) and named == first and second not in (None, first)


def test_a_hand_over_elsewhere_does_not_wait_for_an_abort_at_an_unanswering_instance(monkeypatch):
    cluster = ScriptedCluster(["a", "b"], {"a": asyncio.TimeoutError(), "b": "ok"}, abort_takes=0.8)

    async def scenario() -> str:
        requester = requester_on(cluster, monkeypatch)
        instance = await requester._place([request()])
        await requester.close()  # lets the abort finish
        return instance

    assert asyncio.run(scenario()) == "b"
    assert cluster.log == [("a", "add", False), ("b", "add", True), ("a", "abort")]


def test_a_caller_cancelled_mid_hand_over_leaves_nothing_running_there(monkeypatch):
    """A gateway's client left while its request was being handed over: the request is aborted
    there (the add may still come through), and closing waits for that abort."""
    cluster = ScriptedCluster(["a"], {"a": "hang"}, abort_takes=0.2)
    cancel_placing(cluster, monkeypatch, lambda: True)
    assert cluster.log == [("a", "add", False), ("a", "abort")]


def test_a_caller_cancelled_before_its_hand_over_started_sends_nothing_more_there(monkeypatch):
    """Placed again on an instance where an earlier hand-over's abort is still on its way: the
    caller leaves while the hand-over waits for it. Only that abort reaches the instance."""
    cluster = ScriptedCluster(["a", "a"], {"a": "hang"}, abort_takes=0.5)
    # The first hand-over, unanswered, is aborted after the timeout; cancelled once placed again on
    # "a", waiting for the abort there.
    cancel_placing(cluster, monkeypatch, lambda: cluster.attempts == [0, 1])
    assert cluster.log == [("a", "add", False), ("a", "abort")]


def test_a_refused_hand_over_is_not_aborted(monkeypatch):
    """A refusal (the request can never fit) means the instance added none of them."""
    cluster = ScriptedCluster(["a"], {"a": RequestRejected("too long")})

    async def scenario() -> None:
        requester = requester_on(cluster, monkeypatch)
        with pytest.raises(RequestRejected):
            await requester._place([request()])
        await requester.close()

    asyncio.run(scenario())
    assert cluster.log == [("a", "add", False)]
