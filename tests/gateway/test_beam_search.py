"""vLLM's beam search above the engines: the search itself over a made-up model, and the gateway's
requests and response over the scripted backend (live against vLLM's own search: test_serve.py)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence

import pytest
from gatewayfakes import MODEL

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
    # One request per live beam and step: the prompt's, then each beam's first token.
    assert sorted(calls) == [((), 0), ((1,), 0), ((2,), 1)]  # the live beams, likeliest first


def test_an_end_of_sequence_ends_its_beam_and_the_length_penalty_ranks_it():
    """An ended beam stops growing; its end of sequence counts in its log probability, not its
    length. A short ended beam loses to a longer one at length penalty 0 (raw sum) and wins at a
    high one, which divides by the length to that power (the prompt's 3 tokens included)."""
    table = {(): {EOS: 0.5, 1: 0.5}, (1,): {2: 0.6, 3: 0.4}, (1, 2): {4: 0.9, 5: 0.1}, (1, 3): {4: 0.9, 5: 0.1}}
    raw = search(model(table), width=2, max_tokens=3, length_penalty=0.0)
    assert raw[0].tokens == (EOS,) and raw[0].finish_reason == "stop"  # log 0.5 against log 0.27
    assert raw[0].score(3, 0.0) == pytest.approx(math.log(0.5))
    assert raw[0].score(3, 1.0) == pytest.approx(math.log(0.5) / 3)  # the end of sequence is not counted
    long = search(model(table), width=2, max_tokens=3, length_penalty=10.0)
    assert long[0].tokens == (1, 2, 4) and long[0].finish_reason == "length"
    # With ignore_eos the end of sequence is a token like any other.
    kept = search(model({(): {EOS: 0.6, 1: 0.4}, (EOS,): {1: 1.0}, (1,): {1: 1.0}}), width=1, ignore_eos=True)
    assert kept[0].tokens == (EOS, 1) and kept[0].finish_reason == "length"


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


@pytest.mark.parametrize("fields, param, words", [
    ({"stream": True}, "stream", "cannot be streamed"),
    ({"n": 11}, "n", "at most 10"),
    ({"stop": ["x"]}, "stop", "does not apply stop"),
    ({"top_p": 0.5}, "top_p", "does not apply top_p"),
    ({"presence_penalty": 0.5}, "presence_penalty", "does not apply"),
    ({"seed": 3}, "seed", "does not apply"),
    ({"n": 2, "best_of": 3}, "best_of", "does not apply"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's log probabilities"),
    ({"response_format": {"type": "json_object"}}, "response_format", "does not apply"),
])
def test_what_beam_search_does_not_apply_is_a_400(beam_client, backend, fields, param, words):
    path = "/v1/chat/completions" if "response_format" in fields else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 2, "use_beam_search": True, **fields}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "response_format" in fields else {"prompt": "Hi"}
    r = beam_client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    assert backend.submitted == []


def test_length_penalty_needs_beam_search(beam_client, backend):
    r = beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    assert beam_client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                      "length_penalty": 1.0}).status_code == 200
