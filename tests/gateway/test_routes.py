"""The HTTP layer over a scripted backend: response shapes, streaming, usage, stop, priority, health, metrics."""

from __future__ import annotations

import json

import pytest
from gatewayfakes import MAX_CONTEXT, MODEL, fake_logprob
from waiting import wait_until

import llumdask
from llumdask.api.gateway.backend import BackendOverloaded, BackendRejected, BackendUnavailable
from llumdask.api.gateway.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, within_top
from llumdask.engine.base import TokenLogprob
from llumdask.request import FinishReason, Priority


def sse_payloads(response) -> list:
    """The data of each SSE event; the last must be [DONE]."""
    events = [block for block in response.text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    data = [e[len("data: "):] for e in events]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_shape_text_and_usage(client, backend, tokenizer, script):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == tokenizer.decode(script[:5])
    prompt = tokenizer.encode("Hello world")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5}
    [sub] = backend.submitted
    assert body["id"] == f"cmpl-{sub.request_id}"  # the cluster's name for the request, for operators
    assert sub.prompt_token_ids == prompt and sub.sampling.max_tokens == 5
    assert sub.priority is Priority.NORMAL
    assert backend.aborted == []  # finished by itself: nothing to abort


def test_completions_default_to_16_tokens_as_openai(client, backend):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 200
    assert backend.submitted[0].sampling.max_tokens == 16


def test_token_id_prompt_is_used_as_is(client, backend):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    assert backend.submitted[0].prompt_token_ids == [5, 6, 7]


def test_sampling_fields_reach_the_backend(client, backend, tokenizer):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0.7,
                                             "top_p": 0.9, "seed": 42, "stop_token_ids": [7]})
    assert r.status_code == 200
    s = backend.submitted[0].sampling
    assert (s.temperature, s.top_p, s.seed) == (0.7, 0.9, 42)
    # The model's end-of-sequence token always stops a request, unless ignore_eos.
    assert set(s.stop_token_ids) == {7, tokenizer.eos_token_id}
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert backend.submitted[1].sampling.stop_token_ids == ()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_penalties_filters_and_biases_reach_the_backend(client, backend, path):
    body = {"model": MODEL, "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "logit_bias": {"12": 5, "3": -100}, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "min_tokens": 2, "allowed_token_ids": [7, 3, 12], "bad_words": ["cat", "the dog"]}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    assert client.post(path, json=body).status_code == 200
    s = backend.submitted[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (
        0.5, -0.25, 20, 0.05, 1.1, 2)
    assert s.logit_bias == ((3, -100.0), (12, 5.0)) and s.allowed_token_ids == (7, 3, 12)
    assert s.bad_words == ("cat", "the dog")


# A structural tag (xgrammar's format, as vLLM takes it): one call in Hermes' markup around a schema.
TAG = json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
                                                       "content": {"type": "json_schema", "json_schema": {"type": "object"}}}})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_structured_outputs_reach_the_backend(client, backend, path):
    """Each kind of vLLM's structured_outputs, as the engine's parameters (a JSON schema given as an
    object or as its text)."""
    body = {"model": MODEL, "max_tokens": 4}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for given, field, expected in (({"choice": ["yes", "no"], "structural_tag": None}, "choice", ("yes", "no")),
                                   ({"regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
                                   ({"grammar": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
                                   ({"json": schema}, "json_schema", json.dumps(schema)),
                                   ({"json": json.dumps(schema), "disable_any_whitespace": False}, "json_schema",
                                    json.dumps(schema)),
                                   ({"json_object": True}, "json_object", True),
                                   ({"structural_tag": TAG}, "structural_tag", TAG)):
        assert client.post(path, json={**body, "structured_outputs": given}).status_code == 200
        sampling = backend.submitted[-1].sampling
        assert getattr(sampling, field) == expected and sampling.structured_kinds == (field,)
    # vLLM's response_format of type structural_tag: the object is the tag.
    tag = json.loads(TAG)
    assert client.post(path, json={**body, "response_format": tag}).status_code == 200
    assert json.loads(backend.submitted[-1].sampling.structural_tag) == tag


def test_chat_renders_the_template_and_answers_as_assistant(client, backend, tokenizer, script):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"] == f"chatcmpl-{backend.submitted[0].request_id}"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(script[:4])}
    expected = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    assert backend.submitted[0].prompt_token_ids == expected
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_chat_without_max_tokens_may_fill_the_context(client, backend):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    sub = backend.submitted[0]
    assert sub.sampling.max_tokens == MAX_CONTEXT - len(sub.prompt_token_ids)


def test_chat_content_parts_are_joined(client, backend, tokenizer):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    expected = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hello"}]), add_special_tokens=False)
    assert backend.submitted[0].prompt_token_ids == expected


def test_stop_token_finishes_with_stop(client, backend, script, tokenizer):
    stop = script[3]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 10, "stop_token_ids": [stop]}
    r = client.post("/v1/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4  # the stop token counts, as in vLLM
    assert choice["text"] == tokenizer.decode(script[:3])  # and has no text, as in vLLM


def test_stop_string_cuts_the_text_and_aborts_the_rest(client, backend):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 30, "stop": ["fox", "cat"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "The quick brown "
    assert choice["finish_reason"] == "stop"
    assert backend.aborted == [backend.submitted[0].request_id]
    assert 0 < r.json()["usage"]["completion_tokens"] < 30


@pytest.mark.parametrize("batch_size", [1, 3])
def test_completion_stream_matches_the_text(make_client, backend, tokenizer, script, batch_size):
    backend.batch_size = batch_size
    client = make_client(backend)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r)
    *text_chunks, final, usage = chunks
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == tokenizer.decode(script[:8])
    # One chunk per token batch, as vLLM's server sends them: text held back still sends its chunk.
    assert len(text_chunks) == -(-8 // batch_size)
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks)
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_chat_stream_announces_the_role_then_content(client, tokenizer, script):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 6, "stream": True})
    chunks = sse_payloads(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == tokenizer.decode(script[:6])
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}
    assert "usage" not in chunks[-1]  # not asked for


def test_stream_with_stop_string_never_shows_it(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 30, "stream": True,
                                             "stop": "lazy"})
    chunks = sse_payloads(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The quick brown fox jumps over the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # The chunk of a token whose text is held back (it might begin the stop string) is empty.
    assert any(c["choices"][0]["text"] == "" for c in chunks[:-1])


def test_priority_from_body_or_header(client, backend):
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    client.post("/v1/completions", json={**base, "priority": "high"})
    client.post("/v1/completions", json=base, headers={"x-llumdask-priority": "HIGH"})
    client.post("/v1/completions", json={**base, "priority": "normal"}, headers={"x-llumdask-priority": "high"})
    assert [s.priority for s in backend.submitted] == [Priority.HIGH, Priority.HIGH, Priority.NORMAL]


def test_a_cache_salt_reaches_every_choice_and_a_bad_one_is_400(client, backend):
    """vLLM's cache_salt, on completions (each of n choices) and chat; null is none, as vLLM's."""
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "n": 2, "cache_salt": "t-a"})
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 1, "cache_salt": "t-b"})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "cache_salt": None})
    assert [s.cache_salt for s in backend.submitted] == ["t-a", "t-a", "t-b", None]
    for bad in ("", 7, ["t"], "\ud800", "a/b", "a@b", "a\\b", "a\u0000b", "s" * 129):
        r = client.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi", "cache_salt": bad}),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert len(backend.submitted) == 4


def test_no_ready_instance_is_503(make_client, backend):
    backend.submit_error = BackendUnavailable("no instance is ready")
    client = make_client(backend)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_ready_instance" and "no instance is ready" in r.json()["error"]["message"]


def test_a_cluster_refusing_for_load_is_429_with_retry_after(make_client, backend):
    backend.submit_error = BackendOverloaded("every instance would queue request r")
    client = make_client(backend, retry_after=3.0)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "cluster_overloaded")
    assert "would queue" in error["message"]
    # The slot it took is free again: the next request is served once the cluster takes it.
    backend.submit_error = None
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 200


@pytest.mark.parametrize(("estimate", "header"), [(7.4, "7"), (1.2, "3"), (None, "3")])
def test_a_refusal_for_load_asks_for_the_clusters_wait_when_it_is_longer(make_client, backend, estimate, header):
    backend.submit_error = BackendOverloaded("every instance would queue request r", estimate)
    r = make_client(backend, retry_after=3.0).post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 429 and r.headers["retry-after"] == header


def test_rejected_by_the_instance_is_400(make_client, backend):
    backend.submit_error = BackendRejected("needs 300 blocks, the instance has 128")
    r = make_client(backend).post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 400 and "300 blocks" in r.json()["error"]["message"]


def test_request_lost_mid_stream_ends_with_an_error_event(make_client, backend):
    backend.fail_after = 2
    client = make_client(backend)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True})
    chunks = sse_payloads(r)
    assert chunks[-1]["error"]["code"] == "no_ready_instance"
    assert len(chunks) == 3  # two tokens, then the error, then [DONE]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8})
    assert r.status_code == 503


def test_overload_is_429_with_retry_after(make_client, backend):
    client = make_client(backend, max_in_flight=1, retry_after=3)
    backend.stall_after = 1
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as stream:
        lines = stream.iter_lines()  # keep it: a dropped line iterator closes the response
        assert next(lines).startswith("data: ")
        assert backend.stalled.wait(10)
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert "llumdask_gateway_requests_in_flight 1.0" in client.get("/metrics").text
    # The client left: its request is aborted and its slot is free again.
    wait_until(lambda: backend.aborted == [backend.submitted[0].request_id])
    backend.stall_after = None
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 200


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    [card] = r.json()["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_CONTEXT
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404


def test_health_follows_ready_instances(make_client, backend):
    client = make_client(backend)
    assert client.get("/health").json() == {"status": "ok", "ready_instances": 2}
    backend.ready = 0
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["ready_instances"] == 0


def test_metrics_count_requests_tokens_latency_and_errors(client, script):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    client.post("/v1/completions", json={"model": "nope", "prompt": "Hi"})
    text = client.get("/metrics").text
    assert 'llumdask_gateway_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'llumdask_gateway_requests_total{endpoint="completions",status="404"} 1.0' in text
    assert 'llumdask_gateway_errors_total{code="model_not_found"} 1.0' in text
    assert 'llumdask_gateway_generation_tokens_total{endpoint="completions"} 4.0' in text
    assert 'llumdask_gateway_time_to_first_token_seconds_count{endpoint="completions"} 1.0' in text
    assert 'llumdask_gateway_time_per_output_token_seconds_count{endpoint="completions"} 1.0' in text
    assert 'llumdask_gateway_e2e_request_latency_seconds_count{endpoint="completions"} 1.0' in text


def test_lifespan_opens_and_closes_the_backend(make_client, backend):
    client = make_client(backend)
    assert (backend.opened, backend.closed) == (1, 0)
    client.__exit__(None, None, None)
    assert (backend.opened, backend.closed) == (1, 1)


def test_finish_reason_of_an_engine_abort_is_reported(make_client, backend, monkeypatch):
    async def aborted(self):
        yield [5]
        self.finish_reason = FinishReason.ABORT

    monkeypatch.setattr("gatewayfakes.ScriptedBatches.__aiter__", aborted)
    r = make_client(backend).post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.json()["choices"][0]["finish_reason"] == "abort"


def test_tokenize_and_detokenize_as_vllm_serves_them(client, tokenizer):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_CONTEXT and body["token_strs"] is None
    plain = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                           "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert len(plain["token_strs"]) == plain["count"] and all(isinstance(t, str) and t for t in plain["token_strs"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    # The same ids /v1/chat/completions counts as its prompt.
    usage = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == chat["count"]
    open_ended = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert open_ended["count"] < chat["count"]
    back = client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize("path, body, status, code", [
    ("/tokenize", {"model": MODEL}, 400, "missing_required_parameter"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "invalid_value"),
    ("/tokenize", {"prompt": 7}, 400, "invalid_type"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model_not_found"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "invalid_type"),
    ("/detokenize", {"tokens": [10**6]}, 400, "invalid_value"),
    ("/detokenize", {}, 400, "missing_required_parameter"),
])
def test_tokenize_and_detokenize_reject_bad_input(client, path, body, status, code):
    r = client.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_version(client):
    assert client.get("/version").json() == {"version": llumdask.__version__}


def test_n_choices_are_requests_of_their_own(client, backend, tokenizer, script):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5, "n": 3,
                                             "temperature": 0.8, "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == tokenizer.decode(script[:5]) and c["finish_reason"] == "length" for c in body["choices"])
    rid = body["id"].removeprefix("cmpl-")
    assert [s.request_id for s in backend.submitted] == [rid, f"{rid}-1", f"{rid}-2"]
    assert backend.placements == [[rid, f"{rid}-1", f"{rid}-2"]]  # placed together: they share the prompt
    # Seeded as vLLM seeds its n samples: seed + index.
    assert [s.sampling.seed for s in backend.submitted] == [5, 6, 7]
    prompt_tokens = len(backend.submitted[0].prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 15, "total_tokens": prompt_tokens + 15}


def test_n_choices_stream_interleaved_by_index(make_client, backend, tokenizer, script):
    backend.delay = 0.001
    client = make_client(backend)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 6, "n": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    *chunks, usage = sse_payloads(r)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == tokenizer.decode(script[:6])
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"] and mine[-1]["finish_reason"]
    assert usage["usage"]["completion_tokens"] == 12


def test_a_stop_string_ends_every_choice_and_aborts_them(client, backend):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 30, "n": 2, "stop": ["fox"]})
    assert [c["text"] for c in r.json()["choices"]] == ["The quick brown "] * 2
    assert sorted(backend.aborted) == sorted(s.request_id for s in backend.submitted)


def test_n_choices_need_n_admission_slots(make_client, backend):
    client = make_client(backend, max_in_flight=2, retry_after=3)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 3})
    assert r.status_code == 429 and not backend.submitted
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2}).status_code == 200
    assert "llumdask_gateway_requests_in_flight 0.0" in client.get("/metrics").text


def test_completion_logprobs_in_openai_legacy_shape(client, backend, tokenizer, script):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "logprobs": 2})
    logprobs = r.json()["choices"][0]["logprobs"]
    texts = [tokenizer.decode([t]) for t in script[:4]]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == [fake_logprob(t, i, 2).logprob for i, t in enumerate(script[:4])]
    # The two most likely alternatives and the token's own, keyed by their text.
    for i, (t, top) in enumerate(zip(script[:4], logprobs["top_logprobs"])):
        entry = fake_logprob(t, i, 2)
        assert top == {texts[i]: entry.logprob} | {tokenizer.decode([a]): lp for a, lp in entry.top}
    assert logprobs["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(4)]
    assert backend.submitted[0].sampling.logprobs == 2 and backend.submitted[0].sampling.prompt_logprobs is None


def test_echo_puts_the_prompt_first_with_its_logprobs(client, backend, tokenizer, script):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "echo": True,
                                             "logprobs": 1})
    choice = r.json()["choices"][0]
    prompt = backend.submitted[0].prompt_token_ids
    assert backend.submitted[0].sampling.prompt_logprobs == 1
    assert choice["text"] == "Hello there" + tokenizer.decode(script[:3])
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1] == fake_logprob(prompt[1], 100, 1).logprob
    assert logprobs["token_logprobs"][len(prompt):] == [-0.1, -0.2, -0.3]
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3,
                                                 "echo": True}).json()["choices"][0]
    assert plain["text"] == choice["text"] and plain["logprobs"] is None


def vllm_prompt_logprobs(tokenizer, prompt: list[int], top: int) -> list:
    """What vLLM's server shows for the scripted prompt logprobs: the token first, then its
    alternatives; a special token by its text."""
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    shown = [None]
    for i, t in enumerate(prompt[1:]):
        entry = fake_logprob(t, 100 + i, top)
        shown.append({str(t): {"logprob": entry.logprob, "rank": i + 2, "decoded_token": text(t)}}
                     | {str(a): {"logprob": lp, "rank": k, "decoded_token": text(a)}
                        for k, (a, lp) in enumerate(entry.top, start=1)})
    return shown


def test_prompt_logprobs_come_in_vllm_shape_where_vllm_puts_them(client, backend, tokenizer, script):
    """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, in each
    completion choice and once in a chat response; never in a stream."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "n": 2,
                                             "prompt_logprobs": 2})
    prompt = backend.submitted[0].prompt_token_ids
    assert backend.submitted[0].sampling.prompt_logprobs == 2 and backend.submitted[0].sampling.logprobs is None
    expected = vllm_prompt_logprobs(tokenizer, prompt, 2)
    assert [c["prompt_logprobs"] for c in r.json()["choices"]] == [expected, expected]
    assert [c["logprobs"] for c in r.json()["choices"]] == [None, None]
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3,
                                                  "prompt_logprobs": 0})
    body = r.json()
    chat_prompt = backend.submitted[-1].prompt_token_ids
    assert body["prompt_logprobs"] == vllm_prompt_logprobs(tokenizer, chat_prompt, 0)
    assert any(tokenizer.decode([t]) == "" != p[str(t)]["decoded_token"] for t, p in zip(chat_prompt[1:], body["prompt_logprobs"][1:]))
    assert "prompt_logprobs" not in body["choices"][0]
    # Beside the prompt's ids, in vLLM's order.
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1,
                                             "return_token_ids": True})
    assert list(r.json()["choices"][0])[-3:] == ["token_ids", "prompt_logprobs", "prompt_token_ids"]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                  "prompt_logprobs": 1, "return_token_ids": True})
    assert list(r.json())[-3:] == ["usage", "prompt_logprobs", "prompt_token_ids"]
    # Not asked for: no field (vLLM's is null); echo with logprobs computes them, and shows them, as vLLM does.
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    echoed = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3,
                                                  "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echoed["prompt_logprobs"] == vllm_prompt_logprobs(tokenizer, prompt, 1)
    # A stream has no place for them: 0 asks nothing and passes, as in vLLM...
    chunks = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3,
                                                  "stream": True, "prompt_logprobs": 0})
    assert chunks.status_code == 200 and "prompt_logprobs" not in chunks.text
    assert backend.submitted[-1].sampling.prompt_logprobs is None
    # ...but for an echo's prompt, which it shows without alternatives.
    chunks = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3,
                                                  "stream": True, "echo": True, "logprobs": 2, "prompt_logprobs": 0})
    assert backend.submitted[-1].sampling.prompt_logprobs == 0 and "prompt_logprobs" not in chunks.text
    first = json.loads(chunks.text.split("data: ")[1])["choices"][0]["logprobs"]
    assert first["top_logprobs"][0] is None
    assert [len(top) for top in first["top_logprobs"][1:len(prompt)]] == [1] * (len(prompt) - 1)


def test_an_echo_shows_the_answers_count_of_prompt_alternatives(client, backend, tokenizer):
    """prompt_logprobs beyond logprobs: the echo shows the token's own and `logprobs` others (vLLM's
    rule), the prompt_logprobs all of them."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "echo": True,
                                             "logprobs": 1, "prompt_logprobs": 3})
    choice = r.json()["choices"][0]
    prompt = backend.submitted[0].prompt_token_ids
    assert backend.submitted[0].sampling.prompt_logprobs == 3
    for i, t in enumerate(prompt[1:], start=1):
        entry = fake_logprob(t, 99 + i, 3)
        assert choice["logprobs"]["top_logprobs"][i] == {tokenizer.decode([t]): entry.logprob,
                                                         tokenizer.decode([entry.top[0][0]]): entry.top[0][1]}
        assert len(choice["prompt_logprobs"][i]) == 4


def test_a_chat_returns_its_rendered_prompt_where_asked(client, backend, tokenizer):
    """vLLM's return_prompt_text: the prompt as the template rendered it, after the prompt's ids
    (whole) or on each choice's first chunk (streamed); chat only, as in vLLM."""
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.render_chat(messages)
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                     "return_prompt_text": True, "return_token_ids": True}).json()
    assert body["prompt_text"] == rendered and list(body)[-2:] == ["prompt_token_ids", "prompt_text"]
    assert tokenizer.encode(rendered, add_special_tokens=False) == body["prompt_token_ids"]
    chunks = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, "n": 2,
                                                       "stream": True, "return_prompt_text": True})
    events = [json.loads(line[6:]) for line in chunks.text.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["index"] for e in events if "prompt_text" in e] == [0, 1]
    assert all(e["prompt_text"] == rendered for e in events if "prompt_text" in e)
    assert "prompt_text" not in client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                          "max_tokens": 2}).json()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "return_prompt_text": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_prompt_text"


def test_within_top_keeps_the_token_out_of_its_alternatives():
    """The token among its alternatives stands once; the others fill the count (vLLM's dict order)."""
    entry = TokenLogprob(-0.5, ((7, -0.1), (3, -0.5), (9, -0.9)), rank=2)
    assert within_top(entry, 3, 1) == TokenLogprob(-0.5, ((7, -0.1),), 2)
    assert within_top(entry, 3, 2) == TokenLogprob(-0.5, ((7, -0.1), (9, -0.9)), 2)
    assert within_top(entry, 4, 2) == TokenLogprob(-0.5, ((7, -0.1), (3, -0.5)), 2)


def test_impossible_tokens_show_as_vllm_shows_them(tokenizer):
    """-inf is no JSON number: -9999.0 in every shape, as vLLM's server clamps it."""
    entry = TokenLogprob(float("-inf"), ((5, -0.1), (6, float("-inf"))), rank=300)
    assert completion_logprobs(tokenizer, [4], [entry])["token_logprobs"] == [-9999.0]
    assert completion_logprobs(tokenizer, [4], [entry])["top_logprobs"][0][tokenizer.decode([6])] == -9999.0
    content = chat_logprobs(tokenizer, [4], [entry])["content"][0]
    assert content["logprob"] == -9999.0 and content["top_logprobs"][1]["logprob"] == -9999.0
    shown = prompt_logprobs(tokenizer, [4], [entry])[0]
    assert shown["4"] == {"logprob": -9999.0, "rank": 300, "decoded_token": tokenizer.decode([4])}
    assert shown["6"]["logprob"] == -9999.0 and json.dumps(shown, allow_nan=False)


def test_a_prompt_token_among_its_alternatives_stands_once_first(tokenizer):
    """vLLM's dict: the token's own key first, its value and rank the alternative's."""
    shown = prompt_logprobs(tokenizer, [3, 7], [None, TokenLogprob(-0.1, ((7, -0.1), (3, -0.5)), rank=1)])
    assert list(shown[1]) == ["7", "3"] and shown[1]["7"]["rank"] == 1 and shown[1]["3"]["rank"] == 2


def test_chat_logprobs_stream_with_their_tokens(make_client, backend, tokenizer, script):
    backend.batch_size = 2
    client = make_client(backend)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
                                                  "stream": True})
    chunks = [c["choices"][0] for c in sse_payloads(r)]
    content = [entry for c in chunks if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert [e["token"] for e in content] == [tokenizer.decode([t]) for t in script[:5]]
    assert [e["logprob"] for e in content] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    # Each chunk carries the entries of the tokens it brings.
    assert [len(c["logprobs"]["content"]) for c in chunks if c["logprobs"]] == [2, 2, 1]
    whole = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 5, "logprobs": True}).json()["choices"][0]
    assert [e["logprob"] for e in whole["logprobs"]["content"]] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert all(e["top_logprobs"] == [] for e in whole["logprobs"]["content"])


def test_response_formats_reach_the_backend_as_sampling(client, backend):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}
    for response_format, expected in [
        ({"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}, (json.dumps(schema), False)),
        ({"type": "json_object"}, (None, True)),
        ({"type": "text"}, (None, False)),
    ]:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "response_format": response_format})
        assert r.status_code == 200
        s = backend.submitted[-1].sampling
        assert (s.json_schema, s.json_object) == expected


def test_best_of_returns_the_likeliest_per_token(client, backend, tokenizer, script):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "best_of": 4,
                                             "temperature": 1.0, "seed": 10})
    body = r.json()
    assert len(backend.submitted) == 4 and all(s.sampling.logprobs == 0 for s in backend.submitted)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # ranked by them, not asked for
    assert body["usage"]["completion_tokens"] == 4 * 3  # every generated completion counts
    asked = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "best_of": 3,
                                                 "temperature": 1.0, "seed": 10, "logprobs": 1}).json()
    (choice,) = asked["choices"]
    # The fake's seeded choices are likelier the higher their seed: of seeds 10-12, 12 wins.
    assert choice["logprobs"]["token_logprobs"] == [fake_logprob(t, i, 1, 12).logprob for i, t in enumerate(script[:3])]


def test_stop_strings_can_stay_in_the_text(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 30, "stop": ["fox"],
                                             "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "The quick brown fox"


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_the_prompts_cached_tokens_where_the_engine_says(client, backend, stream):
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 3, "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    def usage() -> dict:
        r = client.post("/v1/completions", json=body)
        return sse_payloads(r)[-1]["usage"] if stream else r.json()["usage"]

    assert "prompt_tokens_details" not in usage()  # the engine says nothing
    backend.cached_tokens = 16
    assert usage() == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                       "prompt_tokens_details": {"cached_tokens": 16}}


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_shows_the_prompts_and_each_choices_tokens_where_vllm_puts_them(make_client, backend,
                                                                                       tokenizer, script, stream):
    """vLLM's return_token_ids: completions give each choice the prompt's ids (in a stream, on the
    choice's first chunk) and its own tokens (per chunk); chat gives the prompt's ids once per
    response (in a stream, on each choice's role chunk)."""
    backend.batch_size = 2
    client = make_client(backend)
    ask = {"model": MODEL, "max_tokens": 5, "n": 2, "stream": stream, "return_token_ids": True}
    completion = client.post("/v1/completions", json={**ask, "prompt": "Hello world"})
    chat = client.post("/v1/chat/completions", json={**ask, "messages": [{"role": "user", "content": "Hi"}]})
    prompts = [s.prompt_token_ids for s in backend.submitted[::2]]
    assert len(prompts) == 2 and prompts[0] == tokenizer.encode("Hello world")
    if not stream:
        choices = completion.json()["choices"]
        assert [(c["prompt_token_ids"], c["token_ids"]) for c in choices] == [(prompts[0], script[:5])] * 2
        body = chat.json()
        assert body["prompt_token_ids"] == prompts[1] and [c["token_ids"] for c in body["choices"]] == [script[:5]] * 2
        assert "prompt_token_ids" not in body["choices"][0]
        return
    for response, per_choice in ((completion, True), (chat, False)):
        chunks = sse_payloads(response)
        for index in (0, 1):
            mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            ids = [t for c in mine for t in c["choices"][0].get("token_ids") or []]
            assert ids == script[:5]
            carrying = [c for c in mine if "prompt_token_ids" in (c["choices"][0] if per_choice else c)]
            assert len(carrying) == 1 and carrying[0] is mine[0]
            assert (carrying[0]["choices"][0] if per_choice else carrying[0])["prompt_token_ids"] == prompts[not per_choice]
    plain = client.post("/v1/completions", json={**ask, "prompt": "Hello world", "return_token_ids": False})
    assert "token_ids" not in plain.text


def test_return_token_ids_with_echo_gives_the_prompt_as_ids_not_text(client, backend, tokenizer, script):
    """As vLLM's server: the echoed prompt's log probabilities stay, its text goes (the ids carry it)."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "echo": True,
                                             "logprobs": 0, "return_token_ids": True})
    choice = r.json()["choices"][0]
    prompt = backend.submitted[0].prompt_token_ids
    assert choice["text"] == tokenizer.decode(script[:3]) and choice["prompt_token_ids"] == prompt
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 3


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(client, tokenizer, script):
    completion = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "logprobs": 1,
                                                      "return_tokens_as_token_ids": True}).json()["choices"][0]
    logprobs = completion["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in script[:3]]
    assert all(all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])
    assert completion["text"] == tokenizer.decode(script[:3])  # the text is the text
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
                                                     "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in script[:3]]
    # vLLM's: a token's bytes stay its text's; an alternative's are its label's.
    assert [e["bytes"] for e in content] == [list(tokenizer.decode([t]).encode()) for t in script[:3]]
    assert all(a["bytes"] == list(a["token"].encode()) and a["token"].startswith("token_id:")
               for e in content for a in e["top_logprobs"])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm(client, backend, tokenizer, script):
    """vLLM's truncate_prompt_tokens: the last k prompt tokens (truncation_side "left", vLLM's
    default for generation) or the first k ("right"); -1 what the context holds with one token to
    generate; more than the prompt has, all of it; more than the context, a 400."""
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    ask = {"model": MODEL, "prompt": text, "max_tokens": 1}
    for extra, expected in (({"truncate_prompt_tokens": 3}, ids[-3:]),
                            ({"truncate_prompt_tokens": 3, "truncation_side": "right"}, ids[:3]),
                            ({"truncate_prompt_tokens": len(ids) + 5}, ids),
                            ({"truncate_prompt_tokens": None}, ids)):
        assert client.post("/v1/completions", json={**ask, **extra}).status_code == 200
        assert backend.submitted[-1].prompt_token_ids == expected, extra
    long = [5] * (MAX_CONTEXT + 40)
    r = client.post("/v1/completions", json={**ask, "prompt": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and backend.submitted[-1].prompt_token_ids == long[:MAX_CONTEXT - 1]
    assert r.json()["usage"]["prompt_tokens"] == MAX_CONTEXT - 1 and r.json()["usage"]["completion_tokens"] == 1
    echoed = client.post("/v1/completions", json={**ask, "echo": True, "truncate_prompt_tokens": 3}).json()
    assert echoed["choices"][0]["text"] == tokenizer.decode(ids[-3:]) + tokenizer.decode(script[:1])
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                     "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and len(backend.submitted[-1].prompt_token_ids) == 4
    submitted = len(backend.submitted)
    for bad, param in (({"truncate_prompt_tokens": MAX_CONTEXT + 1}, "truncate_prompt_tokens"),
                       ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                       ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
                       ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
                       ({"truncate_prompt_tokens": 3, "suffix": "x"}, "suffix")):
        r = client.post("/v1/completions", json={**ask, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert bad.get("truncation_side") or "truncate_prompt_tokens" in r.json()["error"]["message"]
    assert len(backend.submitted) == submitted


@pytest.mark.parametrize("extra", [{}, {"return_tokens_as_token_ids": True}, {"echo": True, "return_token_ids": True},
                                   {"echo": True, "return_tokens_as_token_ids": True}])
def test_streamed_text_offsets_are_the_whole_responses(make_client, backend, extra):
    """A stream's log probabilities' text offsets go on from the tokens shown, as vLLM's do, so they
    equal the whole response's, with token-id labels and an echo without text too."""
    backend.batch_size = 2
    client = make_client(backend)
    ask = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "logprobs": 0, **extra}
    whole = client.post("/v1/completions", json=ask).json()["choices"][0]["logprobs"]
    streamed = [c["choices"][0]["logprobs"] for c in sse_payloads(client.post("/v1/completions",
                                                                                  json={**ask, "stream": True}))
                if c["choices"] and c["choices"][0]["logprobs"]]
    assert [o for lp in streamed for o in lp["text_offset"]] == whole["text_offset"]
    assert [t for lp in streamed for t in lp["tokens"]] == whole["tokens"]


def test_without_return_token_ids_no_response_shows_ids(client):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        for stream in (False, True):
            r = client.post(path, json={"model": MODEL, "max_tokens": 3, "stream": stream, **body})
            assert r.status_code == 200 and "token_ids" not in r.text


def test_stop_reason_names_what_ended_each_choice_as_vllm(make_client, backend, script, tokenizer):
    """vLLM's stop_reason: the stop string that ended a choice, or the requested stop token; null for
    the end-of-sequence token (unless ignore_eos and asked for), max_tokens or an abort. In every
    completion chunk (null until the last), in chat only in the last."""
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(script[:6]) == "The quick brown"
    backend.script = [*script[:6], eos, *script[6:]]
    client = make_client(backend)
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 30}

    def choice(**fields):
        return client.post("/v1/completions", json={**base, **fields}).json()["choices"][0]

    # Of two stop strings found in one batch, the one that ends first (vLLM's rule), as when the
    # tokens come one by one.
    for backend.batch_size in (6, 1):
        stopped = choice(stop=["he quick b", "quick"])
        assert (stopped["text"], stopped["stop_reason"], stopped["finish_reason"]) == ("The ", "quick", "stop")
    assert (choice(stop_token_ids=[script[3]])["stop_reason"], choice(stop_token_ids=[script[3]])["finish_reason"]) == \
        (script[3], "stop")
    assert (choice()["stop_reason"], choice()["finish_reason"]) == (None, "stop")  # the end of sequence
    assert choice(stop_token_ids=[eos])["stop_reason"] is None  # ended as the end of sequence first
    assert choice(stop_token_ids=[eos], ignore_eos=True)["stop_reason"] == eos
    assert (choice(max_tokens=2)["stop_reason"], choice(max_tokens=2)["finish_reason"]) == (None, "length")

    stream = sse_payloads(client.post("/v1/completions", json={**base, "stop": "brown", "stream": True}))
    assert [c["choices"][0]["stop_reason"] for c in stream] == [None] * (len(stream) - 1) + ["brown"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stop": ["quick"]}).json()
    assert chat["choices"][0]["stop_reason"] == "quick" and list(chat["choices"][0])[3:5] == ["finish_reason", "stop_reason"]
    chunks = sse_payloads(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "stop_token_ids": [script[2]], "stream": True}))
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                        "stop_reason": script[2]}
    assert not any("stop_reason" in c["choices"][0] for c in chunks[:-1])


def test_tokens_after_the_one_completing_a_stop_string_are_dropped_and_min_tokens_defers_it(make_client, backend, script,
                                                                                           tokenizer):
    """vLLM's detokenizer: a batch of several tokens that completes a stop string keeps its tokens
    up to the one that completed it (ids, log probabilities, usage); a stop string counts only
    where it ends in the text of a token past min_tokens."""
    backend.batch_size = 6
    client = make_client(backend)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "stop": ["quick"], "logprobs": 0, "return_token_ids": True}
    assert [tokenizer.decode(script[:k]) for k in (3, 4)] == ["The qu", "The quick"]  # the 4th token completes it
    whole = client.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    assert (choice["text"], choice["token_ids"], whole["usage"]["completion_tokens"]) == ("The ", script[:4], 4)
    assert len(choice["logprobs"]["tokens"]) == 4
    streamed = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}))
    assert [t for c in streamed for t in c["choices"][0].get("token_ids") or []] == script[:4]
    # Past min_tokens 3, not past 4 (the answer then goes on to its length).
    assert client.post("/v1/completions", json={**body, "min_tokens": 3}).json()["choices"][0]["stop_reason"] == "quick"
    late = client.post("/v1/completions", json={**body, "min_tokens": 4}).json()["choices"][0]
    assert (late["finish_reason"], late["stop_reason"], late["token_ids"]) == ("length", None, script[:12])
