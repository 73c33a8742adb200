"""Dask's worker timers that a llumlet worker does not need, stopped or slowed while it hosts one.

Each timer wakes the worker's event loop, and each wake-up takes the GIL from the engine thread.
A diagnosis (per-thread /proc counters read by hand around one `gateway_overhead --shape 8x768`
level at one stream, not a benchmark kept here): the loop slept and
woke ~340 times a second and the engine thread waited for the GIL ~290 times a second; tokens
came 7.6% slower than from `vllm serve`. With these timers quiet and the load report written on
the engine thread (plugins/worker.py): ~160 and ~230 times a second, 3.6% slower.
Dask's profiler samples the threads that run Dask tasks every 10 ms; a llumlet worker runs none,
so it samples nothing. The tick that watches the loop for stalls (every 20 ms) still catches a
stall of Dask's warning limit (seconds) when it runs every 200 ms.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STOPPED = ("profile", "profile-cycle")
TICK = "tick"
TICK_MS = 200.0


class DaskTimers:
    """`slow_down()` when the llumlet starts, `restore()` when it stops (the worker lives on).

    Stopped timers leave the worker's `periodic_callbacks` until restored: the worker starts every
    timer found there when it begins to run, which may be after its plugins were set up.
    """

    def __init__(self, worker) -> None:
        self._callbacks = getattr(worker, "periodic_callbacks", {})
        self._stopped: dict = {}
        self._tick_ms: float | None = None

    def slow_down(self) -> None:
        for name in STOPPED:
            callback = self._callbacks.pop(name, None)
            if callback is not None:
                callback.stop()
                self._stopped[name] = callback
        tick = self._callbacks.get(TICK)
        if tick is not None and self._tick_ms is None and 0 < tick.callback_time < TICK_MS:
            self._tick_ms, tick.callback_time = tick.callback_time, TICK_MS
        logger.debug("Dask timers stopped: %s; tick every %s ms", sorted(self._stopped), TICK_MS)

    def restore(self) -> None:
        for name, callback in self._stopped.items():
            self._callbacks[name] = callback
            callback.start()
        self._stopped = {}
        tick = self._callbacks.get(TICK)
        if tick is not None and self._tick_ms is not None:
            tick.callback_time = self._tick_ms
        self._tick_ms = None
