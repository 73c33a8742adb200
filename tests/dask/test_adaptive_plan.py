"""`LlumnixAdaptive`'s recommendations on their own (the plugin's plan and Dask's view of the
cluster scripted; the cluster paths are test_adaptive.py's): drained workers close first, whatever
the target, and a worker still starting never closes in a drained one's place."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

from llumdask.plugins.adaptive import LlumnixAdaptive
from llumdask.plugins.control import AdaptiveTarget


def adaptive(plan: AdaptiveTarget, spec: set[str], observed: set[str], worker_spec: dict | None = None) -> LlumnixAdaptive:
    """An adaptive without its periodic loop: Dask's view is `spec` (the plan: every worker asked
    for) and `observed` (those connected)."""
    a = LlumnixAdaptive.__new__(LlumnixAdaptive)
    a.cluster = SimpleNamespace(plan=spec, requested=spec, observed=observed,
                                worker_spec=worker_spec if worker_spec is not None else {w: {} for w in spec})
    a.close_counts, a.wait_count = defaultdict(int), 3
    a.state = "stopped"  # no periodic loop to stop when it goes

    async def plugin_plan() -> AdaptiveTarget:
        return plan

    a._plan = plugin_plan
    return a


def recommend(a: LlumnixAdaptive) -> dict:
    async def both() -> dict:
        return await a.recommendations(await a.target())

    return asyncio.run(both())


def test_a_drained_worker_closes_while_an_instance_asked_for_is_counted_in_its_place():
    """Two workers, one drained, one instance asked for: the plugin's target is 2, as many as Dask
    plans. Dask's rule says "same" for good (nothing closes, nothing starts); here the drained
    one closes, and the next round starts the new one."""
    a = adaptive(AdaptiveTarget(2, ("w1",)), {"w1", "w2"}, {"w1", "w2"})
    assert recommend(a) == {"status": "down", "workers": ["w1"]}
    a = adaptive(AdaptiveTarget(2, ()), {"w2"}, {"w2"})  # w1 gone: the plugin lists it drained no more
    assert recommend(a) == {"status": "up", "n": 2}


def test_the_last_worker_drained_closes_and_dask_s_minimum_starts_another():
    """An operator drained the only instance: left to Dask's rule, its minimum (one) equals the
    plan, and the drained worker stays while nothing serves, for good."""
    a = adaptive(AdaptiveTarget(0, ("w1",)), {"w1"}, {"w1"})
    assert recommend(a) == {"status": "down", "workers": ["w1"]}


def test_a_worker_still_starting_never_closes_in_a_drained_one_s_place():
    a = adaptive(AdaptiveTarget(2, ("w1",)), {"w1", "w2", "w3"}, {"w1", "w2"})  # w3 on its way
    assert recommend(a) == {"status": "down", "workers": ["w1"]}


def test_a_drained_worker_whose_job_still_serves_is_kept_and_nothing_closes_in_its_place():
    """One worker of a two-worker job drained: it cannot close alone, so it counts as kept, and
    the worker still starting is not closed instead."""
    spec = {"job-a-0", "job-a-1", "w3"}
    worker_spec = {"job-a": {"group": ["-0", "-1"]}, "w3": {}}
    a = adaptive(AdaptiveTarget(2, ("job-a-0",)), spec, {"job-a-0", "job-a-1"}, worker_spec)
    assert recommend(a) == {"status": "same"}


def test_without_drained_workers_dask_s_rule_decides():
    assert recommend(adaptive(AdaptiveTarget(3, ()), {"w1", "w2"}, {"w1", "w2"})) == {"status": "up", "n": 3}
    assert recommend(adaptive(AdaptiveTarget(2, ()), {"w1", "w2"}, {"w1", "w2"})) == {"status": "same"}


def test_the_plan_tells_the_plugin_which_workers_share_a_job(monkeypatch):
    """So that scale-in drains a job whole (one drained alone waits for its job-mates)."""
    import llumdask.plugins.adaptive as adaptive_module

    asked: list[dict] = []

    async def call(scheduler, op, **kwargs) -> AdaptiveTarget:
        asked.append(kwargs)
        return AdaptiveTarget(3, ())

    monkeypatch.setattr(adaptive_module, "call", call)
    a = LlumnixAdaptive.__new__(LlumnixAdaptive)
    a.cluster = SimpleNamespace(worker_spec={"job-a": {"group": ["-0", "-1"]}, "w3": {}}, scheduler_comm="scheduler")
    a.state = "stopped"  # no periodic loop to stop when it goes
    assert asyncio.run(LlumnixAdaptive._plan(a)) == AdaptiveTarget(3, ())
    assert asked == [{"jobs": {"job-a-0": "job-a", "job-a-1": "job-a"}}]
