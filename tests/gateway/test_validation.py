"""The bad-input matrix: each case gets its status and an OpenAI-shaped error naming what is wrong."""

from __future__ import annotations

import json

import pytest
from gatewayfakes import MAX_CONTEXT, MODEL

USER = [{"role": "user", "content": "Hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = _nested(70)  # vLLM refuses schemas nested past 64 levels
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def ok(**fields):
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": USER, **fields}


CASES = [
    # (id, path, body, status, code, param, words in the message)
    ("not an object", C, [1, 2], 400, "invalid_type", None, "JSON object"),
    ("model missing", C, {"prompt": "x"}, 400, "missing_required_parameter", "model", "model"),
    ("model wrong type", C, ok(model=3), 400, "invalid_type", "model", "string"),
    ("unknown model", C, ok(model="gpt-9"), 404, "model_not_found", "model", "gpt-9"),
    ("prompt missing", C, {"model": MODEL}, 400, "missing_required_parameter", "prompt", "prompt"),
    ("empty prompt", C, ok(prompt=""), 400, "invalid_value", "prompt", "empty"),
    ("empty token prompt", C, ok(prompt=[]), 400, "invalid_value", "prompt", "empty"),
    ("prompt of bools", C, ok(prompt=[True]), 400, "invalid_type", "prompt", "token ids"),
    ("prompt token outside vocab", C, ok(prompt=[1, 99999]), 400, "invalid_value", "prompt", "99999"),
    ("prompt number", C, ok(prompt=5), 400, "invalid_type", "prompt", "a number"),
    ("batched prompts", C, ok(prompt=["a", "b"]), 400, "unsupported_parameter", "prompt", "one prompt"),
    ("max_tokens string", C, ok(max_tokens="5"), 400, "invalid_type", "max_tokens", "integer"),
    ("max_tokens float", C, ok(max_tokens=2.5), 400, "invalid_type", "max_tokens", "integer"),
    ("max_tokens zero", C, ok(max_tokens=0), 400, "invalid_value", "max_tokens", ">= 1"),
    ("too long for context", C, ok(max_tokens=MAX_CONTEXT), 400, "context_length_exceeded", "max_tokens",
     f"maximum context length is {MAX_CONTEXT} tokens"),
    ("prompt fills context", C, ok(prompt=[5] * MAX_CONTEXT), 400, "context_length_exceeded", "prompt",
     f"{MAX_CONTEXT} tokens"),
    ("temperature string", C, ok(temperature="hot"), 400, "invalid_type", "temperature", "number"),
    ("temperature too high", C, ok(temperature=2.5), 400, "invalid_value", "temperature", "[0, 2]"),
    ("top_p zero", C, ok(top_p=0), 400, "invalid_value", "top_p", "(0, 1]"),
    ("seed negative", C, ok(seed=-1), 400, "invalid_value", "seed", "seed"),
    ("stop number", C, ok(stop=3), 400, "invalid_type", "stop", "string"),
    ("stop empty string", C, ok(stop=[""]), 400, "invalid_value", "stop", "empty"),
    ("thousands of stop strings", C, ok(stop=[f"s{k}" for k in range(5000)]), 400, "invalid_value", "stop",
     "at most 64 stop strings"),
    ("a stop string of a megabyte's length", CHAT, chat(stop=["x" * 200_000]), 400, "invalid_value", "stop",
     "at most 1000 characters"),
    ("max_tokens past any context", C, ok(max_tokens=10**15), 400, "context_length_exceeded", "max_tokens",
     "maximum context length"),
    ("include_stop_str_in_output not bool", C, ok(include_stop_str_in_output=1), 400, "invalid_type",
     "include_stop_str_in_output", "boolean"),
    ("skip_special_tokens not bool", CHAT, chat(skip_special_tokens="no"), 400, "invalid_type",
     "skip_special_tokens", "boolean"),
    ("stream not bool", C, ok(stream="yes"), 400, "invalid_type", "stream", "boolean"),
    ("stream_options without stream", C, ok(stream_options={"include_usage": True}), 400, "invalid_value",
     "stream_options", "stream"),
    ("include_usage not bool", C, ok(stream=True, stream_options={"include_usage": 1}), 400, "invalid_type",
     "stream_options.include_usage", "boolean"),
    ("n zero", C, ok(n=0), 400, "invalid_value", "n", "between 1 and 128"),
    ("n too many", CHAT, chat(n=129), 400, "invalid_value", "n", "between 1 and 128"),
    ("best_of below n", C, ok(n=3, best_of=2), 400, "invalid_value", "best_of", ">= n"),
    ("best_of streamed", C, ok(n=1, best_of=2, stream=True), 400, "invalid_value", "best_of", "cannot be streamed"),
    ("logprobs too many", C, ok(logprobs=21), 400, "invalid_value", "logprobs", "between 0 and 20"),
    ("logprobs not a number", C, ok(logprobs=True), 400, "invalid_type", "logprobs", "integer"),
    ("echo not bool", C, ok(echo="yes"), 400, "invalid_type", "echo", "boolean"),
    ("chat logprobs not bool", CHAT, chat(logprobs=2), 400, "invalid_type", "logprobs", "boolean"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "invalid_value", "top_logprobs", "logprobs"),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs",
     "between 0 and 20"),
    ("presence_penalty too large", C, ok(presence_penalty=2.5), 400, "invalid_value", "presence_penalty", "[-2, 2]"),
    ("frequency_penalty string", C, ok(frequency_penalty="x"), 400, "invalid_type", "frequency_penalty", "number"),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "invalid_value", "repetition_penalty",
     "> 0"),
    ("top_k float", C, ok(top_k=2.5), 400, "invalid_type", "top_k", "integer"),
    ("top_k below -1", C, ok(top_k=-2), 400, "invalid_value", "top_k", ">= -1"),
    ("min_p above 1", C, ok(min_p=1.5), 400, "invalid_value", "min_p", "[0, 1]"),
    ("min_tokens negative", C, ok(min_tokens=-1), 400, "invalid_value", "min_tokens", ">= 0"),
    ("min_tokens over max_tokens", C, ok(max_tokens=4, min_tokens=5), 400, "invalid_value", "min_tokens",
     "must not exceed max_tokens (4)"),
    ("logit_bias list", C, ok(logit_bias=[1]), 400, "invalid_type", "logit_bias", "object"),
    ("logit_bias too strong", CHAT, chat(logit_bias={"5": 101}), 400, "invalid_value", "logit_bias",
     "[-100, 100]"),
    ("logit_bias key not an id", C, ok(logit_bias={"a": 1}), 400, "invalid_value", "logit_bias", "token ids"),
    ("logit_bias outside vocab", C, ok(logit_bias={"99999": 1}), 400, "invalid_value", "logit_bias", "99999"),
    ("structured_outputs two kinds", C, ok(structured_outputs={"regex": "a", "choice": ["a"]}), 400, "invalid_value",
     "structured_outputs", "exactly one"),
    ("structured_outputs no kind", CHAT, chat(structured_outputs={}), 400, "invalid_value", "structured_outputs",
     "got none"),
    ("structured_outputs and response_format", CHAT,
     chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), 400, "invalid_value",
     "structured_outputs", "send one"),
    ("structured_outputs tag not JSON text", C, ok(structured_outputs={"structural_tag": {"type": "structural_tag"}}),
     400, "invalid_type", "structured_outputs.structural_tag", "non-empty string"),
    ("structured_outputs tag no object", C, ok(structured_outputs={"structural_tag": "[1]"}), 400, "invalid_value",
     "structured_outputs.structural_tag", "JSON text of a structural tag object"),
    ("structured_outputs tag nested deep", C, ok(structured_outputs={"structural_tag": "[" * 5000 + "]" * 5000}), 400,
     "invalid_value", "structured_outputs.structural_tag", "JSON text of a structural tag object"),
    ("structured_outputs whitespace", C, ok(structured_outputs={"regex": "a", "whitespace_pattern": " "}), 400,
     "unsupported_parameter", "structured_outputs.whitespace_pattern", "not honoured"),
    ("structured_outputs empty choice", C, ok(structured_outputs={"choice": []}), 400, "invalid_type",
     "structured_outputs.choice", "non-empty list"),
    ("structured_outputs regex number", C, ok(structured_outputs={"regex": 5}), 400, "invalid_type",
     "structured_outputs.regex", "non-empty string"),
    ("structured_outputs json text", C, ok(structured_outputs={"json": "{not json"}), 400, "invalid_type",
     "structured_outputs.json", "schema object"),
    ("structured_outputs json false", C, ok(structured_outputs={"json_object": False}), 400, "invalid_value",
     "structured_outputs.json_object", "true"),
    ("structured_outputs nested too deep", C,
     ok(structured_outputs={"json": json.dumps(DEEP)}), 400, "invalid_value", "structured_outputs.json", "64 levels"),
    ("response_format nested too deep", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}), 400, "invalid_value",
     "response_format.json_schema.schema", "64 levels"),
    ("structured_outputs json far too deep", C, ok(structured_outputs={"json": "[" * 5000 + "]" * 5000}), 400,
     "invalid_type", "structured_outputs.json", "schema object"),
    ("stop tokens masked past the sampler's bound", C, ok(min_tokens=1, max_tokens=4, stop_token_ids=list(range(2, 140))),
     400, "invalid_value", None, "at most 128"),
    ("bad_words not words", CHAT, chat(bad_words=["cat", 5]), 400, "invalid_value", "bad_words", "list of words"),
    ("bad_words a word", C, ok(bad_words="cat"), 400, "invalid_type", "bad_words", "array"),
    ("allowed_token_ids too many", C, ok(allowed_token_ids=list(range(1025))), 400, "invalid_value",
     "allowed_token_ids", "at most 1024"),
    ("prompt_logprobs false", C, ok(prompt_logprobs=False), 400, "invalid_type", "prompt_logprobs", "integer"),
    ("prompt_logprobs the whole vocabulary", C, ok(prompt_logprobs=-1), 400, "invalid_value", "prompt_logprobs",
     "between 0 and 20"),
    ("prompt_logprobs 21", CHAT, chat(prompt_logprobs=21), 400, "invalid_value", "prompt_logprobs", "between 0 and 20"),
    ("prompt_logprobs streamed", C, ok(prompt_logprobs=1, stream=True), 400, "invalid_value", "prompt_logprobs",
     "not available when stream"),
    ("structured_outputs not an object", C, ok(structured_outputs=["a"]), 400, "invalid_type", "structured_outputs",
     "object"),
    ("allowed_token_ids not a list", C, ok(allowed_token_ids=5), 400, "invalid_type", "allowed_token_ids", "array"),
    ("allowed_token_ids empty", CHAT, chat(allowed_token_ids=[]), 400, "invalid_value", "allowed_token_ids", "empty"),
    ("allowed_token_ids not ids", C, ok(allowed_token_ids=[1, "a"]), 400, "invalid_value", "allowed_token_ids",
     "token ids"),
    ("allowed_token_ids outside vocab", C, ok(allowed_token_ids=[1, 99999]), 400, "invalid_value", "allowed_token_ids",
     "99999"),
    ("priority unknown", C, ok(priority="urgent"), 400, "invalid_value", "priority", "'high' or 'normal'"),
    ("priority number", C, ok(priority=1), 400, "invalid_type", "priority", "'high' or 'normal'"),
    ("stop token outside vocab", C, ok(stop_token_ids=[100000]), 400, "invalid_value", "stop_token_ids", "100000"),
    ("messages missing", CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages", "messages"),
    ("messages empty", CHAT, chat(messages=[]), 400, "invalid_value", "messages", "empty"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "invalid_type", "messages", "list"),
    ("message not an object", CHAT, chat(messages=["hi"]), 400, "invalid_type", "messages[0]", "object"),
    ("bad role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "invalid_value",
     "messages[0].role", "robot"),
    ("content number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "invalid_type",
     "messages[0].content", "string"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "unsupported_parameter", "messages[0].content[0]", "only text"),
    ("tool without a function", CHAT, chat(tools=[{"type": "function"}]), 400, "invalid_value", "tools[0]", "must be"),
    ("response_format unknown", CHAT, chat(response_format={"type": "xml"}), 400, "invalid_value",
     "response_format.type", "'xml'"),
    ("response_format not an object", C, ok(response_format="json"), 400, "invalid_type", "response_format", "object"),
    ("json_schema without a schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "invalid_type", "response_format.json_schema.schema", "object"),
    ("json_schema invalid", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     400, "invalid_value", "response_format.json_schema.schema", "not a valid JSON schema"),
    ("chat too long", CHAT, chat(max_completion_tokens=MAX_CONTEXT), 400, "context_length_exceeded",
     "max_tokens", "maximum context length"),
    # Integers past a float's range are no numbers (vLLM reads floats).
    ("temperature past a float", C, ok(temperature=10**400), 400, "invalid_type", "temperature", "number"),
    ("penalty past a float", C, ok(frequency_penalty=-10**400), 400, "invalid_value", "frequency_penalty", "[-2, 2]"),
    ("logit bias past a float", C, ok(logit_bias={"5": 10**400}), 400, "invalid_value", "logit_bias", "[-100, 100]"),
    ("tool_choice neither text nor object", CHAT, chat(tools=[WEATHER], tool_choice=True), 400, "invalid_value",
     "tool_choice", "'none', 'auto', 'required' or a function"),
    ("schema dialect not text", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$schema": 5}}}), 400, "invalid_value", "response_format.json_schema.schema", "$schema"),
    ("pattern repeat past re's", CHAT, chat(structured_outputs={"json": {"type": "string", "pattern": "a{4294967296}"}}),
     400, "invalid_value", "structured_outputs.json", "not a valid JSON schema"),
    ("tool call arguments nested past the parser", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000}}]}]), 400, "invalid_value",
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
]


@pytest.mark.parametrize("path, body, status, code, param, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(client, backend, path, body, status, code, param, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert words in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert backend.submitted == []  # refused before anything reached the cluster


@pytest.mark.parametrize("path, body, param", [
    (C, ok(structured_outputs={"regex": "a\ud800"}), "structured_outputs.regex"),
    (C, ok(structured_outputs={"choice": ["yes", "\udfff"]}), "structured_outputs.choice[1]"),
    (C, ok(structured_outputs={"grammar": 'root ::= "\ud800"'}), "structured_outputs.grammar"),
    (C, ok(prompt="\ud800"), "prompt"),
    ("/tokenize", {"prompt": "a\udc00"}, "prompt"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
     "messages[0].content[0].text"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}]),
     "tools[0].function.description"),
    (CHAT, chat(metadata={"\ud800": "x"}), r"metadata.\ud800"),
    (CHAT, chat(metadata={"a": [[0, {"b": "\udc00"}]]}), "metadata.a[0][1].b"),
], ids=["regex", "choice", "grammar", "prompt", "tokenize", "content part", "tool description", "key", "nested"])
def test_a_lone_surrogate_anywhere_is_400_naming_where(client, backend, path, body, param):
    """JSON escapes may spell half a UTF-16 pair, which is no text: no tokenizer takes it and no comm
    can carry it. Refused as the body is read, naming where it is; a whole pair is a character."""
    raw = json.dumps(body).encode("ascii")  # \ud800 escaped, as clients send it
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "lone surrogate" in r.json()["error"]["message"] and backend.submitted == []
    emoji = json.dumps(ok(prompt="\U0001f600")).encode("ascii")  # \ud83d\ude00: a pair
    assert client.post(C, content=emoji, headers={"content-type": "application/json"}).status_code == 200


@pytest.mark.parametrize("raw", [b'{"model": "tiny-test", "prompt": "a\xed\xa0\x80"}',
                                 '{"model": "tiny-test", "prompt": "a"}'.encode("utf-16"),
                                 '{"model": "tiny-test", "prompt": "a"}'.encode("utf-32")],
                         ids=["a surrogate encoded in UTF-8", "UTF-16", "UTF-32"])
def test_a_body_is_utf_8(client, backend, raw):
    """RFC 8259: JSON exchanged is UTF-8, strictly (no encoded surrogates, which no tokenizer takes)."""
    r = client.post(C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert backend.submitted == []


@pytest.mark.parametrize("raw", [b"{", b"{'a': 1}", b"", b"\xff\xfe", b'{"model": NaN}', b"[" * 200_000,
                                 b'{"model": "' + b"\xc3\x28" * 10 + b'"}'],
                         ids=["truncated", "single quotes", "empty", "not utf-8", "NaN", "nested 200,000 deep",
                              "invalid utf-8 in a string"])
def test_malformed_json_is_400(client, raw):
    r = client.post(C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_body_over_the_limit_is_413(make_client, backend):
    client = make_client(backend, max_body_bytes=1000)
    r = client.post(C, json=ok(prompt="x" * 2000))
    assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: the limit holds on what is actually sent
        yield b'{"model": "tiny-test", "prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = client.post(C, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_priority_header_is_validated(client):
    r = client.post(C, json=ok(), headers={"x-llumdask-priority": "asap"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-llumdask-priority"


def test_unknown_route_and_method_are_openai_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get(C)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_a_bug_is_a_500_without_a_trace(make_client, backend, monkeypatch, caplog):
    async def broken(*args):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(backend, "submit", broken)
    r = make_client(backend).post(C, json=ok())
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret internal detail" in caplog.text  # the operator sees it in the log


def test_unknown_fields_are_ignored(client):
    assert client.post(C, json=ok(user="me", metadata={"a": 1}, max_tokens=2)).status_code == 200
