import time
import zlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llumdask.config import SimEngineConfig, load_config
from llumdask.engine.base import Engine, LoadTotals, MigrationRefused, MigrationState
from llumdask.engine.sim import SimEngine
from llumdask.prefix import dispatch_keys
from llumdask.request import FinishReason, Priority, Request, RequestStatus, SamplingParams, blocks_for


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def make_engine():
    """Engines made by a test are checked for block integrity when it ends."""
    made = []

    def make(total_blocks=64, block_size=4, kv_bytes=16, clock=None, **config):
        engine = SimEngine(
            SimEngineConfig(total_blocks=total_blocks, kv_bytes_per_token=kv_bytes, **config),
            block_size=block_size,
            clock=clock or Clock(),
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.check_integrity()


def request(rid, prompt_len=10, max_tokens=20, arrival=0.0, **sampling):
    prompt = [zlib.crc32(f"{rid}:{i}".encode()) % 30000 + 10 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling), arrival_time=arrival)


def run(engine, clock=None, max_steps=10_000):
    """Step until idle, advancing the clock by each step's duration; returns the step results."""
    results = []
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        results.append(engine.step())
        engine.check_integrity()
        if clock is not None:
            clock.now += results[-1].duration
    raise AssertionError("engine did not go idle")


def tokens_by_request(results, so_far=None):
    """Each request's tokens, checking that sequence numbers continue from `so_far` without gaps."""
    seen = {rid: list(tokens) for rid, tokens in (so_far or {}).items()}
    for result in results:
        for out in result.outputs:
            seq = seen.setdefault(out.request_id, [])
            assert out.first_index == len(seq), f"{out.request_id}: index {out.first_index} after {len(seq)} tokens"
            seq.extend(out.token_ids)
    return seen


def reference(make_engine, req, kv_bytes=16, block_size=4):
    """The tokens `req` produces alone on a roomy engine."""
    engine = make_engine(total_blocks=256, block_size=block_size, kv_bytes=kv_bytes)
    engine.add_request(replace_request(req))
    return tokens_by_request(run(engine))[req.request_id]


def replace_request(req):
    return Request(req.request_id, list(req.prompt_token_ids), req.sampling, req.scheduling_priority,
                   req.execution_priority, req.arrival_time)


def test_implements_the_engine_protocol(make_engine):
    assert isinstance(make_engine(), Engine)


def test_from_config_sizes_the_pool_from_the_profile():
    config = load_config()
    engine = SimEngine.from_config(config, clock=Clock())
    assert engine.block_size == 16
    assert engine.total_blocks == 13616 // 16 == 851
    assert engine.profile.name == "llama-7b-a10"
    small = SimEngine.from_config(replace(config, sim_engine=replace(config.sim_engine, total_blocks=10)), clock=Clock())
    assert small.total_blocks == 10


@pytest.mark.parametrize("field, value", [("kv_bytes_per_token", -1), ("vocab_size", 1), ("max_num_seqs", 0)])
def test_bad_engine_config_names_the_field(make_engine, field, value):
    with pytest.raises(ValueError, match=f"sim_engine.{field}"):
        SimEngine(SimEngineConfig(**{field: value}), block_size=16, clock=Clock())


# ---------------------------------------------------------------------------------------------- serving


def test_first_token_comes_from_the_prefill_step_and_timing_uses_the_clock(make_engine):
    clock = Clock()
    clock.now = 5.0
    engine = make_engine(clock=clock)
    req = request("a", prompt_len=10, max_tokens=3)
    engine.add_request(req)
    first = engine.step()
    assert [(o.request_id, o.first_index, len(o.token_ids)) for o in first.outputs] == [("a", 0, 1)]
    assert first.num_prefill_tokens == 10 and first.batch_size == 1
    assert first.duration == pytest.approx(engine.profile.prefill_time([10]))
    assert req.timing.first_scheduled == 5.0
    assert req.timing.first_token == pytest.approx(5.0 + first.duration)
    clock.now += first.duration
    second = engine.step()
    assert second.duration == pytest.approx(engine.profile.decode_time(1, 11))
    clock.now += second.duration
    third = engine.step()
    assert third.outputs[0].finished and third.outputs[0].finish_reason is FinishReason.LENGTH
    assert req.timing.last_token == req.timing.finished == pytest.approx(5.0 + first.duration + second.duration + third.duration)
    assert req.timing.first_token == pytest.approx(5.0 + first.duration)
    assert req.status is RequestStatus.FINISHED and req.num_output_tokens == 3
    assert engine.get_request("a") is None and not engine.has_work()
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_waiting_queue_is_fcfs_by_arrival_not_by_add_order(make_engine):
    engine = make_engine(max_num_seqs=1)
    for rid, arrival in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
        engine.add_request(request(rid, max_tokens=2, arrival=arrival))
    assert [w.request_id for w in engine.snapshot().waiting] == ["a", "b", "c"]
    finished = [o.request_id for r in run(engine) for o in r.outputs if o.finished]
    assert finished == ["a", "b", "c"]


def test_higher_scheduling_priority_is_admitted_first(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request(request("running", max_tokens=3))
    engine.step()
    engine.add_request(request("early", max_tokens=2, arrival=1.0))
    urgent = request("urgent", max_tokens=2, arrival=2.0)
    urgent.scheduling_priority = Priority.HIGH
    engine.add_request(urgent)
    assert [w.request_id for w in engine.snapshot().waiting] == ["urgent", "early"]
    first_tokens = [o.request_id for r in run(engine) for o in r.outputs if o.first_index == 0]
    assert first_tokens == ["urgent", "early"]


def test_admission_waits_until_every_prompt_block_fits(make_engine):
    engine = make_engine(total_blocks=8, block_size=4)
    engine.add_request(request("big", prompt_len=20, max_tokens=2))  # 5 blocks
    engine.step()
    # "big"'s decode takes a 6th block; 2 stay free, "long" needs 4: it waits, and FCFS keeps
    # "short" (1 block, would fit) behind it.
    engine.add_request(request("long", prompt_len=16, max_tokens=2, arrival=1.0))
    engine.add_request(request("short", prompt_len=4, max_tokens=2, arrival=2.0))
    result = engine.step()
    assert [o.request_id for o in result.outputs] == ["big"] and result.num_prefill_tokens == 0
    assert result.outputs[0].finished
    result = engine.step()  # "big" is gone: both fit now, prefilled together
    assert sorted(o.request_id for o in result.outputs) == ["long", "short"]
    assert result.num_prefill_tokens == 20


def test_continuous_batching_joins_a_newcomer_to_running_decodes(make_engine):
    engine = make_engine()
    engine.add_request(request("a", max_tokens=10))
    engine.step()
    engine.step()
    engine.add_request(request("b", prompt_len=7, max_tokens=10))
    result = engine.step()
    assert {(o.request_id, o.first_index) for o in result.outputs} == {("a", 2), ("b", 0)}
    assert result.batch_size == 2 and result.num_prefill_tokens == 7
    assert result.duration == pytest.approx(engine.profile.step_time([(0, 7)], 1, 12))
    assert result.duration < engine.profile.prefill_time([7]) + engine.profile.decode_time(1, 12)  # one forward pass


def test_token_budget_chunks_prefills_as_vllm_v1_does(make_engine):
    engine = make_engine(max_num_batched_tokens=20)
    a = request("a", prompt_len=15, max_tokens=3)
    b = request("b", prompt_len=15, max_tokens=3, arrival=1.0)
    engine.add_request(a)
    engine.add_request(b)
    first = engine.step()
    # "a" takes 15 of the 20 tokens, "b" the remaining 5 as its first chunk: no token for it yet.
    assert [o.request_id for o in first.outputs] == ["a"]
    assert first.num_prefill_tokens == 20 and first.batch_size == 2
    assert first.duration == pytest.approx(engine.profile.chunk_time([(0, 15), (0, 5)]))
    assert b.status is RequestStatus.RUNNING and b.timing.first_scheduled is not None and b.timing.first_token is None
    # Mid-prefill: running and holding the blocks of its chunk, but nothing a migration could move.
    running_b = next(r for r in engine.snapshot().running if r.request_id == "b")
    assert running_b.num_blocks == 2 and not running_b.migratable  # 5 tokens in blocks of 4
    assert engine.completed_blocks("b") == 1
    with pytest.raises(MigrationRefused, match="prefilling"):
        engine.pause("b")
    second = engine.step()
    # Running requests go first: "a"'s decode (1 token), then "b"'s last 10 prompt tokens.
    assert {(o.request_id, o.first_index) for o in second.outputs} == {("a", 1), ("b", 0)}
    assert second.duration == pytest.approx(engine.profile.step_time([(5, 10)], 1, 16))
    results = [first, second] + run(engine)
    engine.check_integrity()
    tokens = tokens_by_request(results)
    for req in (a, b):
        assert tokens[req.request_id] == reference(make_engine, req)  # chunking computes the same KV


def test_the_first_admission_of_a_step_is_chunked_to_the_budget(make_engine):
    clock = Clock()
    engine = make_engine(max_num_batched_tokens=20, clock=clock)
    huge = request("huge", prompt_len=50, max_tokens=2)
    engine.add_request(huge)
    steps = []
    for _ in range(3):
        steps.append(engine.step())
        clock.now += steps[-1].duration
    assert [s.num_prefill_tokens for s in steps] == [20, 20, 10]
    assert [len(s.outputs) for s in steps] == [0, 0, 1]
    # The chunks of one prompt cost what it costs at once, but for the fixed cost of each step.
    chunked = sum(s.duration for s in steps)
    base = engine.profile.prefill.base_s
    assert chunked == pytest.approx(engine.profile.prefill_time([50]) + 2 * base)
    assert huge.timing.first_token == pytest.approx(chunked)
    assert run(engine)[-1].outputs[0].finished
    assert engine.snapshot().free_blocks == engine.total_blocks


@pytest.mark.parametrize("budget", [7, 8, 8192])
def test_kv_content_does_not_depend_on_the_token_budget(make_engine, budget):
    """A chunk in a step where nobody samples writes its KV too: the tokens read it."""
    req = request("r", prompt_len=30, max_tokens=6)
    engine = make_engine(max_num_batched_tokens=budget)
    engine.add_request(replace_request(req))
    assert tokens_by_request(run(engine))["r"] == reference(make_engine, req)


def test_a_prompt_chunked_to_one_token_short_of_its_end_is_still_prefilling(make_engine):
    """Every token but the last has its KV, as when decoding, but no token was sampled yet."""
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request(request("r", prompt_len=9, max_tokens=4))
    engine.step()
    assert [r.migratable for r in engine.snapshot().running] == [False]
    with pytest.raises(MigrationRefused, match="prefilling"):
        engine.pause("r")
    engine.step()
    assert [r.migratable for r in engine.snapshot().running] == [True]


def test_a_failed_forward_pass_leaves_nothing_computed_or_cached(make_engine):
    """The step's KV was never written: counting it computed, or caching its blocks for other
    requests to share, would make later tokens come from garbage."""
    req = request("r", prompt_len=30, max_tokens=6)
    engine = make_engine()
    engine.add_request(replace_request(req))
    write = engine._kv.write

    def broken(*args):
        engine._kv.write = write
        raise RuntimeError("device error")

    engine._kv.write = broken
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    engine.abort_request("r")  # as a llumlet does with the requests of a failed step
    engine.check_integrity()
    engine.add_request(replace_request(req))  # sent again: no cached prefix of it to share
    results = run(engine)
    assert results[0].num_prefill_tokens == 30
    assert tokens_by_request(results)["r"] == reference(make_engine, req)


def test_admission_needs_room_for_the_whole_prompt_not_only_its_first_chunk(make_engine):
    engine = make_engine(total_blocks=8, block_size=4, max_num_batched_tokens=8)
    engine.add_request(request("a", prompt_len=16, max_tokens=4))  # 4 blocks, prefilled in two chunks
    engine.add_request(request("b", prompt_len=20, max_tokens=4, arrival=1.0))  # 5 blocks: never fits beside "a"
    engine.step()
    assert [w.request_id for w in engine.snapshot().waiting] == ["b"]
    assert engine.snapshot().free_blocks == 6  # only "a"'s first chunk took blocks
    run(engine)
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_preemption_recomputes_the_latest_arrival_and_keeps_its_tokens(make_engine):
    clock = Clock()
    engine = make_engine(total_blocks=5, block_size=4, clock=clock)
    early = request("early", prompt_len=8, max_tokens=6, arrival=0.0)  # 2 blocks, needs a 3rd at its first decode
    middle = request("middle", prompt_len=3, max_tokens=6, arrival=1.0)  # 1 block
    late = request("late", prompt_len=7, max_tokens=6, arrival=2.0)  # 2 blocks, its first decode fits
    for req in (early, middle, late):
        engine.add_request(req)
    results = [engine.step()]
    assert engine.snapshot().free_blocks == 0
    # Arrived before "late" but reached the engine after the first step; it would fit once
    # "late" is preempted, yet a preempting step admits nobody.
    tiny = request("tiny", prompt_len=2, max_tokens=3, arrival=0.5)
    engine.add_request(tiny)
    clock.now += results[0].duration
    preempting = engine.step()
    assert preempting.preempted == ("late",)
    assert [o.request_id for o in preempting.outputs] == ["early", "middle"]
    assert preempting.num_prefill_tokens == 0 and tiny.status is RequestStatus.WAITING
    assert late.status is RequestStatus.WAITING and late.timing.preemptions == 1
    assert late.timing.preempted_at == clock.now
    snap = engine.snapshot()
    assert snap.num_preemptions == 1 and [w.request_id for w in snap.waiting] == ["tiny", "late"]
    assert snap.waiting[1].num_tokens == 8  # prompt + its first token: all recomputed
    clock.now += preempting.duration
    results += [preempting] + run(engine, clock)
    recompute = next(r for r in results[2:] if any(o.request_id == "late" for o in r.outputs))
    assert [o.first_index for o in recompute.outputs if o.request_id == "late"] == [1]
    assert recompute.num_prefill_tokens >= 8
    assert late.timing.preempted_at is None
    assert late.timing.preemption_loss > preempting.duration
    tokens = tokens_by_request(results)
    for req in (early, middle, late, tiny):
        assert tokens[req.request_id] == reference(make_engine, req)


def test_a_request_needing_a_block_with_nothing_behind_it_preempts_itself(make_engine):
    engine = make_engine(total_blocks=3, block_size=4)
    req = request("a", prompt_len=8, max_tokens=3)
    engine.add_request(req)
    results = [engine.step()]
    assert engine.reserve_blocks("incoming", 1)
    result = engine.step()
    assert result.preempted == ("a",) and result.outputs == ()
    assert engine.snapshot().free_blocks == 2
    assert not engine.step().outputs  # 9 tokens need 3 blocks: it waits for the reservation
    engine.release_reservation("incoming")
    results += run(engine)
    assert tokens_by_request(results)["a"] == reference(make_engine, req)


@pytest.mark.parametrize("kv_bytes", [16, 0])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 12), st.floats(0, 5, allow_nan=False)), min_size=1, max_size=6
    )
)
def test_any_interleaving_with_preemptions_yields_each_requests_solo_tokens(make_engine, kv_bytes, sampling, specs):
    """A tight pool forces preemptions; recompute must reproduce exactly what each request does alone."""
    engine = make_engine(total_blocks=8, block_size=4, kv_bytes=kv_bytes)
    reqs = [request(f"r{i}", p, m, arrival=a, **sampling) for i, (p, m, a) in enumerate(specs)]
    for req in reqs:
        engine.add_request(req)
    produced = tokens_by_request(run(engine))
    for req in reqs:
        assert produced[req.request_id] == reference(make_engine, req, kv_bytes=kv_bytes)
        assert req.status is RequestStatus.FINISHED
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_stop_token_ends_the_request_and_frees_its_blocks(make_engine):
    plain = reference(make_engine, request("a", max_tokens=20))
    stop = plain[5]
    engine = make_engine()
    req = request("a", max_tokens=20, stop_token_ids=(stop,))
    engine.add_request(req)
    tokens = tokens_by_request(run(engine))["a"]
    assert tokens == plain[: plain.index(stop) + 1]
    assert req.finish_reason is FinishReason.STOP
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_min_tokens_masks_stop_tokens_until_reached(make_engine):
    plain = reference(make_engine, request("a", max_tokens=20))
    stop = plain[2]
    masked = reference(make_engine, request("a", max_tokens=20, stop_token_ids=(stop,), min_tokens=6))
    # Before the 6th token the stop token is replaced by the next id that is not one; what is
    # generated after that replacement follows from it.
    assert masked[:2] == plain[:2] and masked[2] == (stop + 1) % 32000
    assert stop not in masked[:6] and len(masked) >= 6
    assert masked[-1] == stop or len(masked) == 20


def test_min_tokens_migrate_exactly(make_engine):
    plain = reference(make_engine, request("r", max_tokens=30))
    once = reference(make_engine, request("r", max_tokens=30, stop_token_ids=(plain[1],), min_tokens=9))
    # Stop tokens at positions 1 (before the migration) and 5 (after it), both masked.
    stops = (plain[1], once[5])
    req = request("r", max_tokens=30, stop_token_ids=stops, min_tokens=9)
    expected = reference(make_engine, request("r", max_tokens=30, stop_token_ids=stops, min_tokens=9))
    assert expected[:5] == once[:5] and expected[5] != once[5]
    source, destination = make_engine(), make_engine()
    source.add_request(req)
    before = [source.step() for _ in range(4)]
    state = migrate(source, destination, "r")
    assert tokens_by_request(before)["r"] == state.output_token_ids[:4]
    assert tokens_by_request(run(destination), {"r": state.output_token_ids})["r"] == expected


@pytest.mark.parametrize("option", [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                                    {"frequency_penalty": -1.0}, {"logit_bias": {5: 10.0}}, {"allowed_token_ids": (5, 6)}, {"logprobs": 0},
                                    {"prompt_logprobs": 2}, {"thinking_token_budget": 4}], ids=str)
def test_options_that_need_logits_are_refused_by_name(make_engine, option):
    engine = make_engine()
    (name,) = option
    with pytest.raises(ValueError, match=f"sim engine does not model {name}"):
        engine.add_request(request("x", **option))
    engine.add_request(request("y", top_k=5, min_p=0.1))  # filters: accepted, nothing to change
    assert engine.get_request("y") is not None


def test_seeds_and_greedy_are_deterministic_and_distinct(make_engine):
    greedy = reference(make_engine, request("a"))
    assert greedy == reference(make_engine, request("a"))
    seeded = reference(make_engine, request("a", temperature=1.0, seed=1))
    assert seeded == reference(make_engine, request("a", temperature=1.0, seed=1))
    assert seeded != greedy
    assert seeded != reference(make_engine, request("a", temperature=1.0, seed=2))
    assert all(0 <= t < 32000 for t in greedy + seeded)


def test_requests_that_can_never_fit_are_rejected(make_engine):
    engine = make_engine(total_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="'x' can never fit: 10 prompt tokens \\+ max_tokens 7 > capacity 16"):
        engine.add_request(request("x", prompt_len=10, max_tokens=7))
    engine.add_request(request("y", prompt_len=10, max_tokens=6))
    with pytest.raises(ValueError, match="'y' is already here"):
        engine.add_request(request("y"))


def test_abort_frees_blocks_wherever_the_request_is(make_engine):
    engine = make_engine(max_num_seqs=1)
    running, waiting = request("running"), request("waiting", arrival=1.0)
    engine.add_request(running)
    engine.add_request(waiting)
    engine.step()
    engine.abort_request("waiting")
    engine.abort_request("running")
    engine.abort_request("unknown")
    assert running.status is RequestStatus.ABORTED and running.finish_reason is FinishReason.ABORT
    assert waiting.status is RequestStatus.ABORTED
    assert not engine.has_work() and engine.snapshot().free_blocks == engine.total_blocks


def test_snapshot_reports_blocks_tokens_and_paused_requests(make_engine):
    engine = make_engine(max_num_seqs=2)
    high = request("high", prompt_len=9)
    high.execution_priority = Priority.HIGH
    for req in (high, request("n", prompt_len=4, arrival=1.0), request("w", prompt_len=6, arrival=2.0)):
        engine.add_request(req)
    engine.step()
    engine.pause("n")
    snap = engine.snapshot()
    assert snap is engine.snapshot()  # cached until something changes
    loads = {r.request_id: r for r in snap.running}
    assert loads["high"].num_blocks == blocks_for(9, 4) and loads["high"].num_tokens == 10
    assert loads["high"].execution_priority is Priority.HIGH and loads["high"].migratable
    assert not loads["n"].migratable and loads["n"].running
    assert [(w.request_id, w.num_blocks, w.num_tokens, w.running) for w in snap.waiting] == [("w", 0, 6, False)]
    assert snap.free_blocks == engine.total_blocks - 3 - 1


def test_load_totals_sum_running_paused_and_waiting_requests(make_engine):
    engine = make_engine(total_blocks=8, max_num_seqs=2)
    high = request("high", prompt_len=9, max_tokens=20)
    high.execution_priority = Priority.HIGH
    for req in (high, request("n", prompt_len=4, max_tokens=20, arrival=1.0), request("w", prompt_len=6, arrival=2.0)):
        engine.add_request(req)
    engine.step()
    engine.pause("n")
    totals = engine.load_totals()
    # A paused request still holds its blocks: it counts as running.
    assert totals.running_blocks == {Priority.HIGH: 3, Priority.NORMAL: 1}
    assert totals.running_count == {Priority.HIGH: 1, Priority.NORMAL: 1} and totals.num_running == 2
    assert (totals.num_waiting, totals.head_of_line_demand, totals.waiting_demand, totals.pending_prefill_tokens) == (
        1, 2, 2, 6,
    )
    assert (totals.free_blocks, totals.reserved_blocks, totals.num_preemptions) == (4, 0, 0)
    engine.unpause("n")
    # Together they outgrow the 8 blocks: the later arrival "n" is preempted.
    while not engine.step().preempted:
        pass
    totals = engine.load_totals()
    assert totals.num_preemptions == 1 and totals.running_count == {Priority.HIGH: 1}
    # The preempted request waits ahead of "w", and its recompute covers its output too.
    assert [w.request_id for w in engine.snapshot().waiting] == ["n", "w"]
    n_tokens = engine.get_request("n").num_tokens
    assert n_tokens > 4 and totals.head_of_line_demand == blocks_for(n_tokens, 4)
    assert totals.waiting_demand == blocks_for(n_tokens, 4) + 2 and totals.pending_prefill_tokens == n_tokens + 6
    assert totals == LoadTotals.from_snapshot(engine.snapshot())


def test_blocks_a_waiting_request_holds_are_not_counted_again_as_its_demand():
    """A migrant re-added on vLLM waits a step with its copied KV in blocks it holds already."""
    totals = LoadTotals.tally(total_blocks=64, block_size=4, free_blocks=50, reserved_blocks=5,
                              running=[(Priority.NORMAL, 9)], waiting=[(21, 5), (6, 0)], num_preemptions=0)
    # 21 tokens take 6 blocks, 5 of them held: 1 block (and the 1 token past them) to go.
    assert (totals.num_waiting, totals.head_of_line_demand) == (2, 1)
    assert (totals.waiting_demand, totals.pending_prefill_tokens) == (1 + 2, 1 + 6)


# Weighted so that requests pile up and run: pauses, moves and preemptions need running requests.
_TOTALS_KINDS = ("add",) * 3 + ("step",) * 6 + ("abort", "pause", "unpause", "move", "move", "reserve", "release")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(_TOTALS_KINDS), st.integers(0, 30), st.integers(1, 14), st.integers(1, 24), st.booleans()
        ),
        min_size=10,
        max_size=80,
    )
)
def test_load_totals_equal_the_snapshot_recount_on_any_workload(make_engine, ops):
    """Tight pools (preemptions), both priorities, pauses, aborts, reservations and migrations."""
    engines = [make_engine(total_blocks=10, kv_bytes=0, max_num_seqs=3) for _ in range(2)]
    added: list[str] = []
    paused: dict[str, MigrationState] = {}
    for kind, pick, size, max_tokens, high in ops:
        rid = added[pick % len(added)] if added else None
        engine = next((e for e in engines if rid is not None and e.get_request(rid) is not None), None)
        status = engine.get_request(rid).status if engine is not None else None
        if kind == "add":
            req = request(f"r{len(added)}", size, max_tokens, arrival=float(len(added)))
            req.execution_priority = Priority.HIGH if high else Priority.NORMAL
            engines[pick % 2].add_request(req)
            added.append(req.request_id)
        elif kind == "step":
            if engines[pick % 2].step().preempted:
                event("preempted")
        elif kind == "reserve":
            engines[pick % 2].reserve_blocks("stray", size % 5)
        elif kind == "release":
            engines[pick % 2].release_reservation("stray")
        elif engine is None:
            continue
        elif kind == "abort":
            engine.abort_request(rid)
            paused.pop(rid, None)
        elif kind == "pause" and status is RequestStatus.RUNNING and rid not in paused:
            paused[rid] = engine.pause(rid)
            event("paused")
        elif kind == "unpause" and paused.pop(rid, None) is not None:
            engine.unpause(rid)
        elif kind == "move" and status is RequestStatus.RUNNING:
            peer = engines[1 - engines.index(engine)]
            total = blocks_for(engine.get_request(rid).num_tokens, 4)
            if peer.reserve_blocks(f"m-{rid}", total):
                state = paused.pop(rid, None) or engine.pause(rid)
                peer.import_blocks(f"m-{rid}", 0, engine.export_blocks(rid, 0, total))
                peer.resume(f"m-{rid}", state)
                engine.free_migrated(rid)
                event("migrated")
        for e in engines:
            assert e.load_totals() == LoadTotals.from_snapshot(e.snapshot())


def test_real_time_sleeps_the_modelled_duration(make_engine):
    engine = make_engine(real_time=True)
    engine.add_request(request("a", prompt_len=10, max_tokens=2))
    began = time.perf_counter()
    result = engine.step()
    assert time.perf_counter() - began >= result.duration > 0


# ---------------------------------------------------------------------------------------------- migration


def migrate(source, destination, rid, *, steps_between=2, corrupt_block=None, drop_rng=False):
    """Staged copy as the llumlet does it: completed blocks while decoding, then pause and the rest."""
    mid = f"m-{rid}"
    sent = 0
    for _ in range(2):
        done = source.completed_blocks(rid)
        if done > sent:
            assert destination.reserve_blocks(mid, done - sent)
            destination.import_blocks(mid, sent, source.export_blocks(rid, sent, done))
            sent = done
        for _ in range(steps_between):
            source.step()
    state = source.pause(rid)
    total = blocks_for(state.num_tokens, source.block_size)
    assert destination.reserve_blocks(mid, total - sent)
    buffer = source.export_blocks(rid, sent, total)
    destination.import_blocks(mid, sent, buffer)
    if corrupt_block is not None:
        whole = source.export_blocks(rid, 0, total)
        whole[corrupt_block] ^= 0x5A
        destination.import_blocks(mid, 0, whole)
    if drop_rng:
        state.engine_state = {}
    destination.resume(mid, state)
    source.free_migrated(rid)
    return state


@pytest.mark.parametrize("kv_bytes", [16, 0])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 3}], ids=["greedy", "seeded"])
# Paused after 7 tokens: 43 tokens, 42 computed (the last block half full), or 45 tokens, 44 computed
# (11 full blocks; the 12th, where the next token's KV goes, travels as zeros).
@pytest.mark.parametrize("prompt_len", [36, 38])
def test_migrated_request_produces_the_tokens_it_would_have_in_place(make_engine, kv_bytes, sampling, prompt_len):
    req = request("r", prompt_len=prompt_len, max_tokens=40, **sampling)
    expected = reference(make_engine, req, kv_bytes=kv_bytes)
    source, destination = make_engine(kv_bytes=kv_bytes), make_engine(kv_bytes=kv_bytes)
    source.add_request(req)
    source.add_request(request("other", max_tokens=30))
    destination.add_request(request("resident", max_tokens=30))
    before = [source.step() for _ in range(3)]
    state = migrate(source, destination, "r")
    assert "r" not in {r.request_id for r in source.snapshot().running}
    moved = destination.get_request("r")
    assert moved.status is RequestStatus.RUNNING and moved.timing.first_token == req.timing.first_token
    assert tokens_by_request(before)["r"] == state.output_token_ids[:3]
    produced = tokens_by_request(run(destination), {"r": state.output_token_ids})["r"]
    assert produced == expected
    run(source)


def test_unseeded_sampling_continues_from_the_travelling_rng_state(make_engine):
    source, destination, stripped = make_engine(), make_engine(), make_engine()
    source.add_request(request("r", prompt_len=21, max_tokens=40, temperature=1.0))
    for _ in range(3):
        source.step()
    state = source.pause("r")
    mid_blocks = blocks_for(state.num_tokens, 4)
    for engine, engine_state in ((destination, state.engine_state), (stripped, {})):
        assert engine.reserve_blocks("m", mid_blocks)
        engine.import_blocks("m", 0, source.export_blocks("r", 0, mid_blocks))
        engine.resume("m", replace(state, engine_state=engine_state))
    source.unpause("r")  # the source's own continuation is the reference
    so_far = {"r": state.output_token_ids}
    in_place = tokens_by_request(run(source), so_far)["r"]
    assert tokens_by_request(run(destination), so_far)["r"] == in_place
    assert tokens_by_request(run(stripped), so_far)["r"] != in_place


def test_a_corrupted_block_changes_later_tokens(make_engine):
    """Negative control: the output really depends on the migrated KV bytes."""
    req = request("r", prompt_len=37, max_tokens=40)
    expected = reference(make_engine, req)
    source, destination = make_engine(), make_engine()
    source.add_request(req)
    source.step()
    state = migrate(source, destination, "r", corrupt_block=3)
    produced = tokens_by_request(run(destination), {"r": state.output_token_ids})["r"]
    assert produced[: len(state.output_token_ids)] == expected[: len(state.output_token_ids)]
    assert produced != expected


def test_a_missing_block_changes_later_tokens(make_engine):
    req = request("r", prompt_len=37, max_tokens=40)
    expected = reference(make_engine, req)
    source, destination = make_engine(), make_engine()
    source.add_request(req)
    source.step()
    state = source.pause("r")
    total = blocks_for(state.num_tokens, 4)
    assert destination.reserve_blocks("m", total)
    destination.import_blocks("m", 0, source.export_blocks("r", 0, 2))
    destination.import_blocks("m", 3, source.export_blocks("r", 3, total))  # block 2 never arrives
    destination.resume("m", state)
    source.free_migrated("r")
    produced = tokens_by_request(run(destination), {"r": state.output_token_ids})["r"]
    assert produced != expected


def test_content_free_mode_moves_only_sizes(make_engine):
    source = make_engine(kv_bytes=0)
    source.add_request(request("r", prompt_len=30))
    source.step()
    buffer = source.export_blocks("r", 0, source.completed_blocks("r"))
    assert buffer.shape == (7, 4, 0) and buffer.nbytes == 0
    source.abort_request("r")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}])
def test_content_free_tokens_do_not_depend_on_the_batch_size(make_engine, sampling):
    # Small batches sample in Python integers, large ones in numpy: the tokens must agree.
    alone = make_engine(kv_bytes=0)
    crowd = make_engine(kv_bytes=0, total_blocks=1024)
    reqs = [request(f"r{k}", prompt_len=5 + k, max_tokens=6, **sampling) for k in range(40)]
    alone.add_request(replace_request(reqs[3]))
    for req in reqs:
        crowd.add_request(req)
    assert max(r.batch_size for r in run(crowd)) == 40
    assert tokens_by_request(run(alone))["r3"] == reqs[3].output_token_ids


def test_pause_and_unpause_continue_identically(make_engine):
    req = request("r", prompt_len=13, max_tokens=25)
    expected = reference(make_engine, req)
    engine = make_engine()
    engine.add_request(req)
    engine.add_request(request("other", max_tokens=30))
    results = [engine.step(), engine.step()]
    engine.pause("r")
    with pytest.raises(MigrationRefused, match="not in the running batch"):
        engine.pause("r")
    paused_steps = [engine.step() for _ in range(3)]
    assert all(o.request_id != "r" for r in paused_steps for o in r.outputs)
    (load,) = [r for r in engine.snapshot().running if r.request_id == "r"]
    assert load.num_blocks == blocks_for(13 + 2 - 1, 4) and not load.migratable  # blocks kept
    engine.unpause("r")
    results += paused_steps + run(engine)
    assert tokens_by_request(results)["r"] == expected


def test_paused_export_pads_the_block_of_the_next_token_with_zeros(make_engine):
    engine = make_engine()
    engine.add_request(request("r", prompt_len=12))
    engine.step()  # 13 tokens, 12 computed: three full blocks
    engine.pause("r")
    assert engine.export_blocks("r", 0, 4).shape == (4, 4, 16)
    tail = engine.export_blocks("r", 2, 4)
    assert np.array_equal(tail[0], engine.export_blocks("r", 2, 3)[0]) and tail[0].any()
    assert not tail[1].any()
    engine.unpause("r")


def test_rollback_calls_tolerate_an_aborted_request_but_not_a_running_one(make_engine):
    engine = make_engine()
    engine.add_request(request("r"))
    engine.step()
    with pytest.raises(MigrationRefused, match="not paused"):
        engine.unpause("r")
    with pytest.raises(MigrationRefused, match="not paused"):
        engine.free_migrated("r")
    engine.pause("r")
    engine.abort_request("r")
    engine.unpause("r")
    engine.free_migrated("r")
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_export_refuses_incomplete_blocks_while_running(make_engine):
    engine = make_engine()
    engine.add_request(request("r", prompt_len=10))
    engine.step()
    assert engine.completed_blocks("r") == 2  # 10 computed slots, blocks of 4
    with pytest.raises(ValueError, match="cannot export blocks \\[0, 3\\)"):
        engine.export_blocks("r", 0, 3)
    engine.pause("r")
    assert engine.export_blocks("r", 0, 3).shape == (3, 4, 16)
    with pytest.raises(MigrationRefused, match="no request 'gone'"):
        engine.export_blocks("gone", 0, 1)
    engine.unpause("r")


def test_release_reservation_frees_reserved_and_imported_blocks(make_engine):
    source, destination = make_engine(), make_engine(total_blocks=10)
    source.add_request(request("r", prompt_len=30))
    source.step()
    assert destination.reserve_blocks("m", 4)
    assert destination.reserve_blocks("m", 3)
    assert not destination.reserve_blocks("m", 4)
    destination.import_blocks("m", 0, source.export_blocks("r", 0, 4))
    assert destination.snapshot().reserved_blocks == 7 and destination.snapshot().free_blocks == 3
    destination.release_reservation("m")
    destination.release_reservation("m")
    snap = destination.snapshot()
    assert snap.reserved_blocks == 0 and snap.free_blocks == snap.total_blocks
    with pytest.raises(MigrationRefused, match="no reservation"):
        destination.import_blocks("m", 0, source.export_blocks("r", 0, 1))
    source.abort_request("r")


def test_destination_refuses_bad_buffers_and_short_reservations(make_engine):
    source, destination = make_engine(), make_engine()
    source.add_request(request("r", prompt_len=30))
    source.step()
    state = source.pause("r")
    assert destination.reserve_blocks("m", 2)
    with pytest.raises(MigrationRefused, match="outside the 2 reserved"):
        destination.import_blocks("m", 1, source.export_blocks("r", 0, 2))
    with pytest.raises(MigrationRefused, match="expected uint8 blocks of shape \\(n, 4, 16\\)"):
        destination.import_blocks("m", 0, np.zeros((1, 4, 8), dtype=np.uint8))
    with pytest.raises(MigrationRefused, match="reserved 2 blocks, request 'r' needs 8"):
        destination.resume("m", state)
    destination.release_reservation("m")
    source.unpause("r")
    run(source)


# ------------------------------------------------------------------ prefix caching
def with_prefix(rid, prefix, own_len, max_tokens=6, arrival=0.0):
    """A request whose prompt is `prefix` followed by `own_len` tokens of its own."""
    own = request(rid, prompt_len=own_len).prompt_token_ids
    return Request(rid, list(prefix) + own, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def test_a_cached_prefix_is_shared_not_prefilled_again_and_tokens_stay_exact(make_engine):
    engine = make_engine(total_blocks=32, block_size=4)
    prefix = request("system", prompt_len=32).prompt_token_ids  # 8 full blocks
    first = with_prefix("first", prefix, 8, max_tokens=20)
    engine.add_request(first)
    results = [engine.step()]
    assert results[0].outputs[0].cached_tokens == 0 and results[0].num_prefill_tokens == 40
    free_before = engine.snapshot().free_blocks
    second = with_prefix("second", prefix, 6)  # 38 tokens: 8 cached blocks, 6 tokens to compute
    engine.add_request(second)
    joined = engine.step()
    assert joined.num_prefill_tokens == 6
    assert next(o for o in joined.outputs if o.request_id == "second").cached_tokens == 32
    # While "first" holds the prefix, "second" takes blocks only for its own tokens.
    assert free_before - engine.snapshot().free_blocks == 2 + 1  # second's own 2 blocks, first's 11th for its decode
    results += [joined] + run(engine)
    tokens = tokens_by_request(results)
    assert tokens["second"] == reference(make_engine, second) and tokens["first"] == reference(make_engine, first)
    assert second.timing.cached_tokens == 32


def test_a_blocked_queue_head_finds_a_prefix_cached_after_it_was_first_looked_up(make_engine):
    """The head that did not fit is looked up again only once the cache changed: a prefix cached
    since (here by the request ahead of it, in the same step) lets it in by sharing."""
    engine = make_engine(total_blocks=10, block_size=4)
    shared = request("a", prompt_len=24).prompt_token_ids
    engine.add_request(Request("a", shared, SamplingParams(max_tokens=8)))
    engine.add_request(Request("b", shared[:20] + [7, 8, 9, 10], SamplingParams(max_tokens=2), arrival_time=1.0))
    engine.step()  # "a" takes 6 of 10 blocks; "b" needs 6 of its own: it waits
    assert [w.request_id for w in engine.snapshot().waiting] == ["b"]
    engine.step()  # "a"'s 5 full prompt blocks are cached now: "b" shares them and needs 1
    assert [w.request_id for w in engine.snapshot().waiting] == []
    assert engine.get_request("b").timing.cached_tokens == 20


def test_a_fully_cached_prompt_still_computes_its_last_token(make_engine):
    engine = make_engine(block_size=4)
    prompt = request("p", prompt_len=41).prompt_token_ids
    engine.add_request(Request("a", list(prompt), SamplingParams(max_tokens=3)))
    results = run(engine)
    again = Request("b", list(prompt), SamplingParams(max_tokens=3))
    engine.add_request(again)
    step = engine.step()
    assert step.outputs[0].cached_tokens == 40 and step.num_prefill_tokens == 0  # one token: priced as a decode
    assert tokens_by_request(results + [step] + run(engine))["b"] == tokens_by_request(results)["a"]


def test_a_preempted_request_recomputes_only_what_was_evicted(make_engine):
    clock = Clock()
    engine = make_engine(total_blocks=12, block_size=4, clock=clock)
    early = request("early", prompt_len=20, max_tokens=12)  # 5 blocks, grows to 8
    late = request("late", prompt_len=22, max_tokens=12, arrival=1.0)  # 6 blocks
    engine.add_request(early)
    engine.add_request(late)
    results = []
    while not late.timing.preemptions:
        results.append(engine.step())
        clock.now += results[-1].duration
    # Its 5 full blocks (20 of its prompt's tokens) stay cached while free: the recompute hits them.
    recompute = None
    while late.status is not RequestStatus.FINISHED:
        results.append(engine.step())
        clock.now += results[-1].duration
        if recompute is None and late.status is RequestStatus.RUNNING:
            recompute = results[-1]
    assert 0 < recompute.num_prefill_tokens < late.num_prompt_tokens
    results += run(engine, clock)
    tokens = tokens_by_request(results)
    assert tokens["late"] == reference(make_engine, late) and tokens["early"] == reference(make_engine, early)


def test_without_prefix_caching_nothing_is_shared_or_reported(make_engine):
    engine = make_engine(prefix_caching=False)
    prompt = request("p", prompt_len=20).prompt_token_ids
    for rid in ("a", "b"):
        engine.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=3)))
        step = engine.step()
        assert step.num_prefill_tokens == 20 and step.outputs[0].cached_tokens is None
    run(engine)
    assert engine.prefix_events() is None


@pytest.mark.parametrize("kv_bytes", [16, 0])
def test_a_request_sharing_its_prefix_migrates_exactly_and_its_blocks_are_cached_at_the_destination(make_engine, kv_bytes):
    prefix = request("system", prompt_len=24).prompt_token_ids
    mover = with_prefix("mover", prefix, 10, max_tokens=30)
    expected = reference(make_engine, mover, kv_bytes=kv_bytes)
    source, destination = make_engine(kv_bytes=kv_bytes), make_engine(kv_bytes=kv_bytes)
    source.add_request(with_prefix("stayer", prefix, 3, max_tokens=30))
    source.step()
    source.add_request(mover)
    before = [source.step() for _ in range(3)]
    assert before[0].outputs[-1].cached_tokens == 24
    state = migrate(source, destination, "mover")
    produced = tokens_by_request(run(destination), {"mover": state.output_token_ids})["mover"]
    assert produced == expected
    # The migrated blocks are the destination's cache now: a newcomer with the prefix hits them.
    newcomer = with_prefix("newcomer", prefix, 5)
    destination.add_request(newcomer)
    run(destination)
    assert newcomer.timing.cached_tokens == 24
    run(source)


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_the_same_salt(make_engine):
    """vLLM's cache_salt: a prompt is found cached only under its own salt (or, unsalted, among
    the unsalted); the salt decides where blocks may be shared, never the tokens."""
    engine = make_engine(total_blocks=64, block_size=16)
    prompt = request("p", prompt_len=140).prompt_token_ids  # 8 full blocks, the last an anchor
    cached, tokens = {}, {}
    for rid, salt in (("plain", None), ("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b"), ("plain2", None)):
        req = Request(rid, list(prompt), SamplingParams(max_tokens=4), cache_salt=salt)
        engine.add_request(req)
        tokens.update(tokens_by_request(run(engine)))
        cached[rid] = req.timing.cached_tokens
    assert cached == {"plain": 0, "a1": 0, "a2": 128, "b1": 0, "plain2": 128}
    assert len(set(map(tuple, tokens.values()))) == 1  # every salt, the same tokens
    stored = set(engine.prefix_events().stored)
    for salt in (None, "tenant-a", "tenant-b"):
        assert set(dispatch_keys(prompt, 16, salt)) <= stored  # what the requester sends for that salt
    assert len({dispatch_keys(prompt, 16, salt) for salt in (None, "tenant-a", "tenant-b")}) == 3


def test_a_migrant_reuses_only_the_destinations_blocks_cached_under_its_salt(make_engine):
    destination = make_engine(total_blocks=64, block_size=16)
    prompt = request("p", prompt_len=70).prompt_token_ids  # 4 full blocks
    destination.add_request(Request("there", list(prompt), SamplingParams(max_tokens=3), cache_salt="tenant-a"))
    run(destination)
    tokens = prompt[:64]
    assert destination.reserve_cached("other-salt", tokens, "tenant-b") == 0
    assert destination.reserve_cached("unsalted", tokens) == 0
    assert destination.reserve_cached("same-salt", tokens, "tenant-a") == 4
    for migration_id in ("other-salt", "unsalted", "same-salt"):
        destination.release_reservation(migration_id)
    assert destination.snapshot().free_blocks == destination.total_blocks
