"""Dask adaptive scaling driven by the freeness band, closing instances only once drained.

Dask's own `Adaptive` sizes a cluster by task load and retires whichever workers hold the least
data: for a serving cluster both are wrong. Here the scheduler plugin decides: the target is
"every worker except the drained ones, plus the instances a scale-up asked for", and the only
workers ever closed are those the plugin reports drained (marked terminating, their requests
migrated away, nothing running, waiting or on its way). Scale-in therefore drops no request.

Use with any `SpecCluster` (LocalCluster, SLURM, ...):
    cluster.adapt(Adaptive=LlumnixAdaptive, minimum=1, maximum=16)
"""

from __future__ import annotations

from distributed.deploy.adaptive import Adaptive

from llumdask.plugins.control import AdaptiveTarget, Op, call


class LlumnixAdaptive(Adaptive):
    """`Adaptive` whose target and victims come from the llumdask scheduler plugin."""

    async def _plan(self) -> AdaptiveTarget:
        return await call(self.scheduler, Op.ADAPTIVE_TARGET)

    async def target(self) -> int:
        return (await self._plan()).target

    async def workers_to_close(self, target: int) -> list:
        """Names of drained workers only (never more than it takes to reach `target`)."""
        plan = await self._plan()
        excess = max(len(self.observed) - target, 0)
        return list(plan.drained)[:excess]
