"""The engine's own thread: it steps back to back while there is work, and runs calls between steps.

Driving each step from the worker's event loop (one executor call per step) put a wake-up of
the loop and then of the thread in front of every token, and made the engine wait whenever the
loop was busy sending tokens or KV stages. Here the loop only submits calls (requests, migration
messages, reports); the thread runs them in order between two steps and never waits for the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineThread:
    """`step()` returns True while another step right away makes progress; calls run FIFO between steps."""

    def __init__(self, name: str, step: Callable[[], bool], idle_wait: float) -> None:
        if idle_wait <= 0:
            raise ValueError(f"idle_wait must be > 0, got {idle_wait}")
        self._step = step
        self._idle_wait = idle_wait
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Run `fn(*args)` on the engine thread after everything submitted before it."""
        if self._stopping:
            raise RuntimeError("the engine thread is stopping")
        future: Future[T] = Future()
        self._calls.put((fn, args, future))
        self._wake.set()
        return future

    def wake(self) -> None:
        """Step again now (work arrived that a call did not bring, e.g. a flag flipped)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Run the calls already submitted, finish the current step, end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def calls_waiting(self) -> bool:
        """Calls are queued to run before the next step."""
        return not self._calls.empty()

    def _main(self) -> None:
        while True:
            # Cleared before the calls run: a call submitted from here on sets it again, so the
            # wait below never sleeps through one.
            self._wake.clear()
            self._run_calls()
            if self._stopping:
                self._run_calls()
                return
            if not self._step_safely():
                self._wake.wait(self._idle_wait)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _step_safely(self) -> bool:
        try:
            return self._step()
        except Exception:
            logger.exception("engine step failed on %s", self._thread.name)
            return False  # back off until woken: a failing step must not spin
