"""When a worker's engine thread sends tokens (LlumletHost._step_once), with a fake llumlet,
pusher and loop: held tokens go when the step fails, when the engine has nothing left to do, and
before queued calls run; otherwise at most once per stream interval. A load report goes to the
event loop every report interval, also while the engine is idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llumdask.config import load_config
from llumdask.engine.base import StepResult, TokenOutput
from llumdask.plugins.worker import LlumletHost
from llumdask.request import FinishReason


class FakeLoop:
    """Records the load reports handed over."""

    def __init__(self) -> None:
        self.loads: list[dict] = []

    def add_callback(self, fn, load) -> None:
        self.loads.append(load)


class FakePusher:
    """Records each send: the first index of every token output in it (and the outputs)."""

    def __init__(self) -> None:
        self.hand_offs: list[list[int]] = []
        self.outputs: list[TokenOutput] = []

    def push(self, outbox) -> None:
        self.hand_offs.append([output.first_index for _, output in outbox])
        self.outputs += [output for _, output in outbox]


class FakeLlumlet:
    """Each step emits the next token of request "r" (from index 1: not a first token)."""

    def __init__(self, host: LlumletHost, steps: int) -> None:
        self._host = host
        self.left = steps
        self.index = 1
        self.fail = False
        self.ticks = 0
        self.aborted: list[str] = []
        self.engine = SimpleNamespace(has_work=lambda: self.left > 0,
                                      get_request=lambda request_id: SimpleNamespace(num_output_tokens=self.index))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def tick(self) -> None:
        self.ticks += 1

    def load_report(self):
        return SimpleNamespace(to_dict=lambda: {"steps_left": self.left})

    def step(self) -> StepResult:
        self._host._on_tokens(TokenOutput("r", self.index, (7,)))
        self.index += 1
        self.left -= 1
        if self.fail:
            raise RuntimeError("broken step")
        return StepResult(outputs=(), preempted=(), duration=0.001, num_prefill_tokens=0, batch_size=1)


@pytest.fixture
def host():
    loop = FakeLoop()
    worker = SimpleNamespace(address="tcp://127.0.0.1:1", loop=loop)
    host = LlumletHost(worker, load_config({"stream-interval": 3600.0}))  # never due by time
    host._next_report = float("inf")  # no report unless a test makes one due
    host.pusher = FakePusher()
    host._routes.owned["r"] = "tcp://gateway:1"
    return host


def test_tokens_wait_for_the_interval_while_steps_make_progress_then_go_when_work_ends(host):
    host.llumlet = FakeLlumlet(host, steps=4)
    assert host._step_once() and host.pusher.hand_offs == [[1]]  # the first hand-off is due at once
    assert host._step_once() and host._step_once()
    assert host.pusher.hand_offs == [[1]]  # then the interval holds tokens back
    assert host._step_once() is False  # the last step: nothing left, so everything goes
    assert host.pusher.hand_offs == [[1], [2, 3, 4]]


def test_held_tokens_go_when_a_step_fails_and_the_request_ends_aborted(host):
    host.llumlet = FakeLlumlet(host, steps=5)
    host._step_once()
    host._step_once()
    host.llumlet.fail = True
    with pytest.raises(RuntimeError, match="broken step"):
        host._step_once()
    # Tokens 2 and 3 (the failed step's), then the end after the 4 tokens "r" has.
    assert host.pusher.hand_offs == [[1], [2, 3, 4]]
    end = host.pusher.outputs[-1]
    assert end.token_ids == () and end.finished and end.finish_reason is FinishReason.ABORT
    assert host.llumlet.aborted == ["r"] and "r" not in host._routes.owned


def test_held_tokens_go_before_queued_calls_run(host):
    host.llumlet = FakeLlumlet(host, steps=5)
    host._step_once()
    host._step_once()
    host._engine_thread.submit(lambda: None)  # e.g. a KV stage to import
    host._step_once()
    assert host.pusher.hand_offs == [[1], [2, 3]]


def test_a_load_report_goes_to_the_loop_every_report_interval_also_while_idle(host):
    host.llumlet = FakeLlumlet(host, steps=3)
    host.registered = True
    host._next_report = 0.0
    host._step_once()
    assert host.pusher.hand_offs == [[1]] and host.loop.loads == [{"steps_left": 2}]
    host._step_once()  # tokens held, no report due: nothing sent, nothing handed over
    assert host.loop.loads == [{"steps_left": 2}]
    host.llumlet.left = 0  # idle from here on: the thread wakes every report interval
    host._next_report = 0.0
    assert host._step_once() is False
    assert host.pusher.hand_offs == [[1], [2]] and host.loop.loads[-1] == {"steps_left": 0}
    assert host.llumlet.ticks == 2


def test_handshakes_expire_before_registration_but_no_report_is_sent(host):
    host.llumlet = FakeLlumlet(host, steps=0)
    host._next_report = 0.0
    host._step_once()
    assert host.llumlet.ticks == 1 and host.loop.loads == []
