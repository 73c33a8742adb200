"""A tiny in-process cluster for core tests: sim engines + llumlets + InProcessTransport + a manual clock."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.base import TokenOutput
from llumdask.engine.sim import SimEngine
from llumdask.llumlet import Llumlet, MigrationEvent, MigrationEventKind
from llumdask.request import Request, SamplingParams
from llumdask.transport import InProcessTransport


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class TokenLog:
    """What a requester sees: tokens by sequence number, duplicates checked for agreement."""

    tokens: dict[str, dict[int, int]] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)

    def __call__(self, output: TokenOutput) -> None:
        seen = self.tokens.setdefault(output.request_id, {})
        for offset, token in enumerate(output.token_ids):
            index = output.first_index + offset
            assert seen.setdefault(index, token) == token, f"{output.request_id}: token {index} changed"
        if output.finished:
            self.finished[output.request_id] = self.finished.get(output.request_id, 0) + 1

    def sequence(self, request_id: str) -> list[int]:
        seen = self.tokens.get(request_id, {})
        assert sorted(seen) == list(range(len(seen))), f"{request_id}: gap in sequence numbers"
        return [seen[i] for i in range(len(seen))]


def small_config(total_blocks: int = 64, block_size: int = 4, **migration) -> LlumdaskConfig:
    config = load_config()
    return replace(
        config,
        block_size=block_size,
        sim_engine=replace(config.sim_engine, total_blocks=total_blocks, kv_bytes_per_token=16),
        migration=replace(config.migration, **migration),
    )


class InProcessCluster:
    def __init__(self, n: int = 2, config: LlumdaskConfig | None = None) -> None:
        self.config = config or small_config()
        self.clock = ManualClock()
        self.transport = InProcessTransport()
        self.log = TokenLog()
        self.events: list[MigrationEvent] = []
        self.llumlets: dict[str, Llumlet] = {}
        for i in range(n):
            self.add_instance(f"i{i}")

    def add_instance(self, instance_id: str) -> Llumlet:
        engine = SimEngine(self.config.sim_engine, block_size=self.config.block_size, clock=self.clock, instance_id=instance_id)
        llumlet = Llumlet(instance_id, engine, self.transport, self.config, self.clock, on_tokens=self.log, on_event=self.events.append)
        self.transport.register(instance_id, llumlet.on_message)
        self.llumlets[instance_id] = llumlet
        return llumlet

    def __getitem__(self, instance_id: str) -> Llumlet:
        return self.llumlets[instance_id]

    def live(self) -> list[Llumlet]:
        return [l for i, l in self.llumlets.items() if i not in self.transport.dead]

    def step_all(self) -> None:
        for llumlet in self.live():
            if llumlet.engine.has_work():
                llumlet.step()
        self.clock.advance(0.01)
        self.transport.deliver_all()
        for llumlet in self.live():
            llumlet.tick()

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not any(l.engine.has_work() or l.migrations_in_flight() for l in self.live()):
                return
            self.step_all()
        raise AssertionError("cluster did not go idle")

    def kill(self, instance_id: str) -> None:
        self.transport.dead.add(instance_id)
        for llumlet in self.live():
            llumlet.peer_lost(instance_id)

    def assert_no_leaks(self) -> None:
        for llumlet in self.live():
            llumlet.check_integrity()
            snap = llumlet.engine.snapshot()
            if not llumlet.engine.has_work() and not llumlet.migrations_in_flight():
                assert snap.free_blocks == snap.total_blocks, f"{llumlet.instance_id} leaked blocks"
                assert snap.reserved_blocks == 0

    def committed(self) -> list[MigrationEvent]:
        return [e for e in self.events if e.kind is MigrationEventKind.COMMITTED]

    def aborted(self) -> list[MigrationEvent]:
        return [e for e in self.events if e.kind is MigrationEventKind.ABORTED]


def make_request(request_id: str, prompt_len: int = 10, max_tokens: int = 30, arrival: float = 0.0, **kw) -> Request:
    prompt = [zlib.crc32(f"{request_id}:{i}".encode()) % 900 + 10 for i in range(prompt_len)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(request_id, prompt, sampling, arrival_time=arrival)


def reference_tokens(request: Request, config: LlumdaskConfig | None = None) -> list[int]:
    """The tokens a request yields alone on one instance, with no migration."""
    cluster = InProcessCluster(1, config)
    cluster["i0"].add_request(request)
    cluster.run_until_idle()
    return cluster.log.sequence(request.request_id)
