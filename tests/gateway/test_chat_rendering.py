"""vLLM's chat rendering fields: chat_template_kwargs, documents, reasoning_effort,
continue_final_message, add_generation_prompt and add_special_tokens reach the template (or the
tokenizer) as vLLM's server passes them, on chat completions and /tokenize alike; what cannot be
honoured is a 400 naming the field, never ignored."""

from __future__ import annotations

import shutil

import pytest
from gatewayfakes import MODEL, FakeBackend
from starlette.testclient import TestClient

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.api.gateway.tokenizer import TransformersTokenizer, load_tokenizer
from llumdask.config import GatewayConfig
from llumdask.tiny_model import CHAT_TEMPLATE

# The tiny model's template, preceded by what a reasoning or RAG template reads.
TEMPLATE = ("{% if enable_thinking is defined %}[thinking {{ enable_thinking }}]{% endif %}"
            "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
            "{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]{% endfor %}" + CHAT_TEMPLATE)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*ASK, {"role": "assistant", "content": "The capital is"}]


@pytest.fixture
def rendering(tiny_model, tmp_path):
    """A client over a scripted backend whose model renders TEMPLATE and whose tokenizer adds a
    beginning of sequence where asked (as Llama's does), the backend, and the tokenizer."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.processors import TemplateProcessing

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    rust = RustTokenizer.from_file(str(model / "tokenizer.json"))
    rust.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))])
    rust.save(str(model / "tokenizer.json"))
    tokenizer = load_tokenizer(model, TEMPLATE)
    backend = FakeBackend(ModelInfo(MODEL, 4096), tokenizer.encode("Paris.", add_special_tokens=False))
    with TestClient(create_app(backend.open, tokenizer, GatewayConfig()), raise_server_exceptions=False) as client:
        yield client, backend, tokenizer


def prompt_text(client, backend, tokenizer, **fields) -> str:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    tokens = client.post("/tokenize", json={"model": MODEL, "messages": ASK, **fields}).json()["tokens"]
    assert backend.submitted[-1].prompt_token_ids == tokens  # /tokenize renders the same prompt
    return tokenizer.decode(tokens, skip_special_tokens=False)


def test_template_variables_reach_the_template(rendering):
    client, backend, tokenizer = rendering
    assert prompt_text(client, backend, tokenizer).startswith("<s><|user|>")
    kwargs = prompt_text(client, backend, tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert kwargs.startswith("[thinking False]<s><|user|>")
    # reasoning_effort is a variable too, and turns thinking on or off unless the kwargs say.
    assert prompt_text(client, backend, tokenizer, reasoning_effort="low").startswith("[thinking True][effort low]")
    assert prompt_text(client, backend, tokenizer, reasoning_effort="none").startswith("[thinking False][effort none]")
    both = prompt_text(client, backend, tokenizer, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert both.startswith("[thinking False][effort high]")
    documents = [{"title": "Atlas", "text": "Paris is in France."}, {"title": "Guide", "text": "Rome is in Italy."}]
    assert prompt_text(client, backend, tokenizer, documents=documents).startswith(
        "[doc Atlas: Paris is in France.][doc Guide: Rome is in Italy.]<s>")


def test_documents_come_by_the_field_or_the_kwargs_and_efforts_are_vllms(rendering):
    client, backend, tokenizer = rendering
    by_kwargs = prompt_text(client, backend, tokenizer, chat_template_kwargs={"documents": [{"title": "A", "text": "a"}]})
    assert by_kwargs.startswith("[doc A: a]<s>")
    both = prompt_text(client, backend, tokenizer, chat_template_kwargs={"documents": [{"title": "A", "text": "a"}]},
                       documents=[{"title": "B", "text": "b"}])
    assert both.startswith("[doc B: b]<s>")  # the field wins, as in vLLM
    for effort in ("xhigh", "max"):
        assert prompt_text(client, backend, tokenizer, reasoning_effort=effort).startswith(f"[thinking True][effort {effort}]")


def test_tokenize_renders_the_tools_too(rendering):
    client, _, tokenizer = rendering
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    plain = client.post("/tokenize", json={"model": MODEL, "messages": ASK}).json()["tokens"]
    offered = client.post("/tokenize", json={"model": MODEL, "messages": ASK, "tools": [tool]}).json()["tokens"]
    assert offered == tokenizer.encode(tokenizer.render_chat(ASK, tools=[tool]), add_special_tokens=False) != plain
    bad = client.post("/tokenize", json={"model": MODEL, "messages": ASK, "tools": "lookup"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_a_completions_prompt_gets_special_tokens_unless_told_not_to(rendering):
    client, backend, tokenizer = rendering
    for given, expected in ((None, True), (True, True), (False, False)):
        extra = {} if given is None else {"add_special_tokens": given}
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **extra}).status_code == 200
        assert backend.submitted[-1].prompt_token_ids == tokenizer.encode("Hello", add_special_tokens=expected)
    assert tokenizer.encode("Hello", add_special_tokens=True) != tokenizer.encode("Hello", add_special_tokens=False)


def test_continue_final_message_leaves_the_answer_open(rendering):
    client, backend, tokenizer = rendering
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": PREFILLED, "max_tokens": 2,
                                                  "continue_final_message": True})
    assert r.status_code == 200, r.text
    text = tokenizer.decode(backend.submitted[-1].prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("<|assistant|>\nThe capital is")  # no end of message, no new header
    closed = client.post("/v1/chat/completions", json={"model": MODEL, "messages": PREFILLED, "max_tokens": 2,
                                                       "add_generation_prompt": False})
    assert closed.status_code == 200
    assert tokenizer.decode(backend.submitted[-1].prompt_token_ids, skip_special_tokens=False).endswith(
        "The capital is</s>\n")


def test_add_special_tokens_is_the_requests(rendering):
    """A chat template writes its own special tokens: none are added unless asked for."""
    client, backend, tokenizer = rendering
    rendered = tokenizer.render_chat(ASK)
    prompt_text(client, backend, tokenizer)
    assert backend.submitted[-1].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    prompt_text(client, backend, tokenizer, add_special_tokens=True)
    added = backend.submitted[-1].prompt_token_ids
    bos = tokenizer.encode("<s>", add_special_tokens=False)
    assert added == [*bos, *tokenizer.encode(rendered, add_special_tokens=False)] and len(bos) == 1


@pytest.mark.parametrize("fields, param, words", [
    ({"chat_template": "{{ messages }}"}, "chat_template", "cannot bring its own chat template"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "cannot be set with"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "cannot set tools"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "cannot set tokenize"),
    ({"documents": {"title": "x"}}, "documents", "must be an array"),
    ({"documents": [{"title": 1}]}, "documents[0]", "object of strings"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of"),
    ({"add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean"),
    ({"reasoning_effort": "maximal"}, "reasoning_effort", "must be one of"),
])
def test_rendering_fields_it_cannot_honour_are_400(rendering, fields, param, words):
    client, backend, _ = rendering
    for path in ("/v1/chat/completions", "/tokenize"):
        r = client.post(path, json={"model": MODEL, "messages": ASK, "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert words in r.json()["error"]["message"]
    assert backend.submitted == []


def test_a_variable_the_template_cannot_use_is_400(tiny_model):
    """The request's value meets an expression it does not fit (a string where the template adds
    a number): the template's error, answered as the request's, never a 500."""
    tokenizer = load_tokenizer(tiny_model, "[budget {{ (budget or 0) + 1 }}]" + CHAT_TEMPLATE)
    backend = FakeBackend(ModelInfo(MODEL, 4096), [5, 6])
    with TestClient(create_app(backend.open, tokenizer, GatewayConfig()), raise_server_exceptions=False) as client:
        fine = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                         "chat_template_kwargs": {"budget": 9}})
        assert fine.status_code == 200 and tokenizer.decode(backend.submitted[-1].prompt_token_ids).startswith("[budget 10]")
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                      "chat_template_kwargs": {"budget": "ten"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "rejected the messages" in r.json()["error"]["message"] and len(backend.submitted) == 1


def test_chat_echo_is_400(rendering):
    client, backend, _ = rendering
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": PREFILLED, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo" and backend.submitted == []
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "echo": False,
                                                     "max_tokens": 2}).status_code == 200


def test_a_final_message_the_template_does_not_write_cannot_be_continued(rendering):
    client, backend, _ = rendering
    calls = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [*ASK, *calls], "max_tokens": 2,
                                                  "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "nothing to continue" in r.json()["error"]["message"] and backend.submitted == []


def test_rendering_matches_transformers(tiny_model, tmp_path):
    """The fast path's continue_final_message and variables render as transformers' apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(tiny_model, TEMPLATE)
    reference = TransformersTokenizer(transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_model)), TEMPLATE)
    variables = {"enable_thinking": True, "documents": [{"title": "Atlas", "text": "Paris"}]}
    for messages, go_on in ((ASK, False), (PREFILLED, True), ([*ASK, {"role": "assistant", "content": "Paris.  "}], True)):
        for extra in (None, variables):
            kwargs = {"continue_final_message": go_on, "variables": extra}
            assert ours.render_chat(messages, not go_on, **kwargs) == reference.render_chat(messages, not go_on, **kwargs)
    # A template that trims each message (Llama 3's): the open message loses its trailing spaces
    # as transformers cuts it; and documents is defined (None) when none are given.
    trimming = ("{% if documents is defined %}[documents {{ documents }}]{% endif %}{% for m in messages %}"
                "<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}")
    ours = load_tokenizer(tiny_model, trimming)
    reference = TransformersTokenizer(transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_model)), trimming)
    spaced = [*ASK, {"role": "assistant", "content": "Paris is  "}]
    assert ours.render_chat(spaced, False, continue_final_message=True) == reference.render_chat(
        spaced, False, continue_final_message=True)
    assert ours.render_chat(spaced, False, continue_final_message=True).endswith("<|assistant|>Paris is")
    assert ours.render_chat(ASK).startswith("[documents None]") and ours.render_chat(ASK) == reference.render_chat(ASK)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": ASK}),
])
def test_vllm_options_the_gateway_does_not_honour_are_400_unless_at_their_default(rendering, path, body):
    """Named tokens' logprobs, token offsets: a request asking for them is refused rather than
    answered as if it had not; their defaults pass."""
    client, backend, _ = rendering
    for name, value in (("logprob_token_ids", [1]), ("return_token_offsets", True),
                        ("spaces_between_special_tokens", False)):
        r = client.post(path, json={"model": MODEL, "max_tokens": 2, **body, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        assert "does not honour" in r.json()["error"]["message"]
    assert backend.submitted == []
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "spaces_between_special_tokens": True,
                "return_token_ids": False, "watermarking": False, "vllm_xargs": {}, "kv_transfer_params": {}}
    assert client.post(path, json={"model": MODEL, "max_tokens": 2, **body, **defaults}).status_code == 200
