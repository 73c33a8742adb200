"""Reasoning through the gateway over a scripted backend: a gateway started with one of vLLM's
reasoning parsers answers chats with the model's thinking as message.reasoning (delta.reasoning in
a stream) apart from its content, counts it in usage, hides it on include_reasoning false, and reads
tool calls from what follows it. The tiny model has no thinking tokens; vLLM's qwen3 parser reads
the <think> markers as text. The live engine's round trip is in test_serve.py."""

from __future__ import annotations

import json

import pytest
from test_routes import sse_payloads
from test_tools import ASK, WEATHER, chat, scripted, tool_deltas

from llumdask.api.gateway import ModelInfo
from llumdask.api.gateway.tools import AnswerReading
from gatewayfakes import MODEL, FakeBackend

pytestmark = pytest.mark.vllm

REASONING, CONTENT = "Paris is in France; look it up.", "It is sunny in Paris."
THOUGHT = f"<think>{REASONING}</think>{CONTENT}"
CALL = '<think>Look it up.</think>Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def backend(script: list[int]) -> FakeBackend:
    return FakeBackend(ModelInfo(MODEL, 4096), script)


@pytest.fixture
def thinking(make_client, backend, tiny_model):
    """A gateway reading answers with vLLM's qwen3 reasoning parser (and hermes for tool calls)."""
    def make(batch_size: int = 1):
        backend.batch_size = batch_size
        return make_client(backend, answers=AnswerReading(str(tiny_model), "hermes", reasoning_parser="qwen3"))
    return make


def streamed(chunks: list[dict], index: int = 0) -> tuple[str, str]:
    """(reasoning, content) of one choice's stream, as a client joins its deltas."""
    mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    return ("".join(c["delta"].get("reasoning") or "" for c in mine),
            "".join(c["delta"].get("content") or "" for c in mine))


def vllm_count(tiny_model, text: str, tokenizer) -> int:
    """vLLM's own count of the reasoning tokens in `text`."""
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    vllm_tokenizer = get_tokenizer(str(tiny_model))
    parser = ParserManager.get_parser(reasoning_parser_name="qwen3", tokenizer=vllm_tokenizer)(vllm_tokenizer)
    return parser.count_reasoning_tokens(tokenizer.encode(text, add_special_tokens=False))


def test_the_answer_carries_the_thinking_apart_from_the_content(thinking, backend, tokenizer, tiny_model):
    client = thinking()
    scripted(backend, tokenizer, THOUGHT)
    body = chat(client, n=2).json()
    for choice in body["choices"]:
        assert choice["message"] == {"role": "assistant", "content": CONTENT, "reasoning": REASONING}
        assert choice["finish_reason"] == "stop"
    counted = vllm_count(tiny_model, THOUGHT, tokenizer)
    assert counted > 0 and body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * counted}
    assert body["usage"]["completion_tokens"] == 2 * len(backend.script)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_a_stream_sends_the_thinking_as_reasoning_deltas(thinking, backend, tokenizer, tiny_model, batch_size):
    client = thinking(batch_size)
    scripted(backend, tokenizer, THOUGHT)
    chunks = sse_payloads(chat(client, stream=True, n=2, stream_options={"include_usage": True}))
    for index in (0, 1):
        assert streamed(chunks, index) == (REASONING, CONTENT)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        # The thinking comes first, the content after it; no delta shows a marker.
        kinds = [k for d in deltas for k in ("reasoning", "content") if d.get(k)]
        assert kinds == sorted(kinds, key=("reasoning", "content").index)
        assert not any("think>" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * vllm_count(
        tiny_model, THOUGHT, tokenizer)}


def test_include_reasoning_false_leaves_the_thinking_out(thinking, backend, tokenizer):
    client = thinking(3)
    scripted(backend, tokenizer, THOUGHT)
    r = chat(client, include_reasoning=False, logprobs=True, return_token_ids=True)
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CONTENT, "reasoning": None}
    # As vLLM: no log probabilities nor output ids, whose tokens would tell the thinking; the prompt's stay.
    assert choice["logprobs"] is None and choice["token_ids"] is None
    assert body["prompt_token_ids"] == backend.submitted[-1].prompt_token_ids
    chunks = sse_payloads(chat(client, include_reasoning=False, stream=True, logprobs=True, return_token_ids=True))
    assert streamed(chunks) == ("", CONTENT)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all(c.get("token_ids") is None and c["logprobs"] is None for c in choices)


def test_tool_calls_are_read_from_what_follows_the_thinking(thinking, backend, tokenizer):
    client = thinking()
    scripted(backend, tokenizer, CALL)
    choice = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert choice["message"]["reasoning"] == "Look it up." and choice["message"]["content"] == "Let me look. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    chunks = sse_payloads(chat(client, tools=[WEATHER], stream=True))
    assert streamed(chunks) == ("Look it up.", "Let me look. ")
    calls = tool_deltas(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_parser_reads_whether_the_template_turned_thinking_on(thinking, backend, tokenizer):
    """Qwen3's rule in vLLM's parser: without markers an answer is all thinking (its template opens
    the thinking), unless the request's template kwargs turned thinking off."""
    client = thinking()
    scripted(backend, tokenizer, CONTENT)
    on = chat(client).json()["choices"][0]["message"]
    assert on == {"role": "assistant", "content": None, "reasoning": CONTENT}
    for stream in (False, True):
        r = chat(client, chat_template_kwargs={"enable_thinking": False}, stream=stream)
        if stream:
            assert streamed(sse_payloads(r)) == ("", CONTENT)
        else:
            assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": CONTENT, "reasoning": None}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
])
def test_a_grammar_over_the_answer_is_refused_with_a_reasoning_parser(thinking, backend, body, param):
    r = chat(thinking(), **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "reasoning parser" in error["message"]
    assert backend.submitted == []


def test_a_gateway_without_a_reasoning_parser_leaves_the_thinking_in_the_content(client, backend, tokenizer):
    scripted(backend, tokenizer, THOUGHT)
    body = chat(client, messages=ASK).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}
    assert "completion_tokens_details" not in body["usage"]
