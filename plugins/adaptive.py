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

from collections.abc import Mapping, Sequence

from distributed.deploy.adaptive import Adaptive

from llumdask.plugins.control import AdaptiveTarget, Op, call


class LlumnixAdaptive(Adaptive):
    """`Adaptive` whose target and victims come from the llumdask scheduler plugin."""

    async def _plan(self) -> AdaptiveTarget:
        """The plugin's plan; it learns meanwhile which workers share a job, which it drains and
        takes back whole."""
        return await call(self.scheduler, Op.ADAPTIVE_TARGET, jobs=jobs_of(getattr(self.cluster, "worker_spec", {})))

    def _closable(self, plan: AdaptiveTarget) -> list[str]:
        """The drained workers whose whole job is drained: those that may close now."""
        return whole_jobs(plan.drained, getattr(self.cluster, "worker_spec", {}), len(plan.drained))

    async def target(self) -> int:
        """The plugin's target, counting as kept the drained workers that cannot close yet (the
        rest of their job still serves): Dask would otherwise close a worker still starting in
        their place."""
        plan = await self._plan()
        return plan.target + len(plan.drained) - len(self._closable(plan))

    async def recommendations(self, target: int) -> dict:
        """Drained workers close first, whatever the target; then Dask's rule. Left to Dask's
        rule, a drained worker and an instance asked for cancel out (the target equals the
        plan: neither closes nor starts, for good), or a worker still starting closes in the
        drained one's place."""
        closing = self._closable(await self._plan())
        if closing:
            self.close_counts.clear()
            return {"status": "down", "workers": closing}
        return await super().recommendations(target)

    async def workers_to_close(self, target: int) -> list:
        """Names of drained workers only (never more than it takes to reach `target`), whole jobs
        at a time where a job holds several workers (a batch job of SLURM, say): a SpecCluster
        closes a job, all its workers, for any one of their names."""
        plan = await self._plan()
        return whole_jobs(plan.drained, getattr(self.cluster, "worker_spec", {}),
                          max(len(self.observed) - target, 0))


def jobs_of(worker_spec: Mapping[str, Mapping]) -> dict[str, str]:
    """Worker name -> job name, for the workers of jobs of several (a SpecCluster spec with a
    "group" is a job of several workers, named spec name + suffix)."""
    return {f"{name}{suffix}": name for name, spec in worker_spec.items() if "group" in spec for suffix in spec["group"]}


def whole_jobs(drained: Sequence[str], worker_spec: Mapping[str, Mapping], excess: int) -> list[str]:
    """Of the `drained` worker names, those whose whole job is drained, at most `excess` workers."""
    job_of = jobs_of(worker_spec)
    members: dict[str, list[str]] = {}
    for worker, job in job_of.items():
        members.setdefault(job, []).append(worker)
    done = set(drained)
    chosen: list[str] = []
    for name in drained:
        job = members[job_of[name]] if name in job_of else [name]
        if name not in chosen and done.issuperset(job) and len(chosen) + len(job) <= excess:
            chosen += job
    return chosen
