"""SamplingParams: the one validation every entry point shares, and what crosses comms intact."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llumdask.request import Priority, Request, SamplingParams


@pytest.mark.parametrize("fields, words", [
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"min_p": 1.01}, "min_p must be in"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
    ({"presence_penalty": 2.1}, "presence_penalty must be in"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_tokens": 17}, r"min_tokens \(17\) must not exceed max_tokens \(16\)"),
    ({"logit_bias": {True: 1}}, "logit_bias must map token ids"),
    ({"logit_bias": {"3.5": 1}}, "logit_bias must map token ids"),
    ({"logit_bias": {3: 100.5}}, "logit_bias must map token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids must be a list of token ids"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be"),
    ({"json_schema": "[1]"}, "json_schema must be the JSON text of a schema object"),
    ({"json_schema": "{"}, "json_schema must be the JSON text"),
    ({"json_schema": "{}", "json_object": True}, "exclude each other"),
    ({"regex": "a+", "choice": ["a"]}, "regex and choice exclude each other"),
    ({"regex": "a\ud800"}, "regex must be a non-empty string of text"),
    ({"choice": ["yes", "\udfff"]}, "choice must be a list of strings of text"),
    ({"allowed_token_ids": range(1025)}, "allowed_token_ids may name at most 1024 tokens"),
    ({"logit_bias": {t: 1 for t in range(1025)}}, "logit_bias may name at most 1024 tokens"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids must be a list of token ids"),
    ({"bad_words": "cat"}, "bad_words must be a list of words"),
    ({"bad_words": ["cat", " "]}, "bad_words must be a list of words"),
    ({"min_tokens": 1, "stop_token_ids": range(129)}, "with min_tokens, stop_token_ids may name at most 128"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 5}, "grammar must be a non-empty string"),
    ({"choice": "ab"}, "choice must be a list of strings"),
    ({"structural_tag": "[1]"}, "structural_tag must be the JSON text of a structural tag object"),
    ({"structural_tag": "{", "regex": "a"}, "structural_tag must be the JSON text"),
    ({"structural_tag": '{"a": "\ud800"}'}, "structural_tag must be the JSON text"),
    ({"structural_tag": "[" * 5000 + "]" * 5000}, "structural_tag must be the JSON text"),
    ({"structural_tag": '{"type": "structural_tag"}', "regex": "a"}, "regex and structural_tag exclude each other"),
    ({"thinking_token_budget": -2}, r"thinking_token_budget must be an integer >= 0, or -1"),
    ({"thinking_token_budget": -1.0}, "thinking_token_budget must be an integer"),
    ({"thinking_token_budget": True}, "thinking_token_budget must be an integer"),
    ({"seed": 2**70}, "seed must be a 64-bit integer"),
    ({"stop_token_ids": [1.9]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": None}, "stop_token_ids must be a list of token ids"),
    ({"allowed_token_ids": [2**63]}, "allowed_token_ids must be a list of token ids"),
    ({"ignore_eos": "no"}, "ignore_eos must be a boolean"),
])
def test_bad_options_name_themselves(fields, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**fields)


def test_a_thinking_budget_of_minus_one_is_no_limit_as_in_vllm():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0


def test_logit_bias_is_sorted_pairs_from_a_mapping_or_pairs():
    assert SamplingParams(logit_bias={"12": 5, 3: -100}).logit_bias == ((3, -100.0), (12, 5.0))
    assert SamplingParams(logit_bias=[[12, 5], [3, -100]]) == SamplingParams(logit_bias={12: 5.0, 3: -100.0})


def test_only_penalties_on_own_output_count_it():
    assert SamplingParams().counts_own_output == ""
    assert SamplingParams(repetition_penalty=1.3, top_k=5, min_p=0.2, logit_bias={1: 2}).counts_own_output == ""
    assert SamplingParams(presence_penalty=0.1).counts_own_output == "presence_penalty"
    assert SamplingParams(frequency_penalty=-0.1).counts_own_output == "frequency_penalty"
    assert SamplingParams(bad_words=["cat"]).counts_own_output == "bad_words"  # checked against its own output


def test_token_lists_come_from_any_iterable_of_ids():
    assert SamplingParams(allowed_token_ids=range(3)).allowed_token_ids == (0, 1, 2)
    assert SamplingParams(allowed_token_ids=[5, 2]) == SamplingParams(allowed_token_ids=(5, 2))


def test_every_option_survives_the_wire():
    from llumdask.plugins.wire import request_from_msg, request_to_msg

    sampling = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, seed=4, stop_token_ids=(2,), top_k=7,
                              min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4,
                              min_tokens=3, logit_bias={8: -1.5}, allowed_token_ids=[8, 2, 5], logprobs=2, prompt_logprobs=0,
                              json_schema='{"type": "object"}')
    msg = msgpack.unpackb(msgpack.packb(request_to_msg(Request("r", [1, 2], sampling))))
    assert request_from_msg(msg).sampling == sampling
    for kind in ({"regex": "[0-9]+"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}, {"bad_words": ["x y"]}):
        sampling = SamplingParams(max_tokens=4, **kind)
        msg = msgpack.unpackb(msgpack.packb(request_to_msg(Request("r", [1, 2], sampling))))
        assert request_from_msg(msg).sampling == sampling


def test_a_cache_salt_is_checked_and_travels_with_the_request_on_the_wire_and_in_a_migration():
    from llumdask.engine.base import MigrationState
    from llumdask.plugins.wire import request_from_msg, request_to_msg

    salted = Request("r", [1, 2], SamplingParams(max_tokens=3), cache_salt="tenant-a")
    assert request_from_msg(msgpack.unpackb(msgpack.packb(request_to_msg(salted)))).cache_salt == "tenant-a"
    assert request_from_msg(msgpack.unpackb(msgpack.packb(request_to_msg(Request("r", [1]))))).cache_salt is None
    assert MigrationState.capture(salted).to_request().cache_salt == "tenant-a"
    for bad in ("", 5, b"salt", "\ud800", "a/b", "a@b", "a\\b", "a\0b", "s" * 129):
        with pytest.raises(ValueError, match="cache_salt"):
            Request("r", [1], cache_salt=bad)


@given(st.lists(st.one_of(st.integers(-3, 2**64), st.booleans(), st.floats(0, 10), st.sampled_from([Priority.HIGH])),
                max_size=6))
def test_token_ids_are_checked_alike_on_the_fast_path_and_one_by_one(values):
    from llumdask.request import are_token_ids, is_token_id

    assert are_token_ids(values) == all(is_token_id(v) for v in values)


@pytest.mark.parametrize("prompt", [[], [1, -1], [1, True], [1, 2.0], [2**63]])
def test_a_prompt_is_token_ids_comms_carry(prompt):
    from llumdask.request import Request

    with pytest.raises(ValueError, match="the prompt is empty|prompt tokens must be non-negative 64-bit integers"):
        Request("r", prompt, SamplingParams())
