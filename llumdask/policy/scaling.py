"""Scaling (paper section 4.4.3): keep the cluster's pooled freeness inside a band.

Pooled F (`llumdask.load.PooledLoad`: the cluster summed as one instance) below the band for
`scale-out-period` -> take back instances a scale-in is still draining (up and loaded, no
start-up), then add as many new ones as the rest of the deficit needs (the scheduler sizes both);
above it for `scale-in-period` -> drain as many as the surplus above the band allows (at least
one; the scheduler sizes it too). Out is quick and in is slow, as autoscalers usually are: a
deficit is requests queueing now, a surplus only cost, and a closed instance takes a start-up
to come back. Hysteresis keeps a load step or a load oscillating around a band edge from flapping
the cluster: the timer restarts whenever the condition breaks, and after a decision the same
condition must hold for another full period before the next one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from llumdask.config import ScalingConfig


@dataclass(frozen=True)
class ScaleDecision:
    """`add` new instances; `resume`: instances a scale-in was draining, taken back before any new
    one is asked for (up and loaded already, no start-up); `terminate`: mark draining (F = -inf,
    everything migrates out); `remove`: terminating instances now drained and empty, to close now."""

    add: int = 0
    terminate: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.terminate or self.remove or self.resume)


class ScaleAction(enum.Enum):
    ADD = "add"
    TERMINATE = "terminate"


class ScalingPolicy:
    """The band and the hysteresis timer; which instance to drain is the scheduler's choice."""

    def __init__(self, config: ScalingConfig) -> None:
        self._low, self._high = config.band
        self._periods = {ScaleAction.ADD: config.scale_out_period, ScaleAction.TERMINATE: config.scale_in_period}
        self._condition: ScaleAction | None = None
        self._since = 0.0

    def observe(self, now: float, freeness: float | None, *, can_add: bool, can_terminate: bool) -> ScaleAction | None:
        """Feed one observation (None: no instance to measure); returns the action due, if any.

        An action the caller cannot take now (`can_add`/`can_terminate` False) is not taken and
        does not restart the timer, so it happens as soon as it becomes possible.
        """
        condition = self._condition_of(freeness)
        if condition is not self._condition:
            self._condition, self._since = condition, now
        if condition is None or now - self._since < self._periods[condition]:
            return None
        if not (can_add if condition is ScaleAction.ADD else can_terminate):
            return None
        self._since = now
        return condition

    def _condition_of(self, freeness: float | None) -> ScaleAction | None:
        if freeness is None:
            return None
        if freeness < self._low:
            return ScaleAction.ADD
        if freeness > self._high:
            return ScaleAction.TERMINATE
        return None
