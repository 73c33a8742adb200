"""vLLM's repetition_detection at the gateway: the rule itself (against vLLM's own check where
vLLM is installed), and a request's output ending where it repeats itself."""

from __future__ import annotations

import json

import pytest
from gatewayfakes import MODEL
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.api.gateway.repetition import RepetitionDetection


def repeats(rule: RepetitionDetection, tokens: list[int]) -> list[int]:
    """The indices at which the output, token by token, ends in a repetition."""
    watch = rule.watch()
    return [i for i, t in enumerate(tokens) if watch.add(t)]


def brute_force(rule: RepetitionDetection, tokens: list[int]) -> list[int]:
    """vLLM's rule written out: the last L tokens, and the (count - 1) runs of L before them, alike."""
    found = []
    for n in range(1, len(tokens) + 1):
        seen = tokens[:n]
        for length in range(max(rule.min_pattern_size, 1), rule.max_pattern_size + 1):
            if length * rule.min_count > n:
                break
            if all(seen[n - length * (k + 1):n - length * k] == seen[n - length:] for k in range(1, rule.min_count)):
                found.append(n - 1)
                break
    return found


def test_the_tokens_that_complete_a_repeated_pattern():
    two_thrice = RepetitionDetection(max_pattern_size=2, min_pattern_size=0, min_count=3)
    assert repeats(two_thrice, [5, 6, 7, 6, 7, 6, 7, 8]) == [6]  # "6 7" three times ends at index 6
    assert repeats(two_thrice, [5, 5, 5, 6]) == [2]  # a one-token pattern is a pattern too
    only_pairs = RepetitionDetection(max_pattern_size=2, min_pattern_size=2, min_count=3)
    assert repeats(only_pairs, [5, 5, 5, 6]) == [] and repeats(only_pairs, [5, 5, 5, 5, 5, 5]) == [5]
    assert repeats(RepetitionDetection(3, 1, 2), [1, 2, 3, 1, 2, 4]) == []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=30), sizes=st.tuples(st.integers(0, 5), st.integers(1, 5)),
       min_count=st.integers(2, 4))
def test_the_watch_finds_what_the_rule_written_out_finds(tokens, sizes, min_count):
    rule = RepetitionDetection(max(sizes), min(sizes), min_count)
    assert repeats(rule, tokens) == brute_force(rule, tokens)


@pytest.mark.vllm
@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=24), sizes=st.tuples(st.integers(0, 4), st.integers(0, 4)),
       min_count=st.integers(2, 4))
def test_the_rule_is_vllms(tokens, sizes, min_count):
    """Against vLLM's own check after each token."""
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    low, high = min(sizes), max(sizes)
    if high == 0:
        return
    params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=min_count)
    expected = [i for i in range(len(tokens)) if check_sequence_repetition(tokens[: i + 1], params)]
    assert repeats(RepetitionDetection(high, low, min_count), tokens) == expected


REPEATING = [5, 6, 7, 6, 7, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_an_answer_ends_where_it_repeats_itself(make_client, backend, tokenizer, batch_size):
    backend.script, backend.batch_size = REPEATING, batch_size
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "logprobs": 0, "return_token_ids": True,
            "repetition_detection": {"max_pattern_size": 2, "min_count": 3}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "repetition" and choice["token_ids"] == REPEATING[:7]
    assert choice["stop_reason"] == "repetition_detected"  # vLLM's
    assert choice["text"] == tokenizer.decode(REPEATING[:7]) and len(choice["logprobs"]["tokens"]) == 7
    assert backend.aborted == [backend.submitted[0].request_id]  # the engine would go on: stopped
    chunks = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in chunks.text.splitlines() if line.startswith("data: {")]
    assert [t for e in events for t in e["choices"][0].get("token_ids") or []] == REPEATING[:7]
    assert events[-1]["choices"][0]["finish_reason"] == "repetition"
    # Not before min_tokens; and a pattern longer than asked is none.
    late = client.post("/v1/completions", json={**body, "min_tokens": 8}).json()["choices"][0]
    assert late["finish_reason"] == "length" and late["token_ids"] == REPEATING
    longer = {**body, "repetition_detection": {"max_pattern_size": 1, "min_count": 3}}
    assert client.post("/v1/completions", json=longer).json()["choices"][0]["finish_reason"] == "length"


def test_the_last_token_keeps_its_own_reason(make_client, backend):
    backend.script = [5, 5, 5, 6]
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "repetition_detection": {"max_pattern_size": 1, "min_count": 3}}
    assert client.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]["finish_reason"] == "length"
    assert client.post("/v1/completions", json={**body, "max_tokens": 4}).json()["choices"][0]["finish_reason"] == \
        "repetition"


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_sends_the_text_held_back_for_stop_strings(make_client, backend, tokenizer, stream):
    """Text held back because it might begin a stop string is the answer's once the repetition ends it."""
    backend.script = REPEATING
    client = make_client(backend)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 12, "stream": stream,
                                             "stop": ["x" * 40], "repetition_detection": {"max_pattern_size": 2,
                                                                                           "min_count": 3}})
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        reason = events[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (text, reason) == (tokenizer.decode(REPEATING[:7]), "repetition")


@pytest.mark.parametrize("value, words", [
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size must be <="),
    ({"max_pattern_size": -1}, "max_pattern_size must be an integer >= 0"),
    ({"max_pattern_size": 2, "min_count": 2, "window": 4}, "no field 'window'"),
    ({"max_pattern_size": 1025, "min_count": 2}, "at most 1024"),
    ([2, 2], "object"),
])
def test_bad_repetition_detection_is_a_400(client, backend, value, words):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "repetition_detection": value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("repetition_detection"), r.text
    assert words in r.json()["error"]["message"] and backend.submitted == []
    off = {"max_pattern_size": 0, "min_pattern_size": 0, "min_count": 0}
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                 "repetition_detection": off}).status_code == 200
