"""The scheduler plugin's handlers against a stand-in scheduler (no cluster, no comms)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from llumdask.load import InstanceLoad
from llumdask.plugins import scheduler as scheduler_plugin
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin


class FakeStream:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


class FakeScheduler:
    def __init__(self, workers: list[str]) -> None:
        self.handlers: dict = {}
        self.stream_handlers: dict = {}
        self.workers = {w: SimpleNamespace(address=w, name=f"name-{w}") for w in workers}
        self.stream_comms = {w: FakeStream() for w in workers}


def run_plugin(test, workers=("a", "b"), overrides=None):
    async def main():
        scheduler = FakeScheduler(list(workers))
        plugin = LlumnixSchedulerPlugin(overrides or {"migration": {"interval": 60.0}})
        await plugin.start(scheduler)
        try:
            await test(plugin, scheduler)
        finally:
            await plugin.close()

    asyncio.run(main())


# One instance of 100 blocks with no room to spare, and with room.
FULL = dict(free_blocks=2, num_running=4, running_blocks={0: 98}, running_count={0: 4})
ROOMY = dict(free_blocks=80, num_running=1, running_blocks={0: 20}, running_count={0: 1})


def load(instance: str, **kw) -> dict:
    fields = dict(instance_id=instance, total_blocks=100, block_size=16, free_blocks=100, num_running=0, num_waiting=0)
    fields.update(kw)
    return InstanceLoad(**fields).to_dict()


def test_handlers_are_installed_under_llumnix_names():
    async def check(plugin, scheduler):
        assert {"llumnix_register", "llumnix_ready", "llumnix_dispatch", "llumnix_status", "llumnix_drain",
                "llumnix_migrate", "llumnix_adaptive_target"} <= set(scheduler.handlers)
        assert {"llumnix_load", "llumnix_event"} <= set(scheduler.stream_handlers)
        assert all(name.startswith("llumnix_") for name in scheduler.stream_handlers)
        assert "adaptive_target" not in scheduler.handlers  # scaling disabled

    run_plugin(check)


def test_only_ready_instances_are_dispatched_to_and_a_burst_spreads():
    async def check(plugin, scheduler):
        assert (await plugin.dispatch("r0", 10, 10))["error"] == "no-instance"
        plugin.register("a", 100, 16)
        plugin.register("b", 100, 16)
        refused = await plugin.dispatch("r0", 10, 10)  # registered, not ready
        assert refused["error"] == "no-instance" and "no ready" in refused["message"]
        plugin.ready("a")
        plugin.ready("b")
        chosen = [(await plugin.dispatch(f"r{k}", 64, 10))["instance"] for k in range(6)]
        assert chosen.count("a") == chosen.count("b") == 3
        rows = plugin.status()["instances"]
        assert [row["num_pending"] for row in rows] == [3, 3]

    run_plugin(check)


def test_bad_load_reports_are_ignored_without_raising():
    async def check(plugin, scheduler):
        plugin.on_load(load("ghost"))  # never registered
        plugin.on_load({"instance_id": "a"})  # malformed
        plugin.register("a", 100, 16)
        plugin.on_load(load("a", total_blocks=50, free_blocks=50))  # wrong capacity
        plugin.on_load(load("a", free_blocks=60, num_running=1, running_blocks={0: 40}, running_count={0: 1}))
        assert plugin.status()["instances"][0]["free_blocks"] == 60

    run_plugin(check)


def test_a_removed_worker_is_forgotten_and_its_peers_told():
    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        plugin.remove_worker(scheduler, "a", stimulus_id="test")
        assert [row["instance"] for row in plugin.status()["instances"]] == ["b"]
        assert scheduler.stream_comms["b"].sent == [{"op": "llumnix_peer_lost", "peer": "a"}]
        assert scheduler.stream_comms["a"].sent == []

    run_plugin(check)


def test_pairing_tells_the_overloaded_source_where_to_migrate():
    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        plugin.on_load(load("a", free_blocks=0, num_running=4, running_blocks={0: 100}, running_count={0: 4}))
        plugin.on_load(load("b"))
        plugin.pair()
        assert scheduler.stream_comms["a"].sent == [{"op": "llumnix_migrate_to", "destination": "b", "take_waiting": False}]
        states = {row["instance"]: row["state"] for row in plugin.status()["instances"]}
        assert states == {"a": "source", "b": "destination"}

    run_plugin(check)


def test_drained_instances_are_the_only_ones_offered_for_downscaling():
    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        assert plugin.drain("a") == {"draining": True}
        assert scheduler.stream_comms["a"].sent == [{"op": "llumnix_set_terminating", "flag": True, "order": 1}]
        assert plugin.drain("zzz")["error"] == "unknown-instance"
        workers = list(scheduler.workers.values())
        plugin.scale()
        assert plugin.valid_workers_downscaling(scheduler, workers) == []  # not seen drained yet
        plugin.on_load(load("a", terminating=True, drain_order=1))  # made knowing it drains
        plugin.scale()
        assert [ws.address for ws in plugin.valid_workers_downscaling(scheduler, workers)] == ["a"]
        assert plugin.adaptive_target() == {"target": 1, "drained": ("name-a",)}

    run_plugin(check)


def test_a_batch_job_is_offered_for_downscaling_only_once_all_its_instances_are_drained():
    """A retirement that picks one worker of a job closes the whole job: a member drained while
    its job-mate serves must not be offered."""
    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        plugin.adaptive_target(jobs={"name-a": "job", "name-b": "job"})
        workers = list(scheduler.workers.values())
        for w in ("a", "b"):
            plugin.drain(w)
            plugin.on_load(load(w, terminating=True, drain_order=1))
            plugin.scale()
            offered = [ws.address for ws in plugin.valid_workers_downscaling(scheduler, workers)]
            assert offered == ([] if w == "a" else ["a", "b"])

    run_plugin(check)


def test_with_scaling_enabled_dask_adaptive_target_is_answered():
    overrides = {"migration": {"interval": 60.0}, "scaling": {"enabled": True, "scale-out-period": 0.0, "scale-in-period": 0.0,
                                                              "min-instances": 1, "max-instances": 3}}

    async def check(plugin, scheduler):
        assert scheduler.handlers["adaptive_target"]() == 2
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
            plugin.on_load(load(w, free_blocks=0, num_running=4, running_blocks={0: 100}, running_count={0: 4}))
        plugin.scale()
        plugin.scale()
        assert scheduler.handlers["adaptive_target"](target_duration="5s") == 3
        assert [e["action"] for e in plugin.status()["scaling"]["log"]] == ["add"]
        # The asked-for worker arrives: counted once, as a worker, and no longer as wanted once
        # its llumlet registers.
        scheduler.workers["c"] = SimpleNamespace(address="c", name="name-c")
        assert scheduler.handlers["adaptive_target"]() == 3
        plugin.register("c", 100, 16)
        assert plugin.status()["scaling"]["adds_wanted"] == 0 and scheduler.handlers["adaptive_target"]() == 3

    run_plugin(check, overrides=overrides)


def test_dask_adaptive_target_retires_drained_instances_before_counting_those_asked_for():
    """The Kubernetes operator's autoscaler reads one number and retires only below its worker
    count: a drained instance and one asked for must not cancel out."""
    overrides = {"migration": {"interval": 60.0}, "scaling": {"enabled": True, "scale-out-period": 0.0, "scale-in-period": 0.0,
                                                              "min-instances": 1, "max-instances": 3}}

    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        plugin.on_load(load("b", **FULL))
        assert plugin.drain("a") == {"draining": True}
        plugin.on_load(load("a", terminating=True, drain_order=1))
        plugin.scale()
        plugin.scale()
        assert plugin.status()["scaling"]["adds_wanted"] == 1
        assert plugin.adaptive_target() == {"target": 2, "drained": ("name-a",)}
        assert scheduler.handlers["adaptive_target"]() == 1  # below the two workers: a is retired
        plugin.remove_worker(scheduler, "a", stimulus_id="retired")
        del scheduler.workers["a"]
        assert scheduler.handlers["adaptive_target"]() == 2  # now the one asked for starts

    run_plugin(check, overrides=overrides)


def test_dask_adaptive_target_starts_first_where_more_are_asked_for_than_are_drained():
    """The operator holds its count at its minimum: a target of workers less drained could be held
    at the count, where neither would happen; two asked for, one drained: one starts."""
    overrides = {"migration": {"interval": 60.0}, "scaling": {"enabled": True, "scale-out-period": 0.0, "scale-in-period": 0.0,
                                                              "min-instances": 1, "max-instances": 4}}

    async def check(plugin, scheduler):
        for w in ("a", "b"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        plugin.on_load(load("b", free_blocks=0, num_running=40, running_blocks={0: 100}, running_count={0: 40}))
        assert plugin.drain("a") == {"draining": True}
        plugin.on_load(load("a", terminating=True, drain_order=1))
        plugin.scale()
        plugin.scale()
        assert plugin.status()["scaling"]["adds_wanted"] == 2
        assert scheduler.handlers["adaptive_target"]() == 3

    run_plugin(check, overrides=overrides)


def test_workers_named_as_sharing_a_job_are_drained_together():
    """The adaptive's call names the jobs (by worker name); scale-in then drains a job whole."""
    overrides = {"migration": {"interval": 60.0}, "scaling": {"enabled": True, "scale-out-period": 0.0, "scale-in-period": 0.0,
                                                              "min-instances": 1, "max-instances": 3}}

    async def check(plugin, scheduler):
        for w in ("a", "b", "c"):
            plugin.register(w, 100, 16)
            plugin.ready(w)
        # Pooled 240 free blocks for 2 requests: one instance fewer keeps the band's high (60), two
        # only its low (10); drained one by one, a would stay.
        plugin.on_load(load("c", free_blocks=40, num_running=2, running_blocks={0: 60}, running_count={0: 2}))
        assert plugin.adaptive_target(jobs={"name-a": "job", "name-b": "job", "name-zzz": "job"}) == {
            "target": 3, "drained": ()}
        plugin.scale()
        plugin.scale()
        draining = {w for w in ("a", "b", "c")
                    if {"op": "llumnix_set_terminating", "flag": True, "order": 1} in scheduler.stream_comms[w].sent}
        assert draining == {"a", "b"}

    run_plugin(check, workers=("a", "b", "c"), overrides=overrides)


def test_members_tell_the_instances_block_size_not_the_configured_one():
    """vLLM's CPU blocks are 128 tokens whatever the configuration says: a requester cutting
    prompts by the configured 4 (or the default 16) would match no block an engine caches."""
    async def check(plugin, scheduler):
        assert plugin.members()["block_size"] == 4  # no instance yet: the configuration's
        plugin.register("a", 100, 128)
        first = plugin.members()
        assert first["block_size"] == 128 and plugin.members(epoch=first["epoch"])["block_size"] == 128

    run_plugin(check, overrides={"block-size": 4, "migration": {"interval": 60.0}})


def test_members_answer_lists_only_when_membership_changed():
    async def check(plugin, scheduler):
        plugin.register("a", 100, 16)
        first = plugin.members()
        assert first["alive"] == ("a",) and first["placeable"] == ()  # registered, not ready yet
        assert plugin.members(epoch=first["epoch"]) == {"epoch": first["epoch"], "alive": None, "placeable": None,
                                                         "block_size": 16}
        plugin.on_load(load("a"))  # a load report is no membership change
        assert plugin.members(epoch=first["epoch"])["alive"] is None
        plugin.ready("a")
        ready = plugin.members(epoch=first["epoch"])
        assert ready["epoch"] != first["epoch"] and ready["placeable"] == ("a",)
        plugin.drain("a")
        assert plugin.members(epoch=ready["epoch"])["placeable"] == ()
        plugin.unregister("a")
        assert plugin.members(epoch=ready["epoch"])["alive"] == ()

    run_plugin(check)


def test_a_held_request_is_answered_once_a_report_makes_room_and_withdrawn_when_nobody_asks(monkeypatch):
    monkeypatch.setattr(scheduler_plugin, "HOLD_ANSWER", 0.05)

    async def check(plugin, scheduler):
        plugin.register("a", 100, 16)
        plugin.ready("a")
        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("r", 64, 10))["instance"] is None  # held: asked again later
        assert plugin.status()["held"]["requests"] == 1
        asking = asyncio.ensure_future(plugin.dispatch("r", 64, 10))  # keeps its place in line
        await asyncio.sleep(0.01)
        plugin.on_load(load("a", free_blocks=80, num_running=1, running_blocks={0: 20}, running_count={0: 1}))
        assert (await asking)["instance"] == "a"
        assert dict(plugin.metrics.dispatches) == {"held": 1, "placed": 1}
        assert plugin.status()["held"]["requests"] == 0 and plugin.status()["instances"][0]["num_pending"] == 1

        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("gone", 64, 10))["instance"] is None
        plugin.expire_held()  # asked about within the lease: kept
        assert "gone" in plugin.global_scheduler.held
        plugin._waiting["gone"].lease = 0.0  # its requester stopped asking
        plugin.expire_held()
        assert "gone" not in plugin.global_scheduler.held and not plugin._waiting
        plugin.on_load(load("a", free_blocks=80, num_running=1, running_blocks={0: 20}, running_count={0: 1}))
        assert plugin.status()["instances"][0]["num_pending"] == 1  # the withdrawn one never placed

    run_plugin(check)


def test_a_held_request_given_up_on_is_withdrawn_and_a_placement_it_never_fetched_uncharged(monkeypatch):
    monkeypatch.setattr(scheduler_plugin, "HOLD_ANSWER", 0.05)

    async def check(plugin, scheduler):
        plugin.register("a", 100, 16)
        plugin.ready("a")
        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("r", 64, 10)) == {"instance": None, "no_instance": False}
        assert plugin.withdraw("r") == {"withdrawn": True} and plugin.withdraw("r") == {"withdrawn": False}
        assert "r" not in plugin.global_scheduler.held
        # Placed by a report after its requester's last ask (two choices): never fetched, so not charged.
        assert (await plugin.dispatch("late", 64, 10, count=2))["instance"] is None
        plugin.on_load(load("a", **ROOMY))
        assert plugin.status()["instances"][0]["num_pending"] == 2
        assert plugin.withdraw("late") == {"withdrawn": True}
        assert plugin.status()["instances"][0]["num_pending"] == 0
        # The same when its requester is gone without a word: the lease runs out.
        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("silent", 64, 10))["instance"] is None
        plugin.on_load(load("a", **ROOMY))
        plugin._waiting["silent"].lease = 0.0
        plugin.expire_held()
        assert plugin.status()["instances"][0]["num_pending"] == 0 and not plugin._waiting
        assert plugin.metrics.dispatches["withdrawn"] == 4  # "r", both of "late", "silent"
        # Held while no instance may take a request: the answer says so.
        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("alone", 64, 10))["instance"] is None
        plugin.unregister("a")
        assert (await plugin.dispatch("alone", 64, 10)) == {"instance": None, "no_instance": True}

    run_plugin(check)


def test_a_placement_whose_answer_was_lost_is_uncharged_when_withdrawn_until_it_is_kept_no_longer(monkeypatch):
    """The requester timed out before the answer came (it withdraws, and places the request
    elsewhere): the instance is not charged for a request it never gets, held first or not; once
    ANSWER_KEPT passed a withdrawal changes nothing (the answer surely arrived, and was used)."""
    monkeypatch.setattr(scheduler_plugin, "HOLD_ANSWER", 0.05)

    async def check(plugin, scheduler):
        plugin.register("a", 100, 16)
        plugin.ready("a")
        plugin.on_load(load("a", **ROOMY))
        assert (await plugin.dispatch("lost", 64, 10, count=2))["instance"] == "a"
        assert (await plugin.dispatch("used", 64, 10))["instance"] == "a"
        assert plugin.status()["instances"][0]["num_pending"] == 3
        assert plugin.withdraw("lost") == {"withdrawn": True} and plugin.withdraw("lost") == {"withdrawn": False}
        assert plugin.status()["instances"][0]["num_pending"] == 1
        # Held, then placed and fetched: the fetch's answer may be lost too.
        plugin.on_load(load("a", **FULL))
        assert (await plugin.dispatch("held", 64, 10))["instance"] is None
        plugin.on_load(load("a", **ROOMY))
        assert (await plugin.dispatch("held", 64, 10))["instance"] == "a"
        assert plugin.status()["instances"][0]["num_pending"] == 2
        assert plugin.withdraw("held") == {"withdrawn": True}
        assert plugin.status()["instances"][0]["num_pending"] == 1
        assert plugin.withdraw("used") == {"withdrawn": True}
        # A withdrawal names the dispatch given up on: a later one's, dispatched again and given up
        # on before it reached here, forgets nothing of one handed over (received here), which would
        # move those behind it up as if it never came.
        assert (await plugin.dispatch("moved", 64, 10, attempt=1))["instance"] == "a"
        plugin.on_load(load("a", **ROOMY, num_received=1))
        assert (await plugin.dispatch("behind", 64, 10, attempt=7))["instance"] == "a"
        assert plugin.status()["instances"][0]["num_pending"] == 1
        assert plugin.withdraw("moved", attempt=2) == {"withdrawn": False}
        assert plugin.status()["instances"][0]["num_pending"] == 1  # "behind" still on its way
        assert plugin.withdraw("behind", attempt=8) == {"withdrawn": False}  # a later dispatch's
        assert plugin.status()["instances"][0]["num_pending"] == 1
        assert plugin.withdraw("behind", attempt=7) == {"withdrawn": True}
        assert (await plugin.dispatch("late", 64, 10))["instance"] == "a"
        for answered in plugin._answered.values():
            answered.until = 0.0  # as if every answer was told long ago
        plugin.expire_held()
        assert not plugin._answered
        assert plugin.withdraw("late") == {"withdrawn": False}
        assert plugin.status()["instances"][0]["num_pending"] == 1  # "late" still charged
        assert plugin.metrics.dispatches["withdrawn"] == 5  # both of "lost", "held", "used", "behind"

    run_plugin(check)


def test_a_held_request_is_answered_within_half_the_askers_timeout():
    """However long the scheduler would wait for a placement, a held ask is answered well within
    the requester's dispatch timeout, or the requester would take the scheduler for silent."""

    async def check(plugin, scheduler):
        plugin.register("a", 100, 16)
        plugin.ready("a")
        plugin.on_load(load("a", **FULL))
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await plugin.dispatch("r", 64, 10, answer_within=0.2))["instance"] is None
        assert loop.time() - started < 0.2  # half of it, not HOLD_ANSWER

    run_plugin(check)
