"""DaskTimers stops the profiler's timers and slows the tick while a llumlet runs, then puts all back."""

from __future__ import annotations

from types import SimpleNamespace

from llumdask.plugins.dask_timers import TICK_MS, DaskTimers


class Timer:
    def __init__(self, ms: float) -> None:
        self.callback_time = ms
        self.running = True

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


def test_timers_are_slowed_then_restored_as_they_were():
    profile, cycle, tick, heartbeat = Timer(10.0), Timer(1000.0), Timer(20.0), Timer(1000.0)
    worker = SimpleNamespace(periodic_callbacks={"profile": profile, "profile-cycle": cycle, "tick": tick,
                                                 "heartbeat": heartbeat})
    timers = DaskTimers(worker)
    timers.slow_down()
    timers.slow_down()  # twice changes nothing more
    assert set(worker.periodic_callbacks) == {"tick", "heartbeat"}  # the worker cannot restart them
    assert not profile.running and not cycle.running and heartbeat.running
    assert tick.callback_time == TICK_MS
    timers.restore()
    assert worker.periodic_callbacks == {"profile": profile, "profile-cycle": cycle, "tick": tick, "heartbeat": heartbeat}
    assert profile.running and cycle.running and tick.callback_time == 20.0


def test_a_worker_without_those_timers_is_left_alone():
    worker = SimpleNamespace(periodic_callbacks={"tick": Timer(500.0)})
    timers = DaskTimers(worker)
    timers.slow_down()
    timers.restore()
    assert worker.periodic_callbacks["tick"].callback_time == 500.0
