"""Polling for a condition another thread or process brings about, instead of sleeping for it."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05,
               what: str = "condition") -> None:
    """Return once `predicate()` is true; fail the test if it is not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(interval)
