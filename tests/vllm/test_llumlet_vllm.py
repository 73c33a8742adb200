"""The llumlet's migration protocol over two real vLLM instances: the same Llumlet code the
sim engine runs, with messages delivered one round per engine step so that copy stages
overlap decoding."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from llumdask.config import load_config
from llumdask.engine.base import TokenOutput
from llumdask.global_scheduler import GlobalScheduler
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.request import Request, SamplingParams
from llumdask.transport import InProcessTransport

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def make_request(request_id: str, prompt_len: int, max_tokens: int, arrival: float = 0.0) -> Request:
    prompt = [10 + (11 * i + len(request_id)) % 450 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival)


class Pair:
    """Two llumlets on a manual clock; tokens recorded as a frontend would see them."""

    def __init__(self, source, destination, **migration) -> None:
        config = load_config()
        config = replace(config, migration=replace(config.migration, **migration))
        self._ticks = itertools.count()
        self.clock = lambda: next(self._ticks) * 0.001
        self.transport = InProcessTransport()
        self.events: list[MigrationEvent] = []
        self.tokens: dict[str, dict[int, int]] = {}
        self.llumlets = {}
        for name, engine in (("src", source), ("dst", destination)):
            llumlet = Llumlet(name, engine, self.transport, config, self.clock, self.on_tokens, self.events.append)
            self.transport.register(name, llumlet.on_message)
            self.llumlets[name] = llumlet

    def on_tokens(self, out: TokenOutput) -> None:
        seen = self.tokens.setdefault(out.request_id, {})
        for offset, token in enumerate(out.token_ids):
            assert seen.setdefault(out.first_index + offset, token) == token

    def sequence(self, request_id: str) -> list[int]:
        seen = self.tokens[request_id]
        assert sorted(seen) == list(range(len(seen)))
        return [seen[i] for i in range(len(seen))]

    def step(self, only: str | None = None) -> None:
        for name, llumlet in self.llumlets.items():
            if (only is None or name == only) and name not in self.transport.dead and llumlet.engine.has_work():
                llumlet.step()
        self.transport.deliver_round()
        for name, llumlet in self.llumlets.items():
            if name not in self.transport.dead:
                llumlet.tick()

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            live = [llumlet for name, llumlet in self.llumlets.items() if name not in self.transport.dead]
            if not any(llumlet.engine.has_work() or llumlet.migrations_in_flight() for llumlet in live):
                return
            self.step()
        raise AssertionError("did not go idle")

    def kinds(self) -> list[MigrationEventKind]:
        return [e.kind for e in self.events]

    def assert_no_leaks(self) -> None:
        for name, llumlet in self.llumlets.items():
            if name in self.transport.dead:
                continue
            llumlet.check_integrity()
            snap = llumlet.engine.snapshot()
            assert snap.free_blocks == snap.total_blocks and snap.reserved_blocks == 0, name


@pytest.fixture(scope="module")
def reference(vllm_engine):
    def tokens(request: Request) -> list[int]:
        vllm_engine.add_request(request)
        while vllm_engine.has_work():
            vllm_engine.step()
        return request.output_token_ids

    return tokens


@pytest.mark.parametrize(("prompt_len", "max_tokens", "steps_before"), [(60, 80, 1), (200, 150, 100), (1000, 60, 5)])
def test_forced_migration_through_the_protocol_keeps_tokens(
    vllm_engine, peer_engine, reference, prompt_len, max_tokens, steps_before
):
    expected = reference(make_request("r", prompt_len, max_tokens))
    pair = Pair(vllm_engine, peer_engine, last_stage_blocks=0)
    pair.llumlets["src"].add_request(make_request("r", prompt_len, max_tokens))
    for _ in range(steps_before):
        pair.step()
    assert pair.llumlets["src"].migrate_out("dst", "r") is not None
    pair.run()
    assert pair.kinds() == [MigrationEventKind.STARTED, MigrationEventKind.COMMITTED]
    assert pair.sequence("r") == expected
    committed = pair.events[-1]
    assert committed.stages >= (2 if prompt_len >= 256 else 1) and committed.bytes > 0
    pair.assert_no_leaks()


def test_destination_out_of_blocks_refuses_and_the_source_finishes(vllm_engine, peer_engine, reference):
    expected = reference(make_request("r", 300, 40))
    assert peer_engine.reserve_blocks("hog", peer_engine.snapshot().free_blocks)
    pair = Pair(vllm_engine, peer_engine)
    pair.llumlets["src"].add_request(make_request("r", 300, 40))
    pair.step()
    pair.llumlets["src"].migrate_out("dst", "r")
    pair.run()
    peer_engine.release_reservation("hog")
    assert pair.kinds() == [MigrationEventKind.STARTED, MigrationEventKind.ABORTED]
    assert "refused" in pair.events[-1].reason
    assert pair.sequence("r") == expected
    pair.assert_no_leaks()


def test_request_finishing_mid_stage_aborts_and_releases(vllm_engine, peer_engine, reference):
    expected = reference(make_request("r", 600, 6))
    pair = Pair(vllm_engine, peer_engine, last_stage_blocks=0)
    pair.llumlets["src"].add_request(make_request("r", 600, 6))
    pair.step()
    pair.llumlets["src"].migrate_out("dst", "r")
    while vllm_engine.has_work():  # the source decodes to the end before any reply
        pair.llumlets["src"].step()
    pair.run()
    assert pair.kinds() == [MigrationEventKind.STARTED, MigrationEventKind.ABORTED]
    assert pair.sequence("r") == expected
    pair.assert_no_leaks()


def test_destination_killed_mid_stage_the_source_continues(vllm_engine, peer_engine, reference):
    expected = reference(make_request("r", 700, 30))
    pair = Pair(vllm_engine, peer_engine, last_stage_blocks=0)
    pair.llumlets["src"].add_request(make_request("r", 700, 30))
    pair.step()
    pair.llumlets["src"].migrate_out("dst", "r")
    pair.step()  # PreAlloc reaches dst, which reserves
    assert peer_engine.snapshot().reserved_blocks > 0
    pair.transport.dead.add("dst")
    pair.llumlets["src"].peer_lost("dst")
    peer_engine_llumlet = pair.llumlets["dst"]
    peer_engine_llumlet.peer_lost("src")  # what a restarted worker's cleanup amounts to here
    pair.run()
    assert pair.kinds()[-1] is MigrationEventKind.ABORTED and "lost" in pair.events[-1].reason
    assert pair.sequence("r") == expected
    pair.transport.dead.clear()
    pair.assert_no_leaks()


def test_source_preemption_mid_stage_aborts_and_the_request_completes(small_engine, vllm_engine):
    # Three blocks of 128 on the source, all taken: "old" (127 tokens) needs a second block two
    # steps on, and the scheduler preempts the later arrival, "r" (200 tokens), mid-stage.
    pair = Pair(small_engine, vllm_engine, last_stage_blocks=0)
    pair.llumlets["src"].add_request(make_request("old", 127, 60, arrival=0.0))
    pair.llumlets["src"].add_request(make_request("r", 200, 60, arrival=1.0))
    pair.step()
    assert small_engine.snapshot().free_blocks == 0 and small_engine.completed_blocks("r") == 1
    assert pair.llumlets["src"].migrate_out("dst", "r") is not None
    for _ in range(40):
        pair.step(only="src")
        if MigrationEventKind.ABORTED in pair.kinds():
            break
    assert pair.events[-1].kind is MigrationEventKind.ABORTED and pair.events[-1].reason == "request preempted"
    pair.run()
    assert len(pair.sequence("r")) == 60 and len(pair.sequence("old")) == 60
    pair.assert_no_leaks()


def test_a_preempted_request_is_handed_over_and_keeps_its_tokens(small_engine, vllm_engine, reference):
    # As above, "old" outgrows the source's three blocks and vLLM preempts "r", which then waits
    # to recompute its prompt and output; taken as waiting it moves without KV and recomputes on
    # the destination.
    expected = reference(make_request("r", 200, 60))
    pair = Pair(small_engine, vllm_engine)
    pair.llumlets["src"].add_request(make_request("old", 127, 60, arrival=0.0))
    pair.llumlets["src"].add_request(make_request("r", 200, 60, arrival=1.0))
    for _ in range(40):
        pair.step()
        if small_engine.get_request("r").timing.preemptions:
            break
    generated = len(small_engine.get_request("r").output_token_ids)
    assert generated > 0 and [w.request_id for w in small_engine.snapshot().waiting] == ["r"]
    assert pair.llumlets["src"].migrate_out("dst", take_waiting=True) is not None
    pair.run()
    assert pair.kinds() == [MigrationEventKind.STARTED, MigrationEventKind.COMMITTED]
    handed = pair.events[-1]
    assert handed.waiting and handed.request_id == "r" and handed.blocks == 0 and handed.bytes == 0
    assert pair.sequence("r") == expected and len(pair.sequence("old")) == 60
    assert vllm_engine.get_request("r") is None and small_engine.get_request("r") is None
    pair.assert_no_leaks()


def test_a_drained_instance_hands_over_what_can_move_and_keeps_a_pinned_request_to_its_end(
    vllm_engine, peer_engine, reference
):
    """The drain an operator or a scale-in orders, as the scheduler's host runs it: every round
    the draining source is paired with a destination and asked for a migrant. A request pinned by
    its sampling (a presence penalty counts what was generated where it runs) is never offered:
    it ends where it is, with its own tokens, and only then is the instance drained."""
    def pinned_request() -> Request:
        request = make_request("pinned", 120, 60)
        return replace(request, sampling=replace(request.sampling, presence_penalty=0.5))

    expected = {"plain": reference(make_request("plain", 200, 150)), "pinned": reference(pinned_request())}
    pair = Pair(vllm_engine, peer_engine)
    src = pair.llumlets["src"]
    scheduler = GlobalScheduler(load_config())
    for name, llumlet in pair.llumlets.items():
        load = llumlet.load_report()
        scheduler.register_instance(name, load.total_blocks, load.block_size, 0.0)
        scheduler.mark_ready(name, 0.0)
    src.add_request(make_request("plain", 200, 150))
    src.add_request(pinned_request())
    for _ in range(5):
        pair.step()
    assert src.load_report().num_pinned == 1
    scheduler.set_terminating("src", pair.clock())
    src.set_terminating(*scheduler.drain_order("src"))
    removed_at, pinned_ended_at, steps = None, None, 0
    while removed_at is None:
        now = pair.clock()
        for llumlet in pair.llumlets.values():
            scheduler.report(llumlet.load_report(), now)
        if "src" in scheduler.scale(now).remove:
            removed_at = steps
        for migration in scheduler.pair_migrations(now):
            assert (migration.source, migration.destination) == ("src", "dst")
            pair.llumlets[migration.source].migrate_out(migration.destination, take_waiting=migration.take_waiting)
        pair.step()
        steps += 1
        if pinned_ended_at is None and len(pair.tokens.get("pinned", {})) == 60:
            pinned_ended_at = steps
        assert steps < 5000, "the drain did not end"
    assert src.load_report().num_pinned == 0 and pinned_ended_at is not None and removed_at >= pinned_ended_at
    assert [(e.kind, e.request_id) for e in pair.events] == [
        (MigrationEventKind.STARTED, "plain"), (MigrationEventKind.COMMITTED, "plain")]
    pair.run()  # the moved request goes on at its destination
    assert {name: pair.sequence(name) for name in expected} == expected
    pair.assert_no_leaks()
