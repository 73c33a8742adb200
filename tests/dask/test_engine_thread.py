"""The engine thread: FIFO calls between steps, back-to-back steps while busy, woken by calls when idle."""

from __future__ import annotations

import threading

import pytest

from llumdask.plugins.engine_thread import EngineThread

LONG = 30.0  # an idle wait no test may sit through: only a wake-up can end it in time


class Work:
    """A fake engine: `pending` steps of work; each step records itself."""

    def __init__(self) -> None:
        self.pending = 0
        self.steps = 0
        self.idle = threading.Event()
        self.fail = False

    def step(self) -> bool:
        if self.fail:
            self.steps += 1
            raise RuntimeError("broken step")
        if self.pending:
            self.pending -= 1
            self.steps += 1
        if not self.pending:
            self.idle.set()
        return self.pending > 0


@pytest.fixture
def work():
    return Work()


@pytest.fixture
def thread(work):
    engine = EngineThread("test-engine", work.step, idle_wait=LONG)
    engine.start()
    yield engine
    engine.stop(timeout=5)
    assert not engine.alive


def test_calls_run_in_order_with_results_and_errors(thread):
    seen: list[int] = []
    futures = [thread.submit(seen.append, i) for i in range(50)]
    assert [f.result(5) for f in futures] == [None] * 50 and seen == list(range(50))
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(5)
    assert thread.submit(lambda a, b: a + b, 2, 3).result(5) == 5


def test_a_call_that_brings_work_wakes_the_idle_thread_which_steps_until_done(thread, work):
    thread.submit(lambda: None).result(5)  # the thread has gone idle for LONG seconds
    work.idle.clear()

    def add_work() -> None:
        work.pending = 100

    thread.submit(add_work).result(5)
    assert work.idle.wait(5), "the thread did not step through its work after the call"
    assert work.steps == 100


def test_a_failing_step_backs_off_instead_of_spinning(thread, work):
    work.fail = True
    thread.wake()
    thread.submit(lambda: None).result(5)
    threading.Event().wait(0.3)  # the step after that call has failed by now
    failures = work.steps
    threading.Event().wait(0.3)
    assert work.steps == failures <= 2  # no new step without a wake-up
    work.fail = False
    assert thread.submit(lambda: "alive").result(5) == "alive"


def test_stop_runs_what_was_submitted_then_refuses_more(work):
    engine = EngineThread("test-engine", work.step, idle_wait=LONG)
    engine.start()
    seen: list[int] = []
    futures = [engine.submit(seen.append, i) for i in range(10)]
    engine.stop(timeout=5)
    assert not engine.alive and all(f.done() for f in futures) and seen == list(range(10))
    with pytest.raises(RuntimeError, match="stopping"):
        engine.submit(seen.append, 10)


def test_calls_waiting_says_whether_calls_are_queued_for_the_next_gap(work):
    engine = EngineThread("test-engine", work.step, idle_wait=LONG)
    assert not engine.calls_waiting
    done = engine.submit(lambda: None)
    assert engine.calls_waiting
    engine.start()
    done.result(5)
    assert not engine.calls_waiting
    engine.stop(timeout=5)


def test_idle_wait_must_be_positive(work):
    with pytest.raises(ValueError):
        EngineThread("x", work.step, idle_wait=0)
