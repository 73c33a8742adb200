"""vLLM's beam search above the engines: the search itself over a made-up model, and the gateway's
requests and response over the scripted backend (live against vLLM's own search: test_serve.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import Sequence

import pytest
from gatewayfakes import MODEL

from llumdask.api.gateway.backend import BackendUnavailable
from llumdask.api.gateway.beam_search import beam_search
from llumdask.engine.base import TokenLogprob

EOS = 9


def model(table: dict[tuple[int, ...], dict[int, float]], calls: list | None = None):
    """A step over a table of next-token probabilities by the tokens so far (greedy: the likeliest drawn)."""
    async def step(tokens: Sequence[int], index: int) -> tuple[int, TokenLogprob]:
        if calls is not None:
            calls.append((tuple(tokens), index))
        ranked = sorted(table[tuple(tokens)].items(), key=lambda kv: -kv[1])
        logprobs = [(t, math.log(p)) for t, p in ranked]
        return logprobs[0][0], TokenLogprob(logprobs[0][1], tuple(logprobs), rank=1)
    return step


def search(step, **options):
    defaults = {"width": 2, "max_tokens": 2, "prompt_tokens": 3, "eos_token_id": EOS, "ignore_eos": False,
                "length_penalty": 0.0}
    return asyncio.run(beam_search(step, **{**defaults, **options}))


def test_a_wide_enough_search_ranks_every_sequence_by_its_probability():
    """Three tokens, two steps: nine sequences; a width of nine keeps them all, best first."""
    vocab = (1, 2, 3)
    table = {(): {1: 0.5, 2: 0.3, 3: 0.2}}
    for first in vocab:
        table[(first,)] = {t: p for t, p in zip(vocab, ((0.2, 0.3, 0.5), (0.6, 0.3, 0.1), (0.4, 0.4, 0.2))[first - 1])}
    beams = search(model(table), width=9)
    every = sorted(itertools.product(vocab, vocab), key=lambda s: -table[()][s[0]] * table[(s[0],)][s[1]])
    assert [b.tokens for b in beams] == every
    assert [b.logprob for b in beams] == pytest.approx([math.log(table[()][a] * table[(a,)][b]) for a, b in every])
    assert all(b.finish_reason == "length" and len(b.entries) == 2 for b in beams)


def test_two_beams_find_what_greedy_decoding_misses():
    """Greedy takes 1 (0.6) then at best 0.3: 0.18; the second beam's 2 (0.4) then 0.9: 0.36."""
    table = {(): {1: 0.6, 2: 0.4}, (1,): {3: 0.3, 4: 0.3, 5: 0.3}, (2,): {3: 0.9, 4: 0.1}}
    calls: list = []
    (best, second) = search(model(table, calls), width=2)
    assert best.tokens == (2, 3) and best.logprob == pytest.approx(math.log(0.36))
    assert second.tokens[0] == 1
    # One request per live beam and step: the prompt's, then each live beam's, likeliest first.
    assert calls == [((), 0), ((1,), 0), ((2,), 1)]


def vllm_score(beam, prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: a last token that is the end of sequence is not counted."""
    length = prompt_tokens + len(beam.tokens) - (beam.tokens[-1:] == (EOS,))
    return beam.logprob / max(length, 1) ** length_penalty


def test_an_end_of_sequence_ends_its_beam_and_the_length_penalty_ranks_it():
    """An ended beam stops growing; its end of sequence counts in its log probability, not its
    length. A short ended beam beats a longer one at length penalty 0 (the raw sum) and loses at a
    high one, which divides by the length (the prompt's 3 tokens included) to that power."""
    table = {(): {EOS: 0.5, 1: 0.5}, (1,): {2: 0.6, 3: 0.4}, (1, 2): {4: 0.9, 5: 0.1}, (1, 3): {4: 0.9, 5: 0.1}}
    raw = search(model(table), width=2, max_tokens=3, length_penalty=0.0)
    assert raw[0].tokens == (EOS,) and raw[0].finish_reason == "stop"  # log 0.5 against log 0.27
    assert raw[0].logprob == pytest.approx(math.log(0.5))
    long = search(model(table), width=2, max_tokens=3, length_penalty=10.0)
    assert long[0].tokens == (1, 2, 4) and long[0].finish_reason == "length"
    for penalty in (0.0, 0.5, 1.0, 10.0, -2.0):
        beams = search(model(table), width=4, max_tokens=3, length_penalty=penalty)
        scores = [vllm_score(b, 3, penalty) for b in beams]
        assert scores == sorted(scores, reverse=True), penalty
    # With ignore_eos the end of sequence is a token like any other (a live beam ending in one
    # still has it left out of its length, as vLLM counts).
    kept = search(model({(): {EOS: 0.6, 1: 0.4}, (EOS,): {1: 1.0}, (1,): {1: 1.0}}), width=1, ignore_eos=True)
    assert kept[0].tokens == (EOS, 1) and kept[0].finish_reason == "length"
    table = {(): {1: 0.5, 2: 0.5}, (1,): {EOS: 0.6, 3: 0.4}, (2,): {3: 0.55, 4: 0.45}}
    ranked = search(model(table), width=4, ignore_eos=True, length_penalty=1.0, prompt_tokens=1)
    # log 0.275 over length 3 beats log 0.3 over 2 (3 - 1), which would win counted as 3.
    assert [b.tokens for b in ranked] == [(2, 3), (2, 4), (1, 3), (1, EOS)]
    scores = [vllm_score(b, 1, 1.0) for b in ranked]
    assert scores == sorted(scores, reverse=True)


def test_no_length_penalty_overflows_the_ranking():
    """vLLM's score raises the length to the penalty's power: ranked by its logarithm here, a
    long prompt and a large penalty either way still rank (shorter first where it is positive)."""
    table = {(): {EOS: 0.5, 1: 0.5}, (1,): {EOS: 0.5, 2: 0.5}}
    for penalty, first in ((500.0, (1, 2)), (-500.0, (EOS,))):  # 10 ** 500 is past any float
        beams = search(model(table), width=3, max_tokens=2, length_penalty=penalty, prompt_tokens=10)
        assert beams[0].tokens == first, penalty


def test_an_aborted_step_ends_every_beam_as_aborted():
    """As vLLM: an engine abort of any step ends the search, its live beams "abort"."""
    table = {(): {1: 0.6, 2: 0.4}, (1,): {3: 1.0}}

    async def step(tokens: Sequence[int], index: int):
        return None if tokens == (2,) else await model(table)(tokens, index)

    beams = search(step, width=2, max_tokens=3)
    assert [(b.tokens, b.finish_reason) for b in beams] == [((1,), "abort"), ((2,), "abort")]


def test_a_sure_sequence_ranks_first_even_past_zero_by_rounding():
    table = {(): {1: 1.0, 2: 1e-9}}
    step = model(table)

    async def rounded(tokens: Sequence[int], index: int):
        token, entry = await step(tokens, index)
        return token, entry._replace(logprob=1e-7, top=((1, 1e-7), *entry.top[1:]))

    assert search(rounded, width=2, max_tokens=1)[0].tokens == (1,)


def test_a_failing_step_cancels_its_siblings_before_the_error_goes_on():
    """Each cancelled step aborts its request (the gateway's step closes its generation), so none
    is left running on an instance after the search failed."""
    cancelled: list[int] = []

    async def step(tokens: Sequence[int], index: int) -> tuple[int, TokenLogprob]:
        if not tokens:
            return 1, TokenLogprob(-0.1, ((1, -0.1), (2, -0.2)), rank=1)
        if index == 0:
            await asyncio.sleep(0)
            raise RuntimeError("the instance died")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(index)
            raise

    async def run() -> list[int]:
        with pytest.raises(RuntimeError, match="died"):
            await beam_search(step, width=2, max_tokens=3, prompt_tokens=3, eos_token_id=EOS, ignore_eos=False,
                              length_penalty=1.0)
        return list(cancelled)  # as the error arrived, not at the loop's close

    assert asyncio.run(run()) == [1]


def test_a_steps_error_is_not_hidden_by_a_sibling_that_ended_cancelled():
    async def step(tokens: Sequence[int], index: int) -> tuple[int, TokenLogprob]:
        if not tokens:
            return 1, TokenLogprob(-0.1, ((1, -0.1), (2, -0.2)), rank=1)
        if index == 0:
            raise asyncio.CancelledError  # as a step whose request the gateway gave up on
        await asyncio.sleep(0)
        raise RuntimeError("the instance died")

    with pytest.raises(RuntimeError, match="died"):
        search(step, width=2, max_tokens=3)


@pytest.fixture
def beam_client(make_client, backend, script):
    backend.batch_size = 1
    return make_client(backend)


def test_the_gateway_sends_one_request_per_beam_and_step_and_answers_the_best(beam_client, backend, tokenizer, script):
    """Over the scripted backend every step draws script[0] with alternatives script[0] + 1 + k:
    the best beam repeats script[0]; each step's requests ask for one token and 2n alternatives."""
    r = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2,
                                                  "use_beam_search": True, "temperature": 0, "logprobs": 1,
                                                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(backend.submitted) == 1 + 2 + 2  # the first step has one beam
    assert all(s.sampling.max_tokens == 1 and s.sampling.logprobs == 4 for s in backend.submitted)
    prompt = backend.submitted[0].prompt_token_ids
    assert [s.prompt_token_ids[:len(prompt)] for s in backend.submitted] == [prompt] * 5
    best, second = body["choices"]
    assert best["token_ids"] == [script[0]] * 3 and best["text"] == tokenizer.decode([script[0]] * 3)
    assert second["token_ids"] == [script[0], script[0], script[0] + 1]
    assert best["logprobs"]["token_logprobs"] == pytest.approx([-0.1] * 3)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}
    assert best["finish_reason"] == "length"
    ids = {s.request_id for s in backend.submitted}
    assert len(ids) == 5 and all("-beam" in i for i in ids)
    chat = beam_client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "use_beam_search": True,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == tokenizer.decode([script[0]] * 2)


def test_a_beam_the_end_of_sequence_ended_names_it_as_its_stop_reason(beam_client, backend, tokenizer):
    """vLLM's beam search names the end-of-sequence token as the stop_reason of a beam it ended."""
    backend.script = [tokenizer.eos_token_id]
    body = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2,
                                                     "use_beam_search": True, "temperature": 0}).json()
    reasons = {(c["finish_reason"], c["stop_reason"]) for c in body["choices"]}
    assert ("stop", tokenizer.eos_token_id) in reasons and reasons <= {("stop", tokenizer.eos_token_id), ("length", None)}


@pytest.mark.parametrize("fields, param, words", [
    ({"stream": True}, "stream", "cannot be streamed"),
    ({"presence_penalty": 0.5, "messages": True}, "presence_penalty", "does not apply"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required",
      "messages": True}, "tool_choice", "does not apply"),
    ({"n": 11}, "n", "at most 10"),
    ({"stop": ["x"]}, "stop", "does not apply stop"),
    ({"top_p": 0.5}, "top_p", "does not apply top_p"),
    ({"presence_penalty": 0.5}, "presence_penalty", "does not apply"),
    ({"seed": 3}, "seed", "does not apply"),
    ({"n": 2, "best_of": 3}, "best_of", "does not apply"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's log probabilities"),
    ({"response_format": {"type": "json_object"}}, "response_format", "does not apply"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "text"}}, "structured_outputs",
     "does not apply"),
    ({"thinking_token_budget": 8}, "thinking_token_budget", "does not apply"),
])
def test_what_beam_search_does_not_apply_is_a_400(beam_client, backend, fields, param, words):
    chat = "response_format" in fields or bool(fields.pop("messages", False))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 2, "use_beam_search": True, **fields}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    r = beam_client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    assert backend.submitted == []


def test_length_penalty_ranks_beams_and_needs_beam_search(beam_client, backend):
    r = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    assert beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                      "use_beam_search": True, "length_penalty": 1e4}).status_code == 200


def test_options_at_their_defaults_are_not_asked_of_beam_search(beam_client, backend):
    """SDKs send defaults: they ask nothing of the search."""
    defaults = {"presence_penalty": 0, "frequency_penalty": 0.0, "top_k": -1, "min_p": 0, "repetition_penalty": 1,
                "min_tokens": 0, "logit_bias": {}, "bad_words": [], "stop": [], "top_p": 1}
    r = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                  "use_beam_search": True, **defaults})
    assert r.status_code == 200, r.text


def eos_model(tokenizer):
    """Next tokens by what was said after the first prompt seen: the end of sequence is likeliest
    first, a longer answer likelier in the end (token 40, then 41); anything else ends."""
    eos = tokenizer.eos_token_id
    start: list[int] = []

    def next_token(prompt: list[int]) -> tuple[int, TokenLogprob]:
        start[:] = start or [len(prompt)]
        table = {(): {eos: 0.5, 40: 0.45, 43: 0.05}, (40,): {41: 0.9, eos: 0.05, 42: 0.05},
                 (40, 41): {eos: 0.9, 42: 0.1}}.get(tuple(prompt[start[0]:]), {eos: 0.6, 44: 0.4})
        ranked = [(t, math.log(p)) for t, p in sorted(table.items(), key=lambda kv: -kv[1])]
        return ranked[0][0], TokenLogprob(ranked[0][1], tuple(ranked), rank=1)
    return next_token


def test_ended_beams_answer_without_their_end_of_sequence_unless_asked(beam_client, backend, tokenizer):
    """The penalty ranks the short ended beam (the end of sequence at once) against the longer
    one; the end of sequence is never in the text, and in the token ids only where asked."""
    backend.next_token = eos_model(tokenizer)
    eos = tokenizer.eos_token_id
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "n": 2, "use_beam_search": True,
            "return_token_ids": True, "temperature": 0}
    raw = beam_client.post("/v1/completions", json={**body, "length_penalty": 0.0}).json()
    assert [c["token_ids"] for c in raw["choices"]] == [[], [40, 41]]  # log 0.5 against log 0.36
    assert [c["finish_reason"] for c in raw["choices"]] == ["stop", "stop"]
    assert raw["choices"][1]["text"] == tokenizer.decode([40, 41]) and raw["usage"]["completion_tokens"] == 2
    penalised = beam_client.post("/v1/completions", json={**body, "length_penalty": 2.0, "max_tokens": 3,
                                                          "include_stop_str_in_output": True, "logprobs": 0}).json()
    best = penalised["choices"][0]
    assert best["token_ids"] == [40, 41, eos] and best["text"] == tokenizer.decode([40, 41])
    prompt = len(backend.submitted[0].prompt_token_ids)
    scores = [sum(c["logprobs"]["token_logprobs"]) / (prompt + len(c["token_ids"]) - (c["token_ids"][-1:] == [eos])) ** 2
              for c in penalised["choices"]]
    assert scores == sorted(scores, reverse=True)
    kept = beam_client.post("/v1/completions", json={**body, "n": 1, "ignore_eos": True, "max_tokens": 2}).json()
    assert kept["choices"][0]["token_ids"] == [eos, eos] and kept["choices"][0]["finish_reason"] == "length"


def test_a_failed_step_aborts_the_others_and_frees_the_slots(beam_client, backend, tokenizer):
    """One beam's instance is lost while the other's step still runs: that step is aborted, the
    client gets a 503, and the gateway holds no slot after."""
    model = eos_model(tokenizer)

    def next_token(prompt: list[int]):
        if prompt[-1:] == [40]:
            raise BackendUnavailable("the instance died")
        if prompt[-1:] == [43]:
            return None  # still running
        return model(prompt)

    backend.next_token = next_token
    r = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 3,
                                                  "use_beam_search": True, "ignore_eos": True})
    assert r.status_code == 503, r.text
    running = [s.request_id for s in backend.submitted if s.prompt_token_ids[-1:] == [43]]
    assert running and set(running) <= set(backend.aborted)
    assert "llumdask_gateway_requests_in_flight 0.0" in beam_client.get("/metrics").text


def test_a_chat_streams_its_beams_once_searched(beam_client, backend, tokenizer):
    backend.next_token = eos_model(tokenizer)
    r = beam_client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "stream": True,
        "use_beam_search": True, "length_penalty": 8.0, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    content = {i: "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                          if e["choices"] and e["choices"][0]["index"] == i) for i in (0, 1)}
    assert content == {0: tokenizer.decode([40, 41]), 1: ""}
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == ["stop", "stop"] and events[-1]["usage"]["completion_tokens"] == 2
