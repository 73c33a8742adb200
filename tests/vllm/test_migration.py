"""Live migration of a running request between two real vLLM instances, driven primitive by
primitive (the llumlet's protocol is tested on its own): staged copies while the request
decodes, a paused last stage, resume on the destination, and the rollback paths."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from llumdask.engine.base import MigrationRefused, TokenLogprob, TokenOutput
from llumdask.request import Priority, Request, SamplingParams, blocks_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def make_request(request_id: str, prompt_len: int, max_tokens: int, **sampling) -> Request:
    prompt = [10 + (5 * i + 3) % 400 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def step(engine, streams: dict[str, list[TokenOutput]]):
    result = engine.step()
    for out in result.outputs:
        streams.setdefault(out.request_id, []).append(out)
    engine.check_integrity()
    return result


def drain(engine, streams: dict[str, list[TokenOutput]]) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        step(engine, streams)
    raise AssertionError("engine still busy")


def received_tokens(streams: list[dict[str, list[TokenOutput]]], request_id: str) -> list[int]:
    """What a frontend shows: order by index, drop duplicates, insist on no gap."""
    by_index: dict[int, int] = {}
    for stream in streams:
        for out in stream.get(request_id, []):
            for offset, token in enumerate(out.token_ids):
                by_index.setdefault(out.first_index + offset, token)
    assert sorted(by_index) == list(range(len(by_index)))
    return [by_index[i] for i in range(len(by_index))]


@pytest.fixture(scope="module")
def reference(vllm_engine) -> dict[tuple[int, int], list[int]]:
    """Unmigrated greedy outputs, keyed by (prompt length, max tokens)."""
    outputs = {}
    for prompt_len, max_tokens in [(100, 300), (300, 200), (1000, 120)]:
        request = make_request(f"ref-{prompt_len}", prompt_len, max_tokens)
        vllm_engine.add_request(request)
        drain(vllm_engine, {})
        outputs[(prompt_len, max_tokens)] = request.output_token_ids
    return outputs


def migrate(source, destination, request_id: str, migration_id: str, decode_between: int, streams, zero=False):
    """Stage completed blocks while decoding goes on (one stage per `decode_between` steps),
    then pause, copy the tail, resume. Returns (stages, destination's first StepResult)."""
    sent = stages = 0
    while source.completed_blocks(request_id) > sent and stages < 4:
        end = source.completed_blocks(request_id)
        assert destination.reserve_blocks(migration_id, end - sent)
        buffer = source.export_blocks(request_id, sent, end)
        destination.import_blocks(migration_id, sent, np.zeros_like(buffer) if zero else buffer)
        sent, stages = end, stages + 1
        for _ in range(decode_between):
            step(source, streams[0])
    state = source.pause(request_id)
    total = blocks_for(state.num_tokens, source.block_size)
    assert destination.reserve_blocks(migration_id, total - sent)
    buffer = source.export_blocks(request_id, sent, total)
    destination.import_blocks(migration_id, sent, np.zeros_like(buffer) if zero else buffer)
    destination.resume(migration_id, state)
    source.free_migrated(request_id)
    return stages + 1, step(destination, streams[1])


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "decode_before", "decode_between"),
    [(100, 300, 3, 0), (100, 300, 150, 40), (300, 200, 190, 2), (1000, 120, 60, 20)],
    ids=["early", "mid-staged", "near-the-end", "long-prompt"],
)
def test_migrated_request_continues_with_identical_tokens(
    vllm_engine, peer_engine, reference, prompt_len, max_tokens, decode_before, decode_between
):
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams = ({}, {})
    request = make_request("mig", prompt_len, max_tokens)
    vllm_engine.add_request(request)
    for _ in range(decode_before):
        step(vllm_engine, streams[0])
    stages, first = migrate(vllm_engine, peer_engine, "mig", f"m-{prompt_len}-{decode_before}", decode_between, streams)
    # The destination computed one token (the last sampled one); the rest of the KV was copied.
    assert first.num_prefill_tokens == 1 and first.batch_size == 1
    # The request counts the move (it may have finished in that first step at the destination).
    moved = peer_engine.get_request("mig") or next(r for r in first.finished if r.request_id == "mig")
    assert (moved.timing.migrations, request.timing.migrations) == (1, 0)
    assert vllm_engine.get_request("mig") is None
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    assert received_tokens(list(streams), "mig") == reference[(prompt_len, max_tokens)]
    assert stages >= (2 if decode_between else 1)
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_a_migrant_waiting_for_its_first_step_counts_its_copied_kv_once(vllm_engine, peer_engine, reference):
    """Re-added on vLLM, a migrant waits for a step with its KV in reserved blocks: they are taken,
    and its demand is only what it still needs (counted again, the destination looked a whole
    sequence fuller to the scheduler and to its own check of a next migrant)."""
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams = ({}, {})
    vllm_engine.add_request(make_request("once", 300, 200))
    for _ in range(20):
        step(vllm_engine, streams[0])
    state = vllm_engine.pause("once")
    block_size = peer_engine.block_size
    total = blocks_for(state.num_tokens, block_size)
    assert peer_engine.reserve_blocks("m-once", total)
    peer_engine.import_blocks("m-once", 0, vllm_engine.export_blocks("once", 0, total))
    peer_engine.resume("m-once", state)
    vllm_engine.free_migrated("once")
    full = (state.num_tokens - 1) // block_size
    totals = peer_engine.load_totals()
    assert (totals.num_waiting, totals.reserved_blocks) == (1, full)
    assert totals.head_of_line_demand == totals.waiting_demand == total - full
    assert totals.pending_prefill_tokens == state.num_tokens - full * block_size
    (load,) = peer_engine.snapshot().waiting
    assert load.num_blocks == full and not load.migratable
    peer_engine.check_integrity()
    assert step(peer_engine, streams[1]).num_prefill_tokens == 1
    assert peer_engine.load_totals().waiting_demand == 0
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    assert received_tokens(list(streams), "once") == reference[(300, 200)]
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_kv_ending_on_a_block_boundary_is_settled_after_a_move_and_after_a_rollback(vllm_engine, peer_engine):
    """A prompt of 237 tokens and 20 steps: 256 tokens of KV, two whole blocks that the re-added
    request finds as cached prefix, with nothing left to load. Its reservation (after a move) and
    its held blocks (after a rollback) still go back once it runs."""
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams = ({}, {})
    unmoved = make_request("aligned-ref", 237, 40)
    vllm_engine.add_request(unmoved)
    drain(vllm_engine, {})
    for request_id in ("aligned-move", "aligned-back"):
        vllm_engine.add_request(make_request(request_id, 237, 40))
    for _ in range(20):
        step(vllm_engine, streams[0])
    rolled_back = vllm_engine.pause("aligned-back")
    assert rolled_back.num_tokens == vllm_engine.get_request("aligned-move").num_tokens == 257
    vllm_engine.unpause("aligned-back")
    # Waiting to run again, it holds its two whole blocks: 1 block to go, and it is not handed over.
    (waiting,) = vllm_engine.snapshot().waiting
    assert waiting.num_blocks == 2 and not waiting.migratable
    assert (vllm_engine.load_totals().waiting_demand, vllm_engine.load_totals().reserved_blocks) == (1, 2)
    with pytest.raises(MigrationRefused, match="not waiting without blocks"):
        vllm_engine.pause("aligned-back", waiting=True)
    _, first = migrate(vllm_engine, peer_engine, "aligned-move", "m-aligned", 0, streams)
    assert first.num_prefill_tokens == 1
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    for request_id in ("aligned-move", "aligned-back"):
        assert received_tokens(list(streams), request_id) == unmoved.output_token_ids
    assert (vllm_engine.snapshot().reserved_blocks, peer_engine.snapshot().reserved_blocks) == (0, 0)
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_zeroed_kv_changes_the_output(vllm_engine, peer_engine, reference):
    """Negative control: the destination really attends over the copied KV."""
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams = ({}, {})
    vllm_engine.add_request(make_request("zero", 300, 200))
    for _ in range(20):
        step(vllm_engine, streams[0])
    migrate(vllm_engine, peer_engine, "zero", "m-zero", 0, streams, zero=True)
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free
    tokens = received_tokens(list(streams), "zero")
    assert len(tokens) == 200
    assert tokens[:20] == reference[(300, 200)][:20]
    assert tokens[20:] != reference[(300, 200)][20:]


def test_unpause_rolls_back_to_identical_tokens(vllm_engine, reference):
    free = vllm_engine.snapshot().free_blocks
    streams: dict[str, list[TokenOutput]] = {}
    vllm_engine.add_request(make_request("rb", 300, 200))
    for _ in range(50):
        step(vllm_engine, streams)
    vllm_engine.pause("rb")
    # Out of vLLM's batch, its blocks held for the copy: still counted as running, not migratable.
    snap = vllm_engine.snapshot()
    (load,) = [r for r in snap.running if r.request_id == "rb"]
    assert load.num_blocks == blocks_for(300 + 50 - 1, vllm_engine.block_size) and not load.migratable
    assert snap.reserved_blocks == 0
    assert vllm_engine.load_totals().running_blocks == {Priority.NORMAL: load.num_blocks}
    vllm_engine.check_integrity()
    vllm_engine.unpause("rb")
    # Waiting to run again, it holds the two whole blocks its first step takes as cached prefix
    # (its partly filled third is written into a new block): one block to go.
    # Its three blocks are taken (reserved: no longer a paused request's) until it runs.
    (waiting,) = vllm_engine.snapshot().waiting
    totals = vllm_engine.load_totals()
    assert waiting.num_blocks == 2 and (totals.waiting_demand, totals.reserved_blocks) == (1, 3)
    first = step(vllm_engine, streams)
    assert first.num_prefill_tokens == 1
    drain(vllm_engine, streams)
    assert received_tokens([streams], "rb") == reference[(300, 200)]
    assert vllm_engine.snapshot().free_blocks == free


def test_refused_and_released_reservations_leak_nothing(vllm_engine, peer_engine):
    free = peer_engine.snapshot().free_blocks
    assert not peer_engine.reserve_blocks("too-big", free + 1)
    assert peer_engine.reserve_blocks("half", 3)
    assert peer_engine.snapshot().free_blocks == free - 3
    assert peer_engine.snapshot().reserved_blocks == 3
    peer_engine.check_integrity()
    peer_engine.release_reservation("half")
    peer_engine.release_reservation("half")  # idempotent
    assert peer_engine.snapshot().free_blocks == free
    with pytest.raises(MigrationRefused, match="no reservation"):
        peer_engine.import_blocks("half", 0, np.zeros((1, 1, 1, 1), dtype=np.uint8))


def test_request_finishing_mid_migration_releases_everything(vllm_engine, peer_engine):
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams: dict[str, list[TokenOutput]] = {}
    vllm_engine.add_request(make_request("fin", 300, 12))
    for _ in range(5):
        step(vllm_engine, streams)
    n = vllm_engine.completed_blocks("fin")
    assert peer_engine.reserve_blocks("m-fin", n)
    peer_engine.import_blocks("m-fin", 0, vllm_engine.export_blocks("fin", 0, n))
    drain(vllm_engine, streams)  # finishes before the last stage
    assert vllm_engine.get_request("fin") is None and vllm_engine.completed_blocks("fin") == 0
    with pytest.raises(MigrationRefused):
        vllm_engine.pause("fin")
    peer_engine.release_reservation("m-fin")
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_aborting_a_paused_request_frees_its_blocks(vllm_engine):
    free = vllm_engine.snapshot().free_blocks
    vllm_engine.add_request(make_request("gone", 300, 100))
    for _ in range(3):
        vllm_engine.step()
    vllm_engine.pause("gone")
    vllm_engine.abort_request("gone")
    drain(vllm_engine, {})
    assert vllm_engine.snapshot().free_blocks == free and vllm_engine.snapshot().reserved_blocks == 0


def test_seeded_random_sampling_is_refused_on_the_cpu_and_pinned_elsewhere(vllm_engine):
    from llumdask.engine.vllm.engine import migration_refusal

    seeded = make_request("seeded", 20, 50, temperature=0.8, seed=7)
    with pytest.raises(ValueError, match="cannot run seeded random sampling"):
        vllm_engine.add_request(seeded)
    assert vllm_engine.get_request("seeded") is None
    # On a GPU it runs, and stays where it runs: its generator would restart from the seed.
    assert "seed" in migration_refusal(seeded, True)
    assert migration_refusal(make_request("greedy", 20, 50, seed=7), True) == ""


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_resume_adopts_the_imported_full_blocks(vllm_engine, peer_engine, cache_salt):
    """Zero copy: the resumed request's block table starts with the very blocks the
    destination reserved and imported into (a prefix-cache hit, under the request's cache salt
    too); only the partial tail block is written anew, and no block is held beyond the request's own."""
    from llumdask.engine.vllm import internals

    streams = ({}, {})
    # A prompt no other test uses: a block the destination cached earlier under the same hash
    # would serve the prefix hit instead (equally correct, but not the blocks checked here).
    prompt = [10 + (13 * i + 7) % 450 for i in range(1000)]
    vllm_engine.add_request(Request("adopt", prompt, SamplingParams(max_tokens=40, ignore_eos=True), cache_salt=cache_salt))
    for _ in range(10):
        step(vllm_engine, streams[0])
    n = vllm_engine.completed_blocks("adopt")
    assert n == (1000 + 10 - 1) // vllm_engine.block_size
    assert peer_engine.reserve_blocks("m-adopt", n)
    peer_engine.import_blocks("m-adopt", 0, vllm_engine.export_blocks("adopt", 0, n))
    imported = [b.block_id for b in peer_engine._reservations["m-adopt"]]
    state = vllm_engine.pause("adopt")
    total = blocks_for(state.num_tokens, vllm_engine.block_size)
    assert peer_engine.reserve_blocks("m-adopt", total - n)
    peer_engine.import_blocks("m-adopt", n, vllm_engine.export_blocks("adopt", n, total))
    peer_engine.resume("m-adopt", state)
    vllm_engine.free_migrated("adopt")
    first = step(peer_engine, streams[1])
    assert first.num_prefill_tokens == 1
    scheduler = internals.scheduler_of(peer_engine.llm_engine)
    table = internals.request_block_ids(scheduler, peer_engine._internal_ids["adopt"])
    assert table[:n] == imported
    snap = peer_engine.snapshot()
    assert snap.reserved_blocks == 0 and snap.free_blocks == snap.total_blocks - len(table)
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    assert len(received_tokens(list(streams), "adopt")) == 40
    # Cached there under the salt the request came with.
    assert peer_engine.reserve_cached("m-adopted", prompt[: n * vllm_engine.block_size], cache_salt) == n
    peer_engine.release_reservation("m-adopted")


def run_alone(engine, request_id: str, prompt_len: int, max_tokens: int, **sampling) -> list[int]:
    request = make_request(request_id, prompt_len, max_tokens, **sampling)
    engine.add_request(request)
    drain(engine, {})
    return request.output_token_ids


def migrated_run(source, destination, request_id: str, prompt_len: int, max_tokens: int, decode_before: int,
                 **sampling) -> list[int]:
    free = (source.snapshot().free_blocks, destination.snapshot().free_blocks)
    streams = ({}, {})
    source.add_request(make_request(request_id, prompt_len, max_tokens, **sampling))
    for _ in range(decode_before):
        step(source, streams[0])
    migrate(source, destination, request_id, f"m-{request_id}", 2, streams)
    drain(destination, streams[1])
    drain(source, streams[0])
    assert (source.snapshot().free_blocks, destination.snapshot().free_blocks) == free
    return received_tokens(list(streams), request_id)


@pytest.mark.parametrize("option", ["repetition_penalty", "logit_bias", "allowed_token_ids", "top_k_min_p"])
def test_logit_options_migrate_with_identical_tokens(vllm_engine, peer_engine, reference, option):
    plain = reference[(100, 300)][:60]
    sampling = {
        "repetition_penalty": {"repetition_penalty": 1.3},
        # Forbid the tokens greedy decoding picks at 20 and 21: the output turns there.
        "logit_bias": {"logit_bias": {plain[20]: -100, plain[21]: -100}},
        # Every token greedy decoding picks but the one at 20: the output turns there, and goes on
        # within the list.
        "allowed_token_ids": {"allowed_token_ids": sorted(set(plain) - {plain[20]})},
        "top_k_min_p": {"top_k": 3, "min_p": 0.1},
    }[option]
    alone = run_alone(vllm_engine, f"{option}-alone", 100, 60, **sampling)
    # The option acts (filters keep the argmax, so greedy decoding is unchanged by them).
    assert (alone == plain) == (option == "top_k_min_p")
    assert set(alone) <= set(sampling.get("allowed_token_ids", alone))
    assert migrated_run(vllm_engine, peer_engine, option, 100, 60, 25, **sampling) == alone


def test_min_tokens_count_what_was_generated_before_the_migration(vllm_engine, peer_engine, reference):
    plain = reference[(100, 300)]
    once = run_alone(vllm_engine, "min-once", 100, 40, stop_token_ids=(plain[3],), min_tokens=12)
    # A stop token at 3 (masked before the move), one at 14: past min_tokens overall, but within
    # min_tokens of the destination's own count had the 6 tokens before the move been forgotten.
    stops = (plain[3], once[14])
    alone = run_alone(vllm_engine, "min-alone", 100, 40, stop_token_ids=stops, min_tokens=12)
    assert alone == once[:15]
    assert migrated_run(vllm_engine, peer_engine, "min", 100, 40, 6, stop_token_ids=stops, min_tokens=12) == alone


@pytest.mark.parametrize(("option", "reason"), [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"json_schema": '{"type": "object"}'}, "grammar"),
    ({"regex": "[a-z ]{60}"}, "grammar"),
    ({"bad_words": ("cat",)}, "bad_words"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "any_text"}}})}, "grammar"),
], ids=["presence_penalty", "frequency_penalty", "json_schema", "regex", "bad_words", "structural_tag"])
def test_options_that_cannot_move_exactly_are_pinned(vllm_engine, option, reason):
    vllm_engine.add_request(make_request("pinned", 20, 50, **option))
    # A grammar compiles (in a thread) before its request is scheduled: step until it decodes,
    # however many steps that takes on a busy machine.
    deadline = time.monotonic() + 120
    while len(vllm_engine.get_request("pinned").output_token_ids) < 2:
        assert time.monotonic() < deadline, "the request never decoded"
        vllm_engine.step()
    (load,) = vllm_engine.snapshot().running
    assert not load.migratable and load.pinned and vllm_engine.load_totals().num_pinned == 1
    vllm_engine.check_integrity()  # the totals equal a recount, pinned ones included
    with pytest.raises(MigrationRefused, match=reason):
        vllm_engine.pause("pinned")
    vllm_engine.abort_request("pinned")
    drain(vllm_engine, {})


# The budget engines' <think> and </think> (tests/vllm/conftest.py::budget_engines).
THINK, THOUGHT_END = 512, 513


def thinking_request(request_id: str, max_tokens: int, output: tuple[int, ...] = (), **sampling) -> Request:
    """A prompt that opens the thinking (as a reasoning model's chat template ends), and what the
    request has generated so far (`output`: a request resumed elsewhere)."""
    prompt = [10 + (5 * i + 3) % 400 for i in range(60)] + [THINK]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **{"ignore_eos": True, **sampling}),
                   output_token_ids=list(output))


@pytest.mark.parametrize("budget", [0, 6])
def test_a_thinking_budget_migrates_exactly_where_the_markers_are_one_token(budget_engines, budget):
    """vLLM writes the thinking's end once the budget is spent; it counts the thinking a prompt
    ends in against the budget, so a request resumed with its output as prompt goes on counting.
    Migrated before, at and after the forced end, and resumed there (failover), the tokens are
    an unmigrated run's; no block leaks."""
    source, destination = budget_engines
    free = (source.snapshot().free_blocks, destination.snapshot().free_blocks)

    def alone(request: Request) -> list[int]:
        source.add_request(request)
        drain(source, {})
        return request.output_token_ids

    free_thinking = alone(thinking_request(f"free-{budget}", 16))
    budgeted = alone(thinking_request(f"budgeted-{budget}", 16, thinking_token_budget=budget))
    # The budget acts: the end of the thinking written where it ran out, the rest follows it.
    assert budgeted[:budget] == free_thinking[:budget] and THOUGHT_END not in free_thinking
    assert budgeted[budget] == THOUGHT_END and budgeted[budget + 1:] != free_thinking[budget + 1:]
    for decode_before in sorted({max(1, budget - 4), budget, budget + 1, budget + 3} - {0}):
        streams = ({}, {})
        name = f"{budget}-{decode_before}"
        source.add_request(thinking_request(f"mig-{name}", 16, thinking_token_budget=budget))
        for _ in range(decode_before):
            step(source, streams[0])
        migrate(source, destination, f"mig-{name}", f"m-budget-{name}", 1, streams)
        drain(destination, streams[1])
        drain(source, streams[0])
        assert received_tokens(list(streams), f"mig-{name}") == budgeted, decode_before
        resumed = thinking_request(f"resumed-{name}", 16, tuple(budgeted[:decode_before]),
                                   thinking_token_budget=budget)
        destination.add_request(resumed)
        drain(destination, {})
        assert resumed.output_token_ids == budgeted, decode_before
    assert (source.snapshot().free_blocks, destination.snapshot().free_blocks) == free


def test_a_grammar_applies_from_the_end_the_thinking_budget_wrote(budget_engines):
    """Reasoning, a budget and a structured output together, as a reasoning model's request with
    tool_choice "required" runs: the engine thinks up to the budget, writes the end of the thinking,
    and only then constrains the output to the grammar."""
    from tokenizers import Tokenizer

    engine = budget_engines[0]
    tokenizer = Tokenizer.from_file(f"{engine.llm_engine.vllm_config.model_config.model}/tokenizer.json")
    free = thinking_request("free-thinking", 3)
    engine.add_request(free)
    drain(engine, {})
    request = thinking_request("choice-after-budget", 30, thinking_token_budget=3, choice=("Paris", "Rome"),
                               reasoning_ended=False, ignore_eos=False)
    engine.add_request(request)
    deadline = time.monotonic() + 120  # the grammar compiles in a thread first
    while engine.has_work():
        assert time.monotonic() < deadline, "the request never finished"
        engine.step()
    output = request.output_token_ids
    # The thinking is the model's own (the grammar waited), then its end, then one of the choices.
    assert output[:3] == free.output_token_ids and output[3] == THOUGHT_END
    assert tokenizer.decode(output[4:]) in ("Paris", "Rome")
    assert engine.snapshot().free_blocks == engine.total_blocks


def test_a_thinking_budget_is_pinned_where_it_would_not_go_on_exactly(budget_engines):
    """With a marker of several tokens vLLM's count of a resumed request's thinking (and its forced
    end, a token a step) start over; with a forced end other than the model's own its count misses
    the model's; spec decoding forces within drafts. Such requests stay where they run: never
    offered, refused if asked to move, counted as pinned."""
    from types import SimpleNamespace

    from vllm.config import ReasoningConfig

    from llumdask.engine.vllm.engine import migration_refusal, thinking_budget_moves

    def config(start: list[int], end: list[int], natural: list[int] | None = None, speculative: object = None):
        reasoning = ReasoningConfig()
        reasoning._reasoning_start_token_ids, reasoning._reasoning_end_token_ids = start, end
        reasoning._natural_reasoning_end_token_ids, reasoning._enabled = natural or end, True
        return SimpleNamespace(reasoning_config=reasoning, speculative_config=speculative)

    assert thinking_budget_moves(config([THINK], [THOUGHT_END]))
    assert thinking_budget_moves(budget_engines[0].llm_engine.vllm_config)  # the budget engines' own
    assert not thinking_budget_moves(config([30, 86], [THOUGHT_END]))
    assert not thinking_budget_moves(config([THINK], [30, 17]))
    assert not thinking_budget_moves(config([THINK], [30], natural=[THOUGHT_END]))
    assert not thinking_budget_moves(config([THINK], [THOUGHT_END], speculative=object()))
    assert not thinking_budget_moves(SimpleNamespace(reasoning_config=None, speculative_config=None))
    budgeted, plain = thinking_request("b", 8, thinking_token_budget=4), thinking_request("p", 8)
    assert "thinking budget" in migration_refusal(budgeted, False)
    assert migration_refusal(budgeted, True) == "" and migration_refusal(plain, False) == ""
    # On an engine where it would not: pinned, and a move is refused.
    engine = budget_engines[0]
    engine._budget_moves = False
    try:
        engine.add_request(thinking_request("pinned-budget", 20, thinking_token_budget=4))
        for _ in range(3):
            step(engine, {})
        (load,) = engine.snapshot().running
        assert load.pinned and not load.migratable and engine.load_totals().num_pinned == 1
        with pytest.raises(MigrationRefused, match="thinking budget"):
            engine.pause("pinned-budget")
    finally:
        engine.abort_request("pinned-budget")
        drain(engine, {})
        engine._budget_moves = True


def received_logprobs(streams: list[dict[str, list[TokenOutput]]], request_id: str) -> dict[int, TokenLogprob]:
    by_index: dict[int, TokenLogprob] = {}
    for stream in streams:
        for out in stream.get(request_id, []):
            for offset, entry in enumerate(out.logprobs or ()):
                by_index.setdefault(out.first_index + offset, entry)
    return by_index


def test_logprobs_migrate_with_the_values_of_an_unmigrated_run(vllm_engine, peer_engine, reference):
    streams: dict[str, list[TokenOutput]] = {}
    alone = make_request("lp-alone", 100, 40, logprobs=3, prompt_logprobs=2)
    vllm_engine.add_request(alone)
    drain(vllm_engine, streams)
    assert alone.output_token_ids == reference[(100, 300)][:40]
    expected = received_logprobs([streams], "lp-alone")
    assert sorted(expected) == list(range(40)) and all(len(e.top) == 3 for e in expected.values())
    (first,) = [o for o in streams["lp-alone"] if o.first_index == 0]
    assert len(first.prompt_logprobs) == 100 and first.prompt_logprobs[0] is None
    assert all(len(e.top) == 2 for e in first.prompt_logprobs[1:])

    moved = ({}, {})
    vllm_engine.add_request(make_request("lp", 100, 40, logprobs=3, prompt_logprobs=2))
    for _ in range(15):
        step(vllm_engine, moved[0])
    migrate(vllm_engine, peer_engine, "lp", "m-lp", 2, moved)
    drain(peer_engine, moved[1])
    drain(vllm_engine, moved[0])
    assert received_tokens(list(moved), "lp") == alone.output_token_ids
    got = received_logprobs(list(moved), "lp")
    assert sorted(got) == list(range(40))
    # The destination resumes without asking for the prompt's again.
    assert not any(o.prompt_logprobs for o in moved[1].get("lp", []))
    for index, entry in expected.items():
        assert got[index].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t for t, _ in got[index].top] == [t for t, _ in entry.top]
        assert [lp for _, lp in got[index].top] == pytest.approx([lp for _, lp in entry.top], abs=1e-4)


def test_blocks_the_destination_caches_are_reused_not_copied(vllm_engine, peer_engine, reference):
    """The destination served the same prompt before: the blocks of it that it caches are held
    for the migration (`reserve_cached`) and become the resumed request's, only the rest is
    copied, and the tokens are those of an unmigrated run."""
    from llumdask.engine.vllm import internals

    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    peer_engine.add_request(make_request("warm", 300, 2))
    drain(peer_engine, {})
    streams = ({}, {})
    request = make_request("reuse", 300, 200)
    vllm_engine.add_request(request)
    for _ in range(20):
        step(vllm_engine, streams[0])
    size = vllm_engine.block_size
    tokens = (request.prompt_token_ids + request.output_token_ids)[: vllm_engine.completed_blocks("reuse") * size]
    cached = internals.cached_prefix_blocks(peer_engine.llm_engine, tokens, size)
    assert peer_engine.reserve_cached("m-reuse", tokens) == len(cached) == 300 // size
    with pytest.raises(ValueError, match="reservation already"):
        peer_engine.reserve_cached("m-reuse", tokens)
    peer_engine.check_integrity()  # the reservation counts as a holder of each cached block
    state = vllm_engine.pause("reuse")
    total = blocks_for(state.num_tokens, size)
    assert peer_engine.reserve_blocks("m-reuse", total - len(cached))
    peer_engine.import_blocks("m-reuse", len(cached), vllm_engine.export_blocks("reuse", len(cached), total))
    peer_engine.resume("m-reuse", state)
    vllm_engine.free_migrated("reuse")
    first = step(peer_engine, streams[1])
    assert first.num_prefill_tokens == 1
    scheduler = internals.scheduler_of(peer_engine.llm_engine)
    assert internals.request_block_ids(scheduler, peer_engine._internal_ids["reuse"])[: len(cached)] == [
        b.block_id for b in cached]
    drain(peer_engine, streams[1])
    drain(vllm_engine, streams[0])
    assert received_tokens(list(streams), "reuse") == reference[(300, 200)]
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_a_released_reservation_gives_back_the_cached_blocks_it_reused(peer_engine):
    peer_engine.add_request(make_request("warm-release", 300, 2))
    drain(peer_engine, {})
    free = peer_engine.snapshot().free_blocks
    tokens = make_request("x", 300, 1).prompt_token_ids[:256]
    assert peer_engine.reserve_cached("m-release", tokens) == 2
    assert peer_engine.snapshot().free_blocks == free - 2
    peer_engine.release_reservation("m-release")
    peer_engine.check_integrity()
    assert peer_engine.snapshot().free_blocks == free
    assert peer_engine.reserve_cached("m-release-again", tokens) == 2  # still cached
    peer_engine.release_reservation("m-release-again")


def test_a_migrant_reuses_only_blocks_cached_under_its_own_salt(peer_engine):
    warm = make_request("warm-salted", 300, 2)
    peer_engine.add_request(Request(warm.request_id, warm.prompt_token_ids, warm.sampling, cache_salt="tenant-a"))
    drain(peer_engine, {})
    tokens = make_request("x", 300, 1).prompt_token_ids[:256]
    free = peer_engine.snapshot().free_blocks
    for migration_id, salt, reused in (("m-other", "tenant-b", 0), ("m-same", "tenant-a", 2)):
        assert peer_engine.reserve_cached(migration_id, tokens, salt) == reused
        peer_engine.release_reservation(migration_id)
    peer_engine.check_integrity()
    assert peer_engine.snapshot().free_blocks == free


def test_a_waiting_request_moves_without_kv_and_its_tokens_stay_exact(vllm_engine, peer_engine, reference):
    """A request still in vLLM's waiting queue leaves it holding nothing, queues on the
    destination and computes there; a running one cannot be taken as waiting."""
    free = (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks)
    streams = ({}, {})
    vllm_engine.add_request(make_request("queued", 100, 300))
    (load,) = vllm_engine.snapshot().waiting
    assert load.request_id == "queued" and load.migratable and load.num_blocks == 0
    state = vllm_engine.pause("queued", waiting=True)
    assert state.waiting and not state.output_token_ids
    assert vllm_engine.snapshot().waiting == ()
    vllm_engine.check_integrity()
    assert peer_engine.reserve_blocks("m-queued", blocks_for(state.num_tokens, peer_engine.block_size))
    peer_engine.resume("m-queued", state)
    vllm_engine.free_migrated("queued")
    drain(vllm_engine, streams[0])  # vLLM forgets an aborted request at its next step
    assert "queued" not in streams[0]
    assert peer_engine.snapshot().reserved_blocks == 0 and [w.request_id for w in peer_engine.snapshot().waiting] == ["queued"]
    drain(peer_engine, streams[1])
    assert received_tokens(list(streams), "queued") == reference[(100, 300)]
    vllm_engine.add_request(make_request("running", 100, 300))
    step(vllm_engine, streams[0])
    with pytest.raises(MigrationRefused, match="not waiting"):
        vllm_engine.pause("running", waiting=True)
    vllm_engine.abort_request("running")
    drain(vllm_engine, streams[0])
    assert (vllm_engine.snapshot().free_blocks, peer_engine.snapshot().free_blocks) == free


def test_a_waiting_request_handed_back_is_queued_again(vllm_engine, reference):
    free = vllm_engine.snapshot().free_blocks
    streams: dict[str, list[TokenOutput]] = {}
    vllm_engine.add_request(make_request("back", 100, 300))
    vllm_engine.pause("back", waiting=True)
    vllm_engine.unpause("back")
    assert [w.request_id for w in vllm_engine.snapshot().waiting] == ["back"]
    drain(vllm_engine, streams)
    assert received_tokens([streams], "back") == reference[(100, 300)]
    vllm_engine.add_request(make_request("dropped", 100, 300))
    vllm_engine.pause("dropped", waiting=True)
    vllm_engine.abort_request("dropped")
    assert vllm_engine.get_request("dropped") is None
    drain(vllm_engine, streams)
    assert "dropped" not in streams
    vllm_engine.check_integrity()
    assert vllm_engine.snapshot().free_blocks == free
