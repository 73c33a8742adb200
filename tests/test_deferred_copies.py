"""Stages copied late: a llumlet with `deferred_copies` sends `PendingBlocks`, which its host's
transport copies while the engine goes on stepping. The copy then reads KV after more steps than
the export that chose the blocks; tokens must stay exact and no block may leak on any path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from inprocess import ManualClock, TokenLog, make_request, reference_tokens, small_config
from llumdask.engine.base import PendingBlocks
from llumdask.engine.sim import SimEngine
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.protocol import MigrationMessage, StageData
from llumdask.transport import InProcessTransport


class LateCopies(InProcessTransport):
    """Holds every message until the instances have stepped once more, then copies pending
    stages: what a copy thread racing its engine sees, at its latest."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[tuple[str, str, MigrationMessage]] = []
        self.copied = 0

    def send(self, sender: str, receiver: str, message: MigrationMessage) -> None:
        self._held.append((sender, receiver, message))

    def release(self) -> None:
        held, self._held = self._held, []
        for sender, receiver, message in held:
            if isinstance(message, StageData) and isinstance(message.payload, PendingBlocks):
                message = replace(message, payload=message.payload.copy())
                self.copied += 1
            super().send(sender, receiver, message)

    @property
    def holding(self) -> bool:
        return bool(self._held)


class Pair:
    def __init__(self) -> None:
        self.config = small_config()
        self.clock = ManualClock()
        self.transport = LateCopies()
        self.log = TokenLog()
        self.events: list[MigrationEvent] = []
        self.llumlets = {}
        for name in ("i0", "i1"):
            engine = SimEngine(self.config.sim_engine, block_size=self.config.block_size, clock=self.clock, instance_id=name)
            llumlet = Llumlet(name, engine, self.transport, self.config, self.clock, on_tokens=self.log,
                              on_event=self.events.append, deferred_copies=True)
            self.transport.register(name, llumlet.on_message)
            self.llumlets[name] = llumlet

    def round(self) -> None:
        for llumlet in self.llumlets.values():
            if llumlet.engine.has_work():
                llumlet.step()
        self.clock.advance(0.01)
        self.transport.release()
        self.transport.deliver_all()

    def run_until_idle(self) -> None:
        for _ in range(10_000):
            busy = any(l.engine.has_work() or l.migrations_in_flight() for l in self.llumlets.values())
            if not (busy or self.transport.holding or self.transport.pending_pairs()):
                return
            self.round()
        raise AssertionError("did not go idle")

    def assert_no_leaks(self) -> None:
        for llumlet in self.llumlets.values():
            llumlet.check_integrity()
            snap = llumlet.engine.snapshot()
            assert snap.free_blocks == snap.total_blocks and snap.reserved_blocks == 0

    def kinds(self) -> list[MigrationEventKind]:
        return [e.kind for e in self.events]


@pytest.mark.parametrize(("prompt_len", "steps_before"), [(10, 2), (120, 3), (120, 30)])
def test_stages_copied_after_more_steps_keep_tokens_identical(prompt_len, steps_before):
    pair = Pair()
    pair.llumlets["i0"].add_request(make_request("r", prompt_len, 60))
    for _ in range(steps_before):
        pair.round()
    assert pair.llumlets["i0"].migrate_out("i1", "r") is not None
    pair.run_until_idle()
    assert pair.kinds() == [MigrationEventKind.STARTED, MigrationEventKind.COMMITTED]
    assert pair.transport.copied == pair.events[-1].stages >= 1
    assert pair.log.sequence("r") == reference_tokens(make_request("r", prompt_len, 60))
    pair.assert_no_leaks()


def test_request_finishing_before_its_stage_is_copied_aborts_and_releases():
    pair = Pair()
    pair.llumlets["i0"].add_request(make_request("r", 120, 5))
    pair.round()
    assert pair.llumlets["i0"].migrate_out("i1", "r") is not None
    pair.run_until_idle()
    assert pair.kinds()[-1] is MigrationEventKind.ABORTED and pair.events[-1].reason == "request finished"
    assert pair.log.sequence("r") == reference_tokens(make_request("r", 120, 5))
    pair.assert_no_leaks()


def test_a_later_copy_of_completed_blocks_equals_an_export_now():
    config = small_config()
    engine = SimEngine(config.sim_engine, block_size=config.block_size, clock=ManualClock(), instance_id="i0")
    engine.add_request(make_request("r", 40, 30))
    engine.step()
    done = engine.completed_blocks("r")
    now, pending = engine.export_blocks("r", 0, done), engine.export_later("r", 0, done)
    for _ in range(10):
        engine.step()
    assert pending.nbytes == now.nbytes
    np.testing.assert_array_equal(pending.copy(), now)
