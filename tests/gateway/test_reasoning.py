"""Reasoning through the gateway over a scripted backend: a gateway started with one of vLLM's
reasoning parsers answers chats with the model's thinking as message.reasoning (delta.reasoning in
a stream) apart from its content, counts it in usage, hides it on include_reasoning false, and reads
tool calls from what follows it. The tiny model has no thinking tokens: vLLM's qwen3 parser reads
the <think> markers as text, and DeepSeek-R1's parser, which needs them as tokens, gets a copy of
the tiny tokenizer with the two added. The live engine's round trip is in test_serve.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_routes import sse_payloads
from test_tools import ASK, TIME, WEATHER, chat, scripted, tool_deltas

from gatewayfakes import MODEL, FakeBackend
from modelcopies import with_thinking_tokens

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.api.gateway.tools import AnswerReading, parse_tool_use
from llumdask.config import GatewayConfig

pytestmark = pytest.mark.vllm

REASONING, CONTENT = "Paris is in France; look it up.", "It is sunny in Paris."
THOUGHT = f"<think>{REASONING}</think>{CONTENT}"
CALL = '<think>Look it up.</think>Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def backend(script: list[int]) -> FakeBackend:
    return FakeBackend(ModelInfo(MODEL, 4096), script)


@pytest.fixture
def thinking(make_client, backend, tiny_model):
    """`thinking(batch_size, tool_parser, reasoning_parser, **options)`: a gateway reading answers with
    vLLM's parsers (by default qwen3's reasoning and hermes' tool calls), its backend sending
    `batch_size` tokens at a time."""
    def make(batch_size: int = 1, tool_parser: str | None = "hermes", reasoning_parser: str = "qwen3", **options):
        backend.batch_size = batch_size
        return make_client(backend, answers=AnswerReading(str(tiny_model), tool_parser,
                                                          reasoning_parser=reasoning_parser, **options))
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
    ({"response_format": {"type": "json_object"}}, "response_format"),  # instances not known to read thinking
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "text"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
])
def test_a_grammar_over_the_answer_is_refused_where_it_would_take_in_the_thinking(thinking, backend, body, param):
    r = chat(thinking(), **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "reasoning parser" in error["message"]
    assert backend.submitted == []


def test_a_structured_answer_follows_the_thinking_on_instances_that_read_it(thinking, backend, tokenizer):
    """Instances started with the reasoning parser apply the grammar once the thinking ends; the
    gateway tells them whether it ended before the first token (vLLM's reasoning_ended: here the
    prompt does not close it; hiding the reasoning constrains from the start, as vLLM)."""
    client = thinking(tool_parser=None, engines_reason=True)
    scripted(backend, tokenizer, '<think>Needs an object.</think>{"city": "Paris"}')
    message = chat(client, response_format={"type": "json_object"}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"city": "Paris"}', "reasoning": "Needs an object."}
    assert backend.submitted[-1].sampling.json_object and backend.submitted[-1].sampling.reasoning_ended is False
    assert backend.submitted[-1].sampling.reasoning_kwargs is None
    chat(client, response_format={"type": "json_object"}, include_reasoning=False,
         chat_template_kwargs={"enable_thinking": True})
    sampling = backend.submitted[-1].sampling
    # The template's switches too: the engine's parser reads them (vLLM's reasoning_parser_kwargs).
    assert sampling.reasoning_ended is True and json.loads(sampling.reasoning_kwargs) == {"enable_thinking": True}
    chat(client)  # no grammar: nothing to tell
    assert backend.submitted[-1].sampling.reasoning_ended is None


# Qwen3-Coder's tool-call parser is an engine-based one: it takes its markup out of any answer.
CODER = "qwen3_coder"
REQUIRED = '<think>Pick a tool.</think>[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
NAMED = '<think>Pick a city.</think>{"city": "Paris"}'
PICK_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice, script, thought", [("required", REQUIRED, "Pick a tool."),
                                                          (PICK_WEATHER, NAMED, "Pick a city.")], ids=["required", "named"])
# xLAM's parser reads "required" and named calls as vLLM's JSON (it has no structural tag).
@pytest.mark.parametrize("batch_size, tool_parser", [(1, None), (3, None), (8, None), (3, "xlam")])
def test_a_constrained_call_is_read_after_the_thinking(thinking, backend, tokenizer, tool_choice, script, thought,
                                                       batch_size, tool_parser):
    """tool_choice "required" or a named function on instances that read the thinking: their grammar
    (vLLM's JSON schema) applies once it ends (the gateway tells them where, vLLM's reasoning_ended),
    and the calls are read from what follows it, whole and streamed (a named function's arguments
    after the thinking's deltas, never with them, where a delta does not span the thinking's end);
    hidden reasoning leaves the calls."""
    client = thinking(batch_size, tool_parser=tool_parser, engines_reason=True)
    scripted(backend, tokenizer, script)
    choice = chat(client, tools=[WEATHER], tool_choice=tool_choice).json()["choices"][0]
    sampling = backend.submitted[-1].sampling
    assert json.loads(sampling.json_schema) and sampling.structural_tag is None and sampling.reasoning_ended is False
    assert choice["message"]["reasoning"] == thought and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
    chunks = sse_payloads(chat(client, tools=[WEATHER], tool_choice=tool_choice, stream=True))
    assert streamed(chunks) == (thought, "")
    assert [(c["name"], json.loads(c["arguments"])) for c in tool_deltas(chunks).values()] == [
        ("get_weather", {"city": "Paris"})]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("reasoning") and d.get("tool_calls") for d in deltas)
    assert [k for d in deltas for k in ("reasoning", "tool_calls") if d.get(k)][-1] == "tool_calls"
    # Hidden reasoning: the grammar holds from the first token (vLLM's reasoning_ended), so the
    # answer is the JSON alone; so it reads.
    scripted(backend, tokenizer, script.split("</think>")[1])
    hidden = chat(client, tools=[WEATHER], tool_choice=tool_choice, include_reasoning=False).json()["choices"][0]
    assert hidden["message"]["reasoning"] is None and hidden["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert backend.submitted[-1].sampling.reasoning_ended is True


@pytest.mark.parametrize("reasoning_parser, keeps", [(None, False), ("qwen3", True)])
def test_an_engine_based_parser_adjusts_a_none_chat_only_beside_a_reasoning_parser(tiny_model, reasoning_parser, keeps):
    """vLLM's renderer has the parsers adjust a tool_choice "none" chat where a reasoning parser is
    composed with them (or the parser always asks, or it is Mistral's with a grammar-capable
    tokenizer: neither here), and an engine-based tool-call parser's adjustment (Qwen3-Coder's)
    keeps special tokens in the text the parsers read. (Qwen3's parsers drop them from what they
    show either way, so the answer alone cannot tell.)"""
    reading = AnswerReading(str(tiny_model), CODER, reasoning_parser=reasoning_parser)
    use = parse_tool_use({"tools": [WEATHER], "tool_choice": "none"})
    read = asyncio.run(reading.readers(use, 1, [1, 2, 3], {}))
    assert read.keep_special is keeps and read.grammar is None


HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CODER_CALL = "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>"


@pytest.mark.parametrize("tool_choice", ["required", PICK_WEATHER], ids=["required", "named"])
# Qwen3-Coder's tag lets text come before a required call; Hermes' does not.
@pytest.mark.parametrize("tool_parser, call", [("hermes", HERMES_CALL), (CODER, f"Let me look. {CODER_CALL}")])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_parser_with_a_structural_tag_constrains_and_reads_calls_in_the_models_syntax(
        thinking, backend, tokenizer, tool_choice, tool_parser, call, batch_size):
    """vLLM 0.32's tool calling: a tool-call parser with a structural tag for its model's markup
    (hermes, qwen3_coder) constrains "required" and named calls to that markup rather than JSON
    (the grammar applies once the thinking ends), and reads them back as it reads "auto" (text
    before a required call is content); a named call finishes "stop", as OpenAI's does."""
    client = thinking(batch_size, tool_parser=tool_parser, engines_reason=True)
    scripted(backend, tokenizer, f"<think>Pick a tool.</think>{call}")
    text = call[:call.index("<tool_call>")].strip()
    choice = chat(client, tools=[WEATHER], tool_choice=tool_choice).json()["choices"][0]
    sampling = backend.submitted[-1].sampling
    assert sampling.json_schema is None and "<tool_call>" in sampling.structural_tag
    assert sampling.reasoning_ended is False
    assert choice["message"]["reasoning"] == "Pick a tool." and (choice["message"]["content"] or "").strip() == text
    [read] = choice["message"]["tool_calls"]
    assert read["function"]["name"] == "get_weather" and json.loads(read["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
    chunks = sse_payloads(chat(client, tools=[WEATHER], tool_choice=tool_choice, stream=True))
    assert streamed(chunks)[0] == "Pick a tool." and streamed(chunks)[1].strip() == text
    assert [(c["name"], json.loads(c["arguments"])) for c in tool_deltas(chunks).values()] == [
        ("get_weather", {"city": "Paris"})]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == choice["finish_reason"]


@pytest.mark.parametrize("level, strict, parallel, constrained", [
    ("auto", None, True, False), ("auto", True, True, True), ("auto", None, False, True),
    ("function", None, True, True), ("parameter", False, True, True)])
def test_auto_is_constrained_as_vllms_tool_strict_level_and_the_tools_strict_say(
        thinking, backend, tokenizer, level, strict, parallel, constrained):
    """tool_choice "auto": left free unless a tool is marked strict (its arguments then follow its
    schema), parallel calls are off (the tag admits one call), or the gateway's tool strict level
    asks for the calls' envelope (function) or every tool's arguments (parameter), as vLLM's
    --tool-strict-level."""
    client = thinking(tool_parser="hermes", engines_reason=True, tool_strict_level=level)
    scripted(backend, tokenizer, HERMES_CALL)
    tool = {"type": "function", "function": {**WEATHER["function"], **({} if strict is None else {"strict": strict})}}
    [read] = chat(client, tools=[tool], parallel_tool_calls=parallel).json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(read["function"]["arguments"]) == {"city": "Paris"}
    tag = backend.submitted[-1].sampling.structural_tag
    assert (tag is not None) == constrained
    if constrained:  # the arguments are held to the schema where the tool is strict or the level is "parameter"
        assert ('"city"' in tag) == (strict is True or level == "parameter")


def test_auto_beside_a_response_format_gets_calls_or_the_format(thinking, backend, tokenizer):
    """vLLM's "auto" with a response format and a strict tool: the grammar admits a call in the
    model's markup or the format; the gateway's grammar is that tag, in place of the format's."""
    client = thinking(tool_parser="hermes", engines_reason=True)
    scripted(backend, tokenizer, HERMES_CALL)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = {"tools": [strict], "response_format": {"type": "json_object"}}
    [read] = chat(client, **body).json()["choices"][0]["message"]["tool_calls"]
    assert read["function"]["name"] == "get_weather"
    sampling = backend.submitted[-1].sampling
    assert sampling.json_object is False and sampling.json_schema is None
    tag = json.loads(sampling.structural_tag)
    assert tag["format"]["type"] == "or" and len(tag["format"]["elements"]) == 2
    # Without a strict tool vLLM leaves the format alone.
    chat(client, tools=[WEATHER], response_format={"type": "json_object"})
    assert backend.submitted[-1].sampling.json_object is True and backend.submitted[-1].sampling.structural_tag is None


@pytest.mark.parametrize("tool_parser", [None, "xlam", "hermes"])
@pytest.mark.parametrize("own", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": {"choice": ["a"]}}], ids=["schema", "regex", "choice"])
def test_a_named_function_beside_a_format_takes_the_place_of_the_format(thinking, backend, tokenizer, tool_parser, own):
    """The named function's grammar replaces the request's own (vLLM's server refuses the two
    together only for its structured_outputs field)."""
    client = thinking(tool_parser=tool_parser, engines_reason=True)
    scripted(backend, tokenizer, '{"city": "Paris"}')
    assert chat(client, tools=[WEATHER], tool_choice=PICK_WEATHER, **own).status_code == 200
    sampling = backend.submitted[-1].sampling
    assert sampling.regex is None and sampling.choice == () and (sampling.json_schema or sampling.structural_tag)


@pytest.mark.parametrize("tool_parser, reasoning_parser", [("hermes", "qwen3"), (None, "qwen3")])
@pytest.mark.parametrize("tag", [{"type": "structural_tag", "format": {"type": "nonsense"}},
                                 {"type": "structural_tag", "format": json.loads("[" * 90 + "]" * 90)}],
                         ids=["unreadable", "deep"])
def test_a_structural_tag_goes_to_the_engine_to_read_whatever_parsers_the_gateway_has(
        thinking, backend, tokenizer, tool_parser, reasoning_parser, tag):
    """A structural tag is the engine's to read (its refusal is a 400 request_rejected): parsers
    configured at the gateway do not read it first."""
    client = thinking(tool_parser=tool_parser, reasoning_parser=reasoning_parser, engines_reason=True)
    scripted(backend, tokenizer, "abc")
    assert chat(client, response_format=tag).status_code == 200
    assert json.loads(backend.submitted[-1].sampling.structural_tag) == tag


@pytest.mark.parametrize("batch_size", [1, 8])
def test_with_parallel_calls_off_only_the_first_call_the_parser_reads_is_answered(thinking, backend, tokenizer,
                                                                                  batch_size):
    """vLLM's server keeps the first call alone where parallel_tool_calls is false, whole and
    streamed, for parsers whose grammar does not limit the calls (xLAM's under "auto")."""
    client = thinking(batch_size, tool_parser="xlam")
    scripted(backend, tokenizer, '<think>Both.</think>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                 '{"name": "get_time", "arguments": {}}]')
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        body = {"tools": [WEATHER, TIME], "parallel_tool_calls": parallel}
        choice = chat(client, **body).json()["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
        assert choice["finish_reason"] == "tool_calls"
        assert [c["name"] for c in tool_deltas(sse_payloads(chat(client, stream=True, **body))).values()] == names


@pytest.mark.parametrize("tool_parser", [None, "xlam"])
def test_tools_vllm_refuses_and_template_switches_its_parser_cannot_read_are_400(thinking, backend, tool_parser):
    """What vLLM's schema derivation and parsers refuse is a 400 naming the field, not a failure
    here: two tools defining one $defs entry differently; an enable_thinking Qwen3's parser cannot
    read."""
    client = thinking(tool_parser=tool_parser, engines_reason=True)
    defining = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "$defs": {
        "A": {"type": kind}}}}} for name, kind in (("a", "string"), ("b", "integer"))]
    error = chat(client, tools=defining, tool_choice="required").json()["error"]
    assert error["param"] == "tools" and "multiple schemas" in error["message"]
    error = chat(client, chat_template_kwargs={"enable_thinking": {"a": 1}}).json()["error"]
    assert error["param"] == "chat_template_kwargs" and "parser" in error["message"]
    assert backend.submitted == []


def test_a_named_call_cut_off_in_the_thinking_still_opens_its_call(thinking, backend, tokenizer):
    """Cut off by max_tokens before the thinking ended: the named function's call comes, with no
    arguments, as it does when cut off before its first argument without a reasoning parser."""
    client = thinking(tool_parser=None, engines_reason=True)
    scripted(backend, tokenizer, NAMED)
    body = {"tools": [WEATHER], "tool_choice": PICK_WEATHER, "max_tokens": 3}
    whole = chat(client, **body).json()["choices"][0]
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    chunks = sse_payloads(chat(client, stream=True, **body))
    assert [(c["name"], c["arguments"]) for c in tool_deltas(chunks).values()] == [("get_weather", "")]


def test_a_gateway_without_a_reasoning_parser_leaves_the_thinking_in_the_content(client, backend, tokenizer):
    scripted(backend, tokenizer, THOUGHT)
    body = chat(client, messages=ASK).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}
    assert "completion_tokens_details" not in body["usage"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_thinking_budget_goes_to_the_engine_on_either_endpoint(thinking, backend, tokenizer, path):
    """vLLM's thinking_token_budget: the engine ends the thinking after that many tokens (its
    reasoning parser tells the markers); -1 is no limit, as in vLLM."""
    client = thinking(tool_parser=None)
    scripted(backend, tokenizer, THOUGHT)
    prompt = {"messages": ASK} if "chat" in path else {"prompt": "Why?"}
    for budget, sent in ((0, 0), (12, 12), (-1, None)):
        r = client.post(path, json={"model": MODEL, "max_tokens": 50, **prompt, "thinking_token_budget": budget})
        assert r.status_code == 200, r.text
        assert backend.submitted[-1].sampling.thinking_token_budget == sent


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("budget, message", [(-2, "integer >= 0"), (1.5, "must be an integer"), (True, "must be an integer"),
                                             ("8", "must be an integer")])
def test_a_thinking_budget_that_is_no_count_is_a_400(thinking, backend, path, budget, message):
    prompt = {"messages": ASK} if "chat" in path else {"prompt": "Why?"}
    r = thinking(tool_parser=None).post(path, json={"model": MODEL, **prompt, "thinking_token_budget": budget})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert message in r.json()["error"]["message"]
    assert backend.submitted == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_thinking_budget_without_a_reasoning_parser_is_a_400(client, backend, path):
    """As vLLM's server: without a reasoning parser nothing tells where the thinking ends (the sim
    engine, which models no thinking, never has one); no limit (-1) asks nothing."""
    prompt = {"messages": ASK} if "chat" in path else {"prompt": "Why?"}
    r = client.post(path, json={"model": MODEL, "max_tokens": 2, **prompt, "thinking_token_budget": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert "--reasoning-parser" in r.json()["error"]["message"] and backend.submitted == []
    assert client.post(path, json={"model": MODEL, "max_tokens": 2, **prompt, "thinking_token_budget": -1}).status_code == 200


# ------------------------------------------------------------------ parsers that read tokens, and tool markup
XML_CALL = ("<think>abc def</think>Hello world <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>")




@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("body, content", [({}, "Hello world"),
                                           ({"tools": [WEATHER], "tool_choice": "none"}, "Hello world ")])
def test_without_auto_the_tool_parser_still_takes_its_markup_out(thinking, backend, tokenizer, body, content,
                                                                  batch_size):
    """As `vllm serve` with the same parsers: every answer goes through them, so a call the model
    writes unasked is no content (and no call). (vLLM's parser keeps the space before the markup
    where the request offered tools, whole; and always in a stream.)"""
    client = thinking(batch_size, CODER)
    scripted(backend, tokenizer, XML_CALL)
    choice = chat(client, **body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": content, "reasoning": "abc def"}
    assert choice["finish_reason"] == "stop"
    chunks = sse_payloads(chat(client, stream=True, **body))
    assert streamed(chunks) == ("abc def", "Hello world ") and not tool_deltas(chunks)


@pytest.mark.parametrize("batch_size", [1, 3, 100])
@pytest.mark.parametrize("closed", [True, False])
def test_a_call_the_parser_holds_back_comes_at_the_end_of_the_stream(thinking, backend, tokenizer, batch_size, closed):
    """The arguments an engine-based parser buffers (a call cut off after its last parameter too)
    come with the end of the stream, so the streamed call equals the whole answer's."""
    client = thinking(batch_size, CODER)
    text = XML_CALL if closed else XML_CALL[:XML_CALL.index("</parameter>") + len("</parameter>\n")]
    scripted(backend, tokenizer, text)
    [call] = chat(client, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    calls = tool_deltas(sse_payloads(chat(client, tools=[WEATHER], stream=True)))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call["function"]["arguments"])]


def test_the_parsers_read_the_request_s_template_kwargs(thinking, backend, tokenizer):
    """Nemotron 3's parser reads force_nonempty_content from the request: thinking that is all
    there is becomes the content."""
    client = thinking(tool_parser=None, reasoning_parser="nemotron_v3")
    scripted(backend, tokenizer, "<think>The answer is 4.</think>")
    assert chat(client).json()["choices"][0]["message"]["reasoning"] == "The answer is 4."
    forced = chat(client, chat_template_kwargs={"force_nonempty_content": True}).json()["choices"][0]["message"]
    assert forced == {"role": "assistant", "content": "The answer is 4.", "reasoning": None}


@pytest.fixture(scope="module")
def think_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with <think> and </think> added to its tokenizer (the scripted backend never runs it)."""
    return with_thinking_tokens(tiny_model, tmp_path_factory.mktemp("think") / "tiny-think")


@pytest.fixture
def r1(think_model, backend):
    """A gateway with DeepSeek-R1's reasoning parser over the tokenizer that has thinking tokens."""
    tokenizer = load_tokenizer(think_model)
    app = create_app(backend.open, tokenizer, GatewayConfig(),
                     AnswerReading(str(think_model), reasoning_parser="deepseek_r1", engines_reason=True))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokenizer


def test_deepseek_r1_reads_and_counts_the_thinking_tokens(r1, backend):
    client, tokenizer = r1
    scripted(backend, tokenizer, THOUGHT)
    assert tokenizer.encode("<think></think>", add_special_tokens=False) == [512, 513]
    body = chat(client).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CONTENT, "reasoning": REASONING}
    # The tokens between the two: the thinking's own (the added tokens split the text there).
    assert body["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": len(tokenizer.encode(REASONING, add_special_tokens=False))}


@pytest.mark.parametrize("body, script", [
    ({"tools": [WEATHER], "tool_choice": "required"}, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
    ({"tools": [WEATHER], "tool_choice": PICK_WEATHER}, '{"city": "Paris"}'),
    ({"response_format": {"type": "json_object"}}, '{"city": "Paris"}'),
], ids=["required", "named", "json_object"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_from_the_first_token_leaves_no_thinking_to_read(r1, backend, body, script, stream):
    """Hidden reasoning tells the engine the thinking ended before the answer (vLLM's rule), so the
    grammar holds from its first token and nothing of the answer is thinking: DeepSeek-R1's parser,
    which reads an answer as thinking until </think>, would take the JSON for thinking and hide it."""
    client, tokenizer = r1
    scripted(backend, tokenizer, script)
    r = chat(client, include_reasoning=False, stream=stream, **body)
    assert backend.submitted[-1].sampling.reasoning_ended is True
    if stream:
        chunks = sse_payloads(r)
        calls = [(c["name"], json.loads(c["arguments"])) for c in tool_deltas(chunks).values()]
        content = streamed(chunks)[1]
        assert not any(c["choices"][0]["delta"].get("reasoning") for c in chunks if c["choices"])
    else:
        message = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]
        content = message["content"] or ""
        assert message["reasoning"] is None and r.json()["usage"].get("completion_tokens_details") in (
            None, {"reasoning_tokens": 0})
    if "tools" in body:
        assert calls == [("get_weather", {"city": "Paris"})] and not content
    else:
        assert json.loads(content) == {"city": "Paris"} and not calls


def test_thinking_the_prompt_closed_leaves_the_stream_all_content(r1, backend):
    """DeepSeek-R1's rule: an answer is thinking until </think>, unless the prompt closed it (a
    prefilled answer here): the stream's parser is given the prompt, and a grammar starts at once."""
    client, tokenizer = r1
    scripted(backend, tokenizer, CONTENT)
    assert streamed(sse_payloads(chat(client, stream=True))) == (CONTENT, "")
    prefilled = [*ASK, {"role": "assistant", "content": "<think>Easy.</think>"}]
    chunks = sse_payloads(chat(client, stream=True, messages=prefilled, continue_final_message=True))
    assert streamed(chunks) == ("", CONTENT)
    for messages, ended in ((ASK, False), (prefilled, True)):
        r = chat(client, messages=messages, continue_final_message=messages is prefilled,
                 structured_outputs={"regex": "[A-Za-z .]+"})
        assert backend.submitted[-1].sampling.reasoning_ended is ended
        # Whole, too: where the grammar held from the first token the answer is all content.
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message["reasoning"]) == ((CONTENT, None) if ended else (None, CONTENT))


def test_with_auto_a_structured_answer_without_thinking_is_still_read_for_calls(thinking, backend, tokenizer):
    """tool_choice "auto" beside a structured output, the thinking off: the grammar holds from the
    first token, and the tool-call parser still reads the answer (vLLM's composed parser, as
    vLLM's server reads it)."""
    client = thinking(tool_parser="xlam", engines_reason=True)
    scripted(backend, tokenizer, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    body = {"tools": [WEATHER], "tool_choice": "auto", "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"enable_thinking": False}}
    choice = chat(client, **body).json()["choices"][0]
    assert backend.submitted[-1].sampling.reasoning_ended is True
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls"
    chunks = sse_payloads(chat(client, stream=True, **body))
    assert [c["name"] for c in tool_deltas(chunks).values()] == ["get_weather"]


class _Parser:
    """A stand-in for vLLM's composed parser: each parse_delta returns the next scripted message."""

    def __init__(self, messages: list, rest: str) -> None:
        self._messages = messages
        self.tool_parser = type("ToolParser", (), {"prev_tool_call_arr": [{}], "get_remaining_unstreamed_args":
                                                  staticmethod(lambda: rest)})()

    def parse_delta(self, *args, finished: bool):
        return self._messages.pop(0)


def _message(calls: bool):
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

    return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": '))]
                        if calls else [])


@pytest.mark.parametrize("last_had_calls, flush_has_calls, appended", [
    (True, False, True), (False, False, False), (True, True, False)])
def test_the_arguments_a_parser_held_back_go_with_the_last_delta_that_carried_calls(last_had_calls, flush_has_calls,
                                                                                 appended):
    """vLLM's rule (its parser's finalize): the held-back arguments are added to the last delta if
    that one carries calls, and only then; here that delta came before the end's flush."""
    from llumdask.api.gateway.tools import AnswerReader, ToolUse

    parser = _Parser([_message(last_had_calls), _message(flush_has_calls)], rest="1}")
    reader = AnswerReader(ToolUse((WEATHER,), "auto", None, True), parser, None, lambda name: "id", [], auto_tools=True)
    reader.delta("x", [1])
    rest = [c.arguments for c in reader.last().calls if c.arguments == "1}"]
    assert rest == (["1}"] if appended else [])
