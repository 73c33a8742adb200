"""Tool calling through the gateway over a scripted backend: what reaches the engine (the prompt
with the tools rendered, the constraining schema), and the scripted answer read back as calls by
vLLM's own parser and schema, whole and streamed. The real engine's round trip is in test_serve.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gatewayfakes import MODEL, FakeBackend
from modelcopies import with_model_type
from starlette.testclient import TestClient
from test_routes import sse_payloads

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.api.gateway.parser_model import parser_model_config
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.api.gateway.tools import AnswerReading, parser_class
from llumdask.api.serve import build_parser
from llumdask.config import GatewayConfig
from llumdask.engine.base import TokenLogprob

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def backend(script: list[int]) -> FakeBackend:
    """Room for the tools in the prompt."""
    return FakeBackend(ModelInfo(MODEL, 4096), script)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 200, **body})


def tool_deltas(chunks: list[dict]) -> dict[int, dict]:
    """The streamed tool calls assembled by index, as OpenAI's clients assemble them."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id") or call["id"]
            call["name"] += delta.get("function", {}).get("name") or ""
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return calls


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict",
     "boolean"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [WEATHER["function"]]}, "functions", "deprecated"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id", "must be a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y",
                                                                        "tool_calls": [{}]}]},
     "messages[1].tool_calls", "only assistant"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, backend, body, param, words):
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert backend.submitted == []


def test_auto_without_a_parser_is_400_and_says_which_option(client, backend):
    error = chat(client, tools=[WEATHER]).json()["error"]
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    assert backend.submitted == []


def test_a_null_tool_choice_is_the_default_as_openai_reads_it(client, backend, script):
    """null is what leaving tool_choice out means: "auto" with tools (here refused for want of a
    parser, as when left out), "none" without (vllm serve keeps the null, and drops the calls of a
    whole answer though it read them)."""
    refused = chat(client, tools=[WEATHER], tool_choice=None)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    assert backend.submitted == []
    r = chat(client, tool_choice=None, max_tokens=4)
    assert r.status_code == 200, r.text
    assert backend.submitted[0].sampling.json_schema is None
    assert r.json()["choices"][0]["message"]["content"] == chat(client, max_tokens=4).json()["choices"][0]["message"]["content"]


def test_a_tool_strict_level_vllm_does_not_know_is_refused(capsys):
    with pytest.raises(ValueError, match="one of auto, function, parameter"):
        AnswerReading(tool_strict_level="strictest")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-strict-level", "strictest"])
    assert "invalid choice: 'strictest'" in capsys.readouterr().err


def test_tools_on_the_sim_engine_are_400(make_client, backend):
    client = make_client(backend, answers=AnswerReading(engine="sim"))
    error = chat(client, tools=[WEATHER], tool_choice="required").json()["error"]
    assert error["param"] == "tools" and "sim engine" in error["message"]


def test_tool_choice_none_renders_the_tools_and_reads_nothing(client, backend, tokenizer, script):
    earlier = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}]
    r = chat(client, messages=earlier, tools=[WEATHER], tool_choice="none", max_tokens=6)
    assert r.status_code == 200, r.text
    rendered = tokenizer.render_chat(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call-1"}], tools=[WEATHER])
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in rendered and "sunny, 21 C" in rendered
    assert backend.submitted[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert backend.submitted[0].sampling.json_schema is None
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(script[:6])}


# ------------------------------------------------------------------ with vLLM's schema and parsers
def scripted(backend, tokenizer, text: str) -> None:
    backend.script = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


@pytest.mark.vllm
@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_vllms_schema_and_reads_the_json_calls(client, backend, tokenizer, parallel):
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    scripted(backend, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                 '{"name": "get_time", "parameters": {}}]')
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel,
             response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    sampling = backend.submitted[0].sampling
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[], tools=[WEATHER, TIME], tool_choice="required",
                                    parallel_tool_calls=parallel)
    assert json.loads(sampling.json_schema) == get_json_schema_from_tools("required", request.tools, parallel)
    assert not sampling.json_object  # the tools' schema replaces the response format
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.vllm
def test_a_named_function_gets_its_arguments_streamed(make_client, backend, tokenizer):
    backend.batch_size = 3
    client = make_client(backend)
    scripted(backend, tokenizer, '{"city": "Paris"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=[WEATHER, TIME], tool_choice=choice).json()["choices"][0]
    assert json.loads(backend.submitted[0].sampling.json_schema) == WEATHER["function"]["parameters"]
    assert whole["finish_reason"] == "stop"  # OpenAI's for a named function
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    chunks = sse_payloads(chat(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True))
    calls = tool_deltas(chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Paris"}')]
    assert calls[0]["id"] and sum(1 for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.vllm
def test_a_kimi_model_numbers_its_calls_after_the_conversation_s_as_vllm_does(make_client, backend, tokenizer,
                                                                              tiny_model, tmp_path):
    """vLLM's tool-call parser gives the calls it reads from JSON ids of the form Kimi's models use
    (`functions.NAME:INDEX`, counting on from the calls earlier in the conversation) where the
    model's config says Kimi; random ones otherwise."""
    from vllm.renderers.chat_utils import make_tool_call_id

    backend.batch_size = 2
    read = parser_model_config(str(with_model_type(tiny_model, tmp_path / "kimi", "kimi_k2")))
    client = make_client(backend, answers=AnswerReading(str(tiny_model), "xlam", model_config=read))
    earlier = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "functions.get_time:0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"}]
    scripted(backend, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                 '{"name": "get_time", "parameters": {}}]')
    required = chat(client, messages=earlier, tools=[WEATHER, TIME], tool_choice="required", n=2).json()
    for choice in required["choices"]:  # each choice counts on from the conversation's calls
        assert [c["id"] for c in choice["message"]["tool_calls"]] == [
            make_tool_call_id("kimi_k2", "get_weather", 1), make_tool_call_id("kimi_k2", "get_time", 2)]
    assert make_tool_call_id("kimi_k2", "get_time", 2) == "functions.get_time:2"
    scripted(backend, tokenizer, '{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=[WEATHER], tool_choice=named).json()["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in whole] == ["functions.get_weather:0"]
    streamed = tool_deltas(sse_payloads(chat(client, messages=earlier, tools=[WEATHER], tool_choice=named,
                                             stream=True)))
    assert [c["id"] for c in streamed.values()] == ["functions.get_weather:1"]
    plain = make_client(backend, answers=AnswerReading(str(tiny_model), "xlam"))
    [call] = chat(plain, messages=earlier, tools=[WEATHER], tool_choice=named).json()["choices"][0]["message"][
        "tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-")


@pytest.mark.vllm
def test_required_streams_its_calls_once_the_list_is_complete(client, backend, tokenizer):
    scripted(backend, tokenizer, '[{"name": "get_time", "parameters": {}}]')
    chunks = sse_payloads(chat(client, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    calls = tool_deltas(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tokens_read_as_calls_still_stream_their_logprobs_and_ids(client, backend, tokenizer):
    """Tokens the reader holds back (a call list not complete yet) still come in chunks of their
    own, with empty deltas, carrying their log probabilities and ids, as vLLM's server sends them."""
    scripted(backend, tokenizer, '[{"name": "get_time", "parameters": {}}]')
    chunks = sse_payloads(chat(client, tools=[WEATHER, TIME], tool_choice="required", stream=True, logprobs=True,
                               return_token_ids=True))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert ids == backend.script and len(entries) == len(ids)
    assert any(c["delta"] == {} and c["finish_reason"] is None for c in choices)


@pytest.fixture
def hermes(make_client, backend, tiny_model):
    """A gateway reading "auto" answers with vLLM's hermes parser (the tiny model's template speaks it)."""
    def make(batch_size: int = 1):
        backend.batch_size = batch_size
        return make_client(backend, answers=AnswerReading(str(tiny_model), "hermes"))
    return make


CALL = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.vllm
def test_auto_reads_the_models_call_with_vllms_parser(hermes, backend, tokenizer):
    client = hermes()
    scripted(backend, tokenizer, CALL)
    choice = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert backend.submitted[0].sampling.json_schema is None  # free text: the parser finds the calls
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    scripted(backend, tokenizer, "It is sunny in Paris.")
    plain = chat(client, tools=[WEATHER]).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant",
                                                                     "content": "It is sunny in Paris."}
    scripted(backend, tokenizer, CALL)
    null = chat(client, tools=[WEATHER], tool_choice=None).json()["choices"][0]  # null: the default, "auto"
    assert null["finish_reason"] == "tool_calls" and null["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.vllm
def test_a_beam_searched_answer_is_read_for_calls(hermes, backend, tokenizer):
    """Beam search with tool_choice "auto": the best beam's text is read for calls, as vLLM reads it."""
    client = hermes()
    ids, eos = tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id
    start: list[int] = []

    def next_token(prompt: list[int]) -> tuple[int, TokenLogprob]:
        start[:] = start or [len(prompt)]
        at = len(prompt) - start[0]
        token = ids[at] if at < len(ids) else eos
        other = next(t for t in range(token + 1, token + 3) if t != eos)
        return token, TokenLogprob(-0.1, ((token, -0.1), (other, -3.0)), rank=1)

    backend.next_token = next_token
    choice = chat(client, tools=[WEATHER], use_beam_search=True, max_tokens=len(ids) + 2).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # A strict tool puts a grammar on the calls, which beam search would start over at every step.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    error = chat(client, tools=[strict], use_beam_search=True).json()["error"]
    assert error["param"] == "tools" and "beam search" in error["message"]


@pytest.mark.vllm
@pytest.mark.parametrize("batch_size", [1, 4])
def test_auto_streams_the_call_as_deltas(hermes, backend, tokenizer, batch_size):
    client = hermes(batch_size)
    scripted(backend, tokenizer, CALL)
    chunks = sse_payloads(chat(client, tools=[WEATHER], stream=True, n=2))
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in mine)
        calls = tool_deltas(mine)
        assert text == "Let me look. "
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
        assert calls[0]["id"] and mine[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------ Cohere Command's parsers
COHERE_MARKUP = ("<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
                 "<|START_ACTION|>", "<|END_ACTION|>")
LOOK = "<|START_RESPONSE|>Let me look.<|END_RESPONSE|>"
ACTION = ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]'
          "<|END_ACTION|>")
PICK_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def command_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model as Cohere's Command A: its architecture (vLLM's Cohere parser picks its tags by
    it) and its markup as special tokens (vLLM's parser has them kept in the text, for melody to find
    the calls by them). The scripted backend never runs the weights."""
    from tokenizers import AddedToken, Tokenizer

    model = with_model_type(tiny_model, tmp_path_factory.mktemp("cohere") / "command-a", "cohere2")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["Cohere2ForCausalLM"]}))
    vocabulary = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocabulary.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in COHERE_MARKUP])
    vocabulary.save(str(model / "tokenizer.json"))
    return model


@pytest.fixture(params=["cohere_command3", "cohere_command4"])
def command(request, command_model, backend):
    """A gateway reading answers with vLLM's Cohere Command parser over that model, its tokenizer and the parser's name."""
    tokenizer = load_tokenizer(command_model)
    app = create_app(backend.open, tokenizer, GatewayConfig(), AnswerReading(str(command_model), request.param))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokenizer, request.param


def command_tag(*tools: dict) -> str:
    """The structural tag vLLM's Cohere parser folds a request's tools into, for Command A."""
    from vllm.parser.cohere_command import convert_schema_to_structural_tags

    return convert_schema_to_structural_tags(tools=list(tools), model_architecture="Cohere2ForCausalLM")


@pytest.mark.vllm
@pytest.mark.parametrize("batch_size", [1, 4])
def test_cohere_command_reads_the_models_action_whole_and_streamed(command, backend, batch_size):
    """tool_choice "auto": the tools go to the engine as vLLM's Cohere tag, and the call the model
    writes in Cohere's markup is read by melody, whole and as deltas, with the id the model gave it."""
    client, tokenizer, _ = command
    backend.batch_size = batch_size
    scripted(backend, tokenizer, LOOK + ACTION)
    choice = chat(client, tools=[WEATHER, TIME]).json()["choices"][0]
    sampling = backend.submitted[0].sampling
    assert sampling.structural_tag == command_tag(WEATHER, TIME) and sampling.json_schema is None
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("0", "get_weather", {"city": "Paris"})]
    chunks = sse_payloads(chat(client, tools=[WEATHER, TIME], stream=True))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Let me look."
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in tool_deltas(chunks).values()] == [
        ("0", "get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    scripted(backend, tokenizer, "<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>")
    plain = chat(client, tools=[WEATHER, TIME]).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant",
                                                                     "content": "It is sunny in Paris."}


@pytest.mark.vllm
@pytest.mark.parametrize("tool_choice, finish_reason", [("required", "tool_calls"), (PICK_WEATHER, "stop")])
def test_cohere_command_constrains_required_and_named_calls_with_its_own_tag(command, backend, tool_choice,
                                                                            finish_reason):
    """As `vllm serve` with Cohere's parser: "required" and a named function get the same tag as
    "auto" (not vLLM's JSON list), and melody reads the calls the model writes in it."""
    client, tokenizer, _ = command
    scripted(backend, tokenizer, '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
                                 '{"city": "Paris"}}, {"tool_call_id": "1", "tool_name": "get_weather", "parameters": '
                                 '{"city": "Rome"}}]<|END_ACTION|>')
    choice = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice).json()["choices"][0]
    sampling = backend.submitted[0].sampling
    assert sampling.structural_tag == command_tag(WEATHER, TIME) and sampling.json_schema is None
    assert choice["finish_reason"] == finish_reason and choice["message"]["content"] is None
    read = [("0", "get_weather", {"city": "Paris"}), ("1", "get_weather", {"city": "Rome"})]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == read
    chunks = sse_payloads(chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice, stream=True))
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in tool_deltas(chunks).values()] == read


@pytest.mark.vllm
def test_cohere_command_leaves_none_unconstrained_and_its_markup_out_as_vllm_does(command, backend):
    """tool_choice "none" without a reasoning parser: vLLM's server leaves the request as it came (no
    tag, special tokens skipped), so the markup never reaches melody and no call is read. The text
    is content, or, for Command 4's parser, which reads unmarked text as thinking, reasoning: shown
    as vLLM shows it, though no reasoning parser was named."""
    client, tokenizer, _ = command
    scripted(backend, tokenizer, LOOK + ACTION)
    choice = chat(client, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert backend.submitted[0].sampling.structural_tag is None
    message = choice["message"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in message
    assert (message["content"] or message.get("reasoning")) == (
        'Let me look.[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]')


COUNTRY = {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}


def as_vllm_serve_adjusts(model: Path, parser: str, tools: list[dict], **body) -> str | None:
    """The structural tag vLLM's server gives a chat with these tools and fields: its own request
    (the response format as the client sent it) through its parser's adjust_request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model))
    request = ChatCompletionRequest(messages=ASK, tools=tools, **body)
    adjusted = parser_class(parser, None, tokenizer, str(model))(
        tokenizer, tools, model_config=parser_model_config(str(model))).adjust_request(request)
    return None if adjusted.structured_outputs is None else adjusted.structured_outputs.structural_tag


@pytest.mark.vllm
@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY}},
    {"type": "json_object"},
])
def test_cohere_command_folds_a_response_format_into_its_tag_as_vllm_serve_does(command, command_model, backend,
                                                                                response_format):
    """With tools offered, vLLM's Cohere parser folds the response format into the tag it builds for
    them (calls in its action markup, the format in its response markup): the engine gets the tag
    vLLM's server gives the same request, and no separate format. With "none" vLLM's server leaves
    the request to the format alone (its renderer does not have the parser adjust it)."""
    client, tokenizer, parser = command
    scripted(backend, tokenizer, '<|START_RESPONSE|>{"country": "France"}<|END_RESPONSE|>')
    r = chat(client, tools=[WEATHER], response_format=response_format)
    assert r.status_code == 200, r.text
    sampling = backend.submitted[0].sampling
    schema = COUNTRY if response_format["type"] == "json_schema" else {"type": "object"}
    assert sampling.structural_tag is not None and json.dumps(schema) in sampling.structural_tag
    assert sampling.structural_tag == as_vllm_serve_adjusts(command_model, parser, [WEATHER],
                                                            response_format=response_format)
    assert sampling.json_schema is None and not sampling.json_object
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"country": "France"}
    assert chat(client, tools=[WEATHER], tool_choice="none", response_format=response_format).status_code == 200
    alone = backend.submitted[-1].sampling
    assert alone.structural_tag is None and bool(alone.json_schema or alone.json_object)


@pytest.mark.vllm
def test_cohere_commands_reasoning_parser_alone_leaves_required_calls_to_vllms_json(command_model, backend):
    """Named as the reasoning parser only, Cohere's reads no calls: "required" goes as vLLM's JSON
    schema and the gateway reads the calls from it."""
    tokenizer = load_tokenizer(command_model)
    reading = AnswerReading(str(command_model), reasoning_parser="cohere_command3", engines_reason=True)
    with TestClient(create_app(backend.open, tokenizer, GatewayConfig(), reading), raise_server_exceptions=False) as client:
        scripted(backend, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
        choice = chat(client, tools=[WEATHER, TIME], tool_choice="required").json()["choices"][0]
    assert backend.submitted[0].sampling.json_schema is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
