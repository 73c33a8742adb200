"""The plugins' handler wiring on an in-process cluster (distributed's `gen_cluster`): scheduler
and workers share one event loop, so these run in about a second each where a process cluster
takes several. What needs processes (kills, real concurrency) stays in the other modules."""

from __future__ import annotations

import asyncio

import pytest
from distributed.utils_test import gen_cluster

from llumdask.config import load_config
from llumdask.global_scheduler import ClusterOverloaded, NoInstanceAvailable, UnknownInstance
from llumdask.plugins.control import (
    SCHEDULER_TO_WORKER,
    InstanceState,
    MigrationNotStarted,
    NoLlumdaskScheduler,
    Op,
    RequestRejected,
    call,
    refusal,
)
from llumdask.plugins.requester import Requester
from llumdask.plugins.scheduler import LlumnixSchedulerPlugin
from llumdask.plugins.wire import request_to_msg
from llumdask.plugins.worker import LlumletWorkerPlugin
from llumdask.request import Request, SamplingParams

OVERRIDES = {"sim-engine": {"total-blocks": 128}, "migration": {"interval": 60.0}}  # no pairing of its own
SCHEDULER_RPCS = {Op.REGISTER, Op.READY, Op.UNREGISTER, Op.DISPATCH, Op.STATUS, Op.MEMBERS, Op.MIGRATIONS, Op.DRAIN,
                  Op.MIGRATE, Op.ADAPTIVE_TARGET}
WORKER_RPCS = {Op.ADD, Op.ABORT, Op.MIGRATE_OUT, Op.WORKER_STATUS, Op.MIGRATION}


async def install(client, scheduler, overrides: dict = OVERRIDES) -> None:
    """The plugins, and every instance ready."""
    await client.register_plugin(LlumnixSchedulerPlugin(overrides))
    await client.register_plugin(LlumletWorkerPlugin(overrides))
    for _ in range(200):
        rows = (await call(client.scheduler, Op.STATUS))["instances"]
        if len(rows) == len(scheduler.workers) and all(row["ready"] for row in rows):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("instances not ready")


def request(request_id: str, max_tokens: int) -> Request:
    return Request(request_id, [11 + i for i in range(40)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_every_op_is_handled_where_it_is_sent(c, s, a, b):
    await install(c, s)
    assert SCHEDULER_RPCS <= set(s.handlers) and {Op.LOAD, Op.EVENT} <= set(s.stream_handlers)
    for worker in (a, b):
        assert WORKER_RPCS <= set(worker.handlers) and set(SCHEDULER_TO_WORKER) <= set(worker.stream_handlers)
    rows = (await call(c.scheduler, Op.STATUS))["instances"]
    assert {row["instance"] for row in rows} == {a.address, b.address}
    assert {row["state"] for row in rows} <= set(InstanceState)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_request_placed_moved_by_the_operator_and_drained(c, s, a, b):
    await install(c, s)
    requester = Requester(c, load_config().requester)
    try:
        stream = await requester.submit(request("r", 60))
        first = await stream.next_tokens()
        source = requester.holder("r")
        destination = b.address if source == a.address else a.address
        started = await call(c.scheduler, Op.MIGRATE, request_id="r", destination=destination)
        assert started.migration_id.endswith(":r")
        tokens = list(first)
        while batch := await stream.next_tokens():
            tokens += batch
        assert len(tokens) == 60 and stream.sequence.finish_reason is not None
        events = await call(c.scheduler, Op.MIGRATIONS)
        assert [(e["kind"], e["source"], e["destination"]) for e in events] == [("committed", source, destination)]
        assert (await call(c.scheduler, Op.DRAIN, instance=source)).draining
        states = {row["instance"]: row["state"] for row in (await call(c.scheduler, Op.STATUS))["instances"]}
        assert states[source] == InstanceState.TERMINATING
    finally:
        await requester.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_refusals_are_raised_again_where_the_call_was_made(c, s, a, b):
    with pytest.raises(NoLlumdaskScheduler, match="llumnix_status"):
        await call(c.scheduler, Op.STATUS)  # no plugin yet
    await install(c, s)
    with pytest.raises(UnknownInstance, match="zzz"):
        await call(c.scheduler, Op.DRAIN, instance="zzz")
    with pytest.raises(MigrationNotStarted, match="not a ready instance"):
        await call(c.scheduler, Op.MIGRATE, request_id="r", destination="tcp://127.0.0.1:1")
    with pytest.raises(MigrationNotStarted, match="not running"):
        await call(c.scheduler, Op.MIGRATE, request_id="nobody", destination=a.address)
    with pytest.raises(RequestRejected, match="can never"):
        huge = Request("huge", list(range(1, 3000)), SamplingParams(max_tokens=10))
        await call(c.rpc(a.address), Op.ADD, requests=[request_to_msg(huge)], reply_to="tcp://127.0.0.1:1")
    with pytest.raises(RequestRejected, match="malformed"):
        await call(c.rpc(a.address), Op.ADD, requests=[{"request_id": "bad"}], reply_to="tcp://127.0.0.1:1")

    async def received() -> int:
        return next(row["num_received"] for row in (await call(c.scheduler, Op.STATUS))["instances"]
                    if row["instance"] == a.address)

    while await received() < 2:  # both received (as the scheduler counts them on their way), neither runs
        await asyncio.sleep(0.05)
    for worker in (a, b):
        await call(c.scheduler, Op.DRAIN, instance=worker.address)
    with pytest.raises(NoInstanceAvailable):
        await call(c.scheduler, Op.DISPATCH, request_id="r", num_prompt_tokens=4, max_tokens=4)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_hand_over_aborted_before_it_arrived_is_refused_and_counted_received(c, s, a):
    """An add and its abort travel on two connections: where the abort of an unanswered hand-over
    came first, the add, arriving after, must not run unread."""
    await install(c, s)
    worker = c.rpc(a.address)
    assert (await call(worker, Op.ABORT, request_id="r", hand_over="h1")).aborted is False  # nothing here yet
    with pytest.raises(RequestRejected, match="hand-over h1 was aborted"):
        await call(worker, Op.ADD, requests=[request_to_msg(request("r", 8))], reply_to="tcp://127.0.0.1:1",
                   hand_over="h1")
    with pytest.raises(RequestRejected, match="malformed"):
        await call(worker, Op.ADD, requests=[request_to_msg(request("r", 8))], reply_to="tcp://127.0.0.1:1",
                   hand_over=7)
    status = await call(worker, Op.WORKER_STATUS)
    assert status["num_running"] == status["num_waiting"] == 0
    # Another hand-over of the same request (placed again after the abort) is taken.
    assert (await call(worker, Op.ADD, requests=[request_to_msg(request("r", 8))], reply_to="tcp://127.0.0.1:1",
                       hand_over="h2")).accepted

    async def received() -> int:
        return next(row["num_received"] for row in (await call(c.scheduler, Op.STATUS))["instances"])

    while await received() < 3:  # the refused and the malformed ones too: the scheduler's charge settles
        await asyncio.sleep(0.05)


def test_a_refusal_for_load_keeps_its_retry_after_through_a_call():
    class Scheduler:  # what an rpc to the scheduler plugin answers for a refused dispatch
        async def llumnix_dispatch(self, **_: object) -> dict:
            return refusal(ClusterOverloaded("every instance would queue request r", 2.5))

    with pytest.raises(ClusterOverloaded, match="would queue") as refused:
        asyncio.run(call(Scheduler(), Op.DISPATCH, request_id="r"))
    assert refused.value.retry_after == 2.5
    assert "retry_after" not in refusal(ClusterOverloaded("no estimate"))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_admission_by_load_refuses_at_once_and_never_refuses_a_resubmission(c, s, a, b):
    # An admission freeness no instance can keep: every new request is refused for load.
    await install(c, s, {**OVERRIDES, "dispatch": {"admission-freeness": 10_000.0}})
    requester = Requester(c, load_config({"requester": {"placement-timeout": 30.0}}).requester)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ClusterOverloaded, match="every instance would queue"):
            await requester.submit(request("r", 10))
        assert asyncio.get_running_loop().time() - started < 5  # answered, not retried until the timeout
        placed = await call(c.scheduler, Op.DISPATCH, request_id="again", num_prompt_tokens=40, max_tokens=10,
                            admitted=True)
        assert placed.instance in (a.address, b.address)
    finally:
        await requester.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_choices_submitted_together_run_on_one_instance_and_all_or_none(c, s, a, b):
    await install(c, s)
    requester = Requester(c, load_config().requester)
    try:
        streams = await requester.submit_together([request(f"c{i}", 20) for i in range(3)])
        assert len({requester.holder(f"c{i}") for i in range(3)}) == 1
        for stream in streams:
            tokens: list[int] = []
            while batch := await stream.next_tokens():
                tokens += batch
            assert len(tokens) == 20
        # One of them can never fit: the group is refused and the one accepted is aborted.
        never = Request("g1", request("g0", 20).prompt_token_ids, SamplingParams(max_tokens=5000, ignore_eos=True))
        with pytest.raises(RequestRejected, match="can never"):
            await requester.submit_together([request("g0", 2000), never])
        assert requester.holder("g0") is None
        for _ in range(200):
            rows = (await call(c.scheduler, Op.STATUS))["instances"]
            if all(r["num_running"] == r["num_waiting"] == 0 and r["free_blocks"] == r["total_blocks"] for r in rows):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the accepted choice still runs: {rows}")
    finally:
        await requester.close()


def test_concurrent_first_submissions_share_one_token_listener(monkeypatch):
    """A fresh requester's first requests, submitted at once, start one token listener and each
    get every token (each once started a listener of its own, and a stream opened on one of them
    got no tokens: every request was routed to whichever started last)."""
    from llumdask.plugins.streams import TokenListener

    started = []
    start = TokenListener.start

    async def counted(self):
        started.append(self)
        return await start(self)

    monkeypatch.setattr(TokenListener, "start", counted)
    first_submissions(started)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def first_submissions(c, s, a, b, started):
    await install(c, s)
    requester = Requester(c, load_config().requester)
    try:
        streams = await asyncio.gather(*(requester.submit(request(f"r{i}", 20)) for i in range(6)))

        async def drain(stream) -> list[int]:
            tokens: list[int] = []
            while batch := await stream.next_tokens():
                tokens += batch
            return tokens

        received = await asyncio.wait_for(asyncio.gather(*(drain(stream) for stream in streams)), 30)
        assert [len(tokens) for tokens in received] == [20] * 6 and len(started) == 1
    finally:
        await requester.close()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_a_request_its_instance_ended_unseen_is_found_stalled_and_resubmitted(c, s, a, b):
    """An instance that judged the requester unreachable ends its requests there (no token can
    say so); the requester, finding the stream stalled, asks the instance, learns it is gone and
    resubmits it with the tokens received: the stream completes, tokens as an undisturbed run's."""
    from daskhelpers import reference_tokens

    await install(c, s)
    config = load_config({"requester": {"stall-timeout": 0.5, "liveness-interval": 0.1}})
    requester = Requester(c, config.requester)
    try:
        stream = await requester.submit(request("r", 80))
        tokens = list(await stream.next_tokens())
        holder = next(w for w in (a, b) if w.address == requester.holder("r"))
        host = holder.plugins["llumdask"].host
        await host._call(host.driver.drop_requests_of, requester._listener.address)
        while batch := await asyncio.wait_for(stream.next_tokens(), 20):
            tokens += batch
        assert tokens == reference_tokens(load_config(OVERRIDES), request("r", 80).prompt_token_ids, 80,
                                          ignore_eos=True)
        assert requester.resubmissions == 1
    finally:
        await requester.close()
