"""Random interleavings of steps, arrivals, deliveries, migrations (of running and of waiting
requests), timeouts, aborts and a peer failure.

Invariants: every engine's block accounting holds after every rule; at the end no block is leaked
or reserved, every surviving request finished, and its tokens equal the ones it produces alone.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inprocess import InProcessCluster, make_request, reference_tokens, small_config

INSTANCES = ("i0", "i1", "i2")


class MigrationMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.config = small_config(total_blocks=24, handshake_timeout=0.1, max_concurrent=2)
        self.cluster = InProcessCluster(len(INSTANCES), self.config)
        self.specs: dict[str, tuple[int, int]] = {}
        self.aborted: set[str] = set()
        self.lost: set[str] = set()
        self.killed: str | None = None
        # Start with running requests everywhere so that migrations have something to move.
        for index, instance in enumerate(INSTANCES):
            self.arrive(instance, 8 + 7 * index, 40)
        self.step_all_and_deliver(1)

    def _alive(self, instance_id: str) -> bool:
        return instance_id != self.killed

    @rule(instance=st.sampled_from(INSTANCES), prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 60))
    def arrive(self, instance, prompt_len, max_tokens):
        if not self._alive(instance):
            return
        request_id = f"r{len(self.specs)}"
        self.specs[request_id] = (prompt_len, max_tokens)
        self.cluster[instance].add_request(make_request(request_id, prompt_len, max_tokens))

    @rule(instance=st.sampled_from(INSTANCES))
    def step(self, instance):
        llumlet = self.cluster[instance]
        if self._alive(instance) and llumlet.engine.has_work():
            llumlet.step()

    @rule(rounds=st.integers(1, 8))
    def step_all_and_deliver(self, rounds):
        for llumlet in self.cluster.live():
            if llumlet.engine.has_work():
                llumlet.step()
        for _ in range(rounds):
            self.cluster.transport.deliver_round()

    @rule(data=st.data())
    def deliver(self, data):
        pairs = self.cluster.transport.pending_pairs()
        if pairs:
            self.cluster.transport.deliver_one(data.draw(st.sampled_from(sorted(pairs))))

    @rule(data=st.data(), destination=st.sampled_from(INSTANCES), take_waiting=st.booleans())
    def migrate(self, data, destination, take_waiting):
        busy = [l for l in self.cluster.live() if l.engine.snapshot().running or l.engine.snapshot().waiting]
        if busy:
            data.draw(st.sampled_from(busy)).migrate_out(destination, take_waiting=take_waiting)

    @rule(seconds=st.sampled_from([0.01, 0.02, 0.04, 0.15]))
    def advance_clock(self, seconds):
        self.cluster.clock.advance(seconds)
        for llumlet in self.cluster.live():
            llumlet.tick()

    @rule(data=st.data())
    def abort(self, data):
        if not self.specs:
            return
        request_id = data.draw(st.sampled_from(sorted(self.specs)))
        self.aborted.add(request_id)
        for llumlet in self.cluster.live():
            llumlet.abort_request(request_id)

    @precondition(lambda self: self.killed is None)
    @rule(instance=st.sampled_from(INSTANCES))
    def kill(self, instance):
        engine = self.cluster[instance].engine
        self.lost |= {r for r in self.specs if engine.get_request(r) is not None}
        self.killed = instance
        self.cluster.kill(instance)

    @invariant()
    def blocks_accounted(self):
        for llumlet in self.cluster.live():
            llumlet.check_integrity()

    def teardown(self):
        self.cluster.clock.advance(1.0)
        for llumlet in self.cluster.live():
            llumlet.tick()
        self.cluster.transport.deliver_all()
        self.cluster.run_until_idle()
        self.cluster.assert_no_leaks()
        event(f"migrations committed: {min(len(self.cluster.committed()), 3)}+")
        event(f"waiting requests handed over: {min(sum(e.waiting for e in self.cluster.committed()), 2)}+")
        for aborted in self.cluster.aborted():
            event(f"aborted: {aborted.reason.split(':')[0]}")
        event(f"started: {min(sum(e.kind.value == 'started' for e in self.cluster.events), 3)}+")
        for request_id, (prompt_len, max_tokens) in self.specs.items():
            expected = reference_tokens(make_request(request_id, prompt_len, max_tokens), self.config)
            if request_id in self.lost:
                continue
            got = self.cluster.log.sequence(request_id)
            if request_id in self.aborted:
                assert got == expected[: len(got)]
            else:
                assert got == expected, request_id
                assert self.cluster.log.finished.get(request_id, 0) >= 1


TestMigrationMachine = MigrationMachine.TestCase
TestMigrationMachine.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
