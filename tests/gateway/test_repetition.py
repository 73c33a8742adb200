"""vLLM's repetition_detection at the gateway: the rule itself (against vLLM's own check where
vLLM is installed), and a request's output ending where it repeats itself."""

from __future__ import annotations

import json

import pytest
from gatewayfakes import MODEL
from hypothesis import given, settings
from hypothesis import strategies as st

from llumdask.api.gateway.repetition import RepetitionDetection


def test_the_first_token_that_completes_a_repeated_pattern():
    two_thrice = RepetitionDetection(max_pattern_size=2, min_pattern_size=0, min_count=3)
    assert two_thrice.first([5, 6, 7, 6, 7, 6, 7, 8], 0) == 6  # "6 7" three times ends at index 6
    assert two_thrice.first([5, 5, 5, 6], 0) == 2  # a one-token pattern is a pattern too
    assert two_thrice.first([5, 5, 5, 6], 0, min_tokens=4) is None  # vLLM checks only past min_tokens
    assert two_thrice.first([5, 5, 5, 5, 6], 3) == 3  # from `start` on: still repeating at 3
    only_pairs = RepetitionDetection(max_pattern_size=2, min_pattern_size=2, min_count=3)
    assert only_pairs.first([5, 5, 5, 6], 0) is None and only_pairs.first([5, 5, 5, 5, 5, 5], 0) == 5
    assert RepetitionDetection(3, 1, 2).first([1, 2, 3, 1, 2, 4], 0) is None


@pytest.mark.vllm
@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=24), sizes=st.tuples(st.integers(0, 4), st.integers(0, 4)),
       min_count=st.integers(2, 4), min_tokens=st.integers(0, 10))
def test_the_rule_is_vllms(tokens, sizes, min_count, min_tokens):
    """Against vLLM's own per-token check (its scheduler's check_stop order: past min_tokens)."""
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    low, high = min(sizes), max(sizes)
    if high == 0:
        return
    params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=min_count)
    expected = next((i for i in range(len(tokens)) if i + 1 >= min_tokens
                     and check_sequence_repetition(tokens[: i + 1], params)), None)
    assert RepetitionDetection(high, low, min_count).first(tokens, 0, min_tokens) == expected


REPEATING = [5, 6, 7, 6, 7, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_an_answer_ends_where_it_repeats_itself(make_client, backend, tokenizer, batch_size):
    backend.script, backend.batch_size = REPEATING, batch_size
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "logprobs": 0, "return_token_ids": True,
            "repetition_detection": {"max_pattern_size": 2, "min_count": 3}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "repetition" and choice["token_ids"] == REPEATING[:7]
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


def test_a_stop_token_or_the_last_token_keeps_its_own_reason(make_client, backend):
    backend.script = [5, 5, 5, 6]
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "repetition_detection": {"max_pattern_size": 1, "min_count": 3}}
    assert client.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]["finish_reason"] == "length"
    stopped = client.post("/v1/completions", json={**body, "max_tokens": 4, "stop_token_ids": [5]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("value, words", [
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size must be <="),
    ({"max_pattern_size": -1}, "max_pattern_size must be an integer >= 0"),
    ({"max_pattern_size": 2, "min_count": 2, "window": 4}, "no field 'window'"),
    ([2, 2], "object"),
])
def test_bad_repetition_detection_is_a_400(client, backend, value, words):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "repetition_detection": value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("repetition_detection"), r.text
    assert words in r.json()["error"]["message"] and backend.submitted == []
    off = {"max_pattern_size": 0, "min_pattern_size": 0, "min_count": 0}
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                 "repetition_detection": off}).status_code == 200
