"""OpenAI request bodies -> validated, typed requests; every problem is a 400 naming the field.

What a request asks for and the model cannot do (a suffix without fill-in-the-middle tokens, tools
on the sim engine) is refused with a 400 rather than silently ignored: a client relying on it would
otherwise get a different answer than it asked for; so are vLLM's own options the gateway does not
honour (`UNHONOURED_VLLM_OPTIONS`) unless at their defaults. Fields that ask nothing of the answer
(``user``, ``metadata``) are ignored, as OpenAI-compatible servers commonly do. Extensions also
accepted by vLLM's server (clients send them through ``extra_body``): ``stop_token_ids``,
``ignore_eos``, ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``structured_outputs``, ``prompt_logprobs``,
``thinking_token_budget`` (with a reasoning parser),
``use_beam_search`` with ``length_penalty``, ``repetition_detection``, and for chat ``return_prompt_text``
and how the conversation renders (``chat_template_kwargs``, ``documents``, ``reasoning_effort``,
``continue_final_message``, ``add_generation_prompt``, ``add_special_tokens``); llumdask's own:
``priority``. The ranges of sampling options are `SamplingParams`'s, so that the gateway and the
notebook client accept the same.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from llumdask.api.gateway.detok import check_stop
from llumdask.api.gateway.errors import InvalidRequest
from llumdask.api.gateway.generation_config import GenerationDefaults
from llumdask.api.gateway.json_schema import check_schema
from llumdask.api.gateway.repetition import MAX_PATTERN_SIZE, RepetitionDetection
from llumdask.api.gateway.tools import ToolUse, assistant_calls, parse_tool_use
from llumdask.request import INT64, MAX_LOGPROBS, STRUCTURED_KINDS, Priority, SamplingParams, check_cache_salt, is_number

MAX_SEED = INT64 - 1  # vLLM's bound, the largest integer comms carry
# OpenAI's bound on choices per request.
MAX_CHOICES = 128
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Sampling options passed to the engine as given: name -> the JSON type it must have.
SAMPLING_OPTIONS: dict[str, str] = {
    "top_k": "integer",
    "min_p": "number",
    "repetition_penalty": "number",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "min_tokens": "integer",
    "logit_bias": "object",
    "allowed_token_ids": "token ids",
    "bad_words": "strings",
    "thinking_token_budget": "integer",
}


@dataclass(frozen=True)
class GenerationOptions:
    """What both endpoints share once validated."""

    model: str
    # None: up to the model's context (chat); completions default to 16 as OpenAI's do.
    max_tokens: int | None
    # None: not given (the model's generation config decides, else OpenAI's 1: `with_model_defaults`).
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    # vLLM's: the text ends with the stop string found; special tokens have text.
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: Priority | None
    # Choices returned, of best_of generated (the n likeliest per token); each is its own request.
    n: int
    best_of: int
    # Log probabilities of each token and of this many alternatives (None: none asked for);
    # echo (completions): the prompt comes first in the text, and in the log probabilities.
    logprobs: int | None
    echo: bool
    # The SAMPLING_OPTIONS given, each checked on its own (min_tokens against max_tokens later).
    sampling: Mapping[str, Any]
    # The request field a structured output came from (response_format or structured_outputs), if any.
    structured_field: str | None = None
    # vLLM's: prompt blocks are shared from the prefix cache only with requests of the same salt.
    cache_salt: str | None = None
    # vLLM's: the response carries the prompt's and the answer's token ids; log probabilities name
    # tokens "token_id:ID".
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: keep this many prompt tokens (-1: the model's context less one), the last ones
    # (truncation_side "left", vLLM's default for generation) or the first ("right"). None: all.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # vLLM's: each prompt token's log probability and rank and this many alternatives', in the
    # whole response (a stream has no place for them). None: not asked for.
    prompt_logprobs: int | None = None
    # vLLM's beam search: n beams (vLLM's width) kept by summed log probability, ranked at the end
    # by it over the sequence's length to the power length_penalty (api/gateway/beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the output ends ("repetition") where it repeats an n-gram; None: not asked for.
    repetition_detection: RepetitionDetection | None = None


@dataclass(frozen=True)
class CompletionRequest:
    options: GenerationOptions
    # Text, or token ids given directly.
    prompt: str | tuple[int, ...]
    # The text that comes after the completion (fill in the middle); None for none.
    suffix: str | None = None
    # A text prompt's special tokens (a beginning of sequence), as the tokenizer adds them (vLLM's field).
    add_special_tokens: bool = True


# Reasoning efforts a chat may ask for (vLLM's list: OpenAI's and more); templates read the value.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Template variables a request sets through its own fields, not through chat_template_kwargs;
# chat_template and tokenize are refused there as vLLM refuses them. (documents may come either
# way, the field winning, as in vLLM.)
_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize"})


@dataclass(frozen=True)
class ChatRendering:
    """How a conversation becomes the prompt, as vLLM's chat fields ask for it."""

    # The assistant's header after the messages, or the last message left open for the model to
    # go on with (a prefilled answer); never both.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Template variables: `chat_template_kwargs` (e.g. enable_thinking), `documents` (RAG
    # templates), `reasoning_effort` (and enable_thinking from it, as vLLM sets it, unless given).
    variables: Mapping[str, Any] = field(default_factory=dict)
    # Special tokens added to the rendered prompt beyond what the template writes.
    add_special_tokens: bool = False


@dataclass(frozen=True)
class ChatRequest:
    options: GenerationOptions
    # {"role": str, "content": str} (content parts joined), plus "name", an assistant's
    # "tool_calls" (arguments as objects) and a tool's "tool_call_id" where given.
    messages: tuple[dict[str, Any], ...]
    # The tools offered, None for none.
    tools: ToolUse | None = None
    rendering: ChatRendering = ChatRendering()
    # vLLM's return_prompt_text: the response carries the rendered prompt.
    return_prompt_text: bool = False
    # vLLM's include_reasoning: false leaves the reasoning a reasoning parser reads out of the response.
    include_reasoning: bool = True


# vLLM's own request options the gateway does not honour, each with vLLM's default: a request
# asking for something else is refused (token offsets, KV transfer...) rather than answered as if
# it had not asked. logprob_token_ids among them on purpose: vLLM 0.32's sampler gives every
# request sharing a step with one the named tokens' form, so the likeliest alternatives of other
# clients' requests on that instance would be lost.
UNHONOURED_VLLM_OPTIONS: dict[str, Any] = {
    "logprob_token_ids": None,
    "spaces_between_special_tokens": True,
    "return_token_offsets": False,
    "return_prompt_text": False, "return_mm_kwargs": False, "kv_transfer_params": None,
    "ec_transfer_params": None, "vllm_xargs": None, "prompt_embeds": None, "media_io_kwargs": None,
    "mm_processor_kwargs": None, "watermarking": None,
}


# Of UNHONOURED_VLLM_OPTIONS, the switches whose false asks nothing (vLLM reads false as 0 elsewhere).
_SWITCHES = frozenset({"watermarking", "return_token_offsets", "return_prompt_text", "return_mm_kwargs"})


def _refuse_unhonoured(body: Mapping[str, Any], honoured: frozenset[str] = frozenset()) -> None:
    """A 400 for the first option of UNHONOURED_VLLM_OPTIONS but `honoured` (this endpoint's) that
    asks for something: neither its default, nor false for a switch, nor an empty object or list
    where the default is none."""
    for name, default in UNHONOURED_VLLM_OPTIONS.items():
        if name in honoured:
            continue
        value = body.get(name)
        off = (value is False and name in _SWITCHES) or (
            default is None and isinstance(value, (dict, list)) and not value)
        if value is not None and value != default and not off:
            raise InvalidRequest(f"{name} is a vLLM option llumdask's gateway does not honour; leave it out",
                                 param=name, code="unsupported_parameter")


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    _refuse_unhonoured(body)
    logprobs = _int(body, "logprobs", minimum=0, maximum=MAX_LOGPROBS) if body.get("logprobs") is not None else None
    options = _check_beam_search(_options(body, max_tokens_default=16, max_tokens_fields=("max_tokens",),
                                          logprobs=logprobs, echo=_bool(body, "echo", False)), body, chat=False)
    suffix = _str(body, "suffix") if body.get("suffix") is not None else None
    return CompletionRequest(options, _prompt(body), suffix or None, _bool(body, "add_special_tokens", True))


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    _refuse_unhonoured(body, honoured=frozenset({"return_prompt_text"}))
    if _bool(body, "echo", False):
        raise InvalidRequest("echo (vLLM's: the last message's text before the answer) is not honoured by "
                             "llumdask's gateway for chat; leave it out", param="echo", code="unsupported_parameter")
    tools = parse_tool_use(body)
    top = _int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS) if body.get("top_logprobs") is not None else None
    wanted = _bool(body, "logprobs", False)
    if top is not None and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
    options = _check_beam_search(_options(body, max_tokens_default=None,
                                          max_tokens_fields=("max_completion_tokens", "max_tokens"),
                                          logprobs=(top or 0) if wanted else None, echo=False), body, chat=True)
    return ChatRequest(options, _messages(body), tools, _rendering(body, add_special_tokens=False),
                       _bool(body, "return_prompt_text", False), _bool(body, "include_reasoning", True))


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize: a text, or chat messages rendered with the model's template first."""

    model: str | None
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    # How messages render; its add_special_tokens is the request's for a prompt too.
    rendering: ChatRendering
    return_token_strs: bool
    # The tools the template renders with the messages (vLLM's field), None for none.
    tools: tuple[dict[str, Any], ...] | None = None


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    model = _str(body, "model") if body.get("model") is not None else None
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise InvalidRequest("give a prompt or messages, not both", param="prompt", code="invalid_value")
    if not chat and body.get("prompt") is None:
        raise InvalidRequest("you must provide a prompt or messages", param="prompt", code="missing_required_parameter")
    return TokenizeRequest(
        model=model,
        prompt=None if chat else _str(body, "prompt"),
        messages=_messages(body) if chat else None,
        # vLLM's defaults: a chat template adds its own special tokens, a plain prompt gets them.
        rendering=_rendering(body, add_special_tokens=not chat),
        return_token_strs=_bool(body, "return_token_strs", False),
        tools=_tools(body) if chat else None,
    )


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    use = parse_tool_use(body)
    return None if use is None else use.tools


def _rendering(body: Mapping[str, Any], *, add_special_tokens: bool) -> ChatRendering:
    """vLLM's chat rendering fields. A request's own template is refused, as vLLM's server refuses
    one unless started to trust them: the operator's `--chat-template` is the model's."""
    if body.get("chat_template") is not None:
        raise InvalidRequest("a request cannot bring its own chat template; the server's is set with --chat-template",
                             param="chat_template", code="unsupported_parameter")
    go_on = _bool(body, "continue_final_message", False)
    header = _bool(body, "add_generation_prompt", not go_on)
    if go_on and header:
        raise InvalidRequest("continue_final_message leaves the last message open; it cannot be set with "
                             "add_generation_prompt, which starts a new one", param="continue_final_message",
                             code="invalid_value")
    variables = dict(_template_kwargs(body.get("chat_template_kwargs")))
    if body.get("documents") is not None:
        variables["documents"] = _documents(body["documents"])
    effort = _one_of(body, "reasoning_effort", REASONING_EFFORTS, None)
    if effort is not None:
        variables["reasoning_effort"] = effort
        variables.setdefault("enable_thinking", effort != "none")
    return ChatRendering(header, go_on, variables, _bool(body, "add_special_tokens", add_special_tokens))


def _template_kwargs(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _wrong_type("chat_template_kwargs", "an object", value)
    own = sorted(_OWN_VARIABLES & value.keys())
    if own:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(own)}: the request's own fields do",
                             param=f"chat_template_kwargs.{own[0]}", code="invalid_value")
    return value


def _documents(value: Any) -> list[dict[str, str]]:
    """RAG documents as vLLM takes them: objects of strings (a title and a text, usually)."""
    if not isinstance(value, list):
        raise _wrong_type("documents", "an array of objects", value)
    for i, document in enumerate(value):
        if not isinstance(document, Mapping) or not all(isinstance(v, str) for v in document.values()):
            raise _wrong_type(f"documents[{i}]", "an object of strings", document)
    return [dict(d) for d in value]


def parse_detokenize(body: Any) -> tuple[str | None, tuple[int, ...]]:
    """vLLM's /detokenize: (model, token ids)."""
    body = _object(body)
    model = _str(body, "model") if body.get("model") is not None else None
    if body.get("tokens") is None:
        raise InvalidRequest("you must provide tokens", param="tokens", code="missing_required_parameter")
    return model, _token_ids(body["tokens"], "tokens", allow_empty=True)


# ------------------------------------------------------------------ shared fields
def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"The request body must be a JSON object, not {_json_type(body)}", code="invalid_type")
    return body


def _options(body: Mapping[str, Any], *, max_tokens_default: int | None, max_tokens_fields: tuple[str, ...],
             logprobs: int | None, echo: bool) -> GenerationOptions:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", param="model", code="missing_required_parameter")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options",
                                 code="invalid_value")
        if not isinstance(stream_options, Mapping):
            raise _wrong_type("stream_options", "an object", stream_options)
    structured, structured_field = _structured(body)
    max_tokens = max_tokens_default
    for name in max_tokens_fields:  # the first one given wins (max_completion_tokens over max_tokens)
        if body.get(name) is not None:
            max_tokens = _int(body, name, minimum=1)
            break
    return GenerationOptions(
        model=_str(body, "model"),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", None, minimum=0.0, maximum=2.0),
        top_p=_number(body, "top_p", None, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        seed=_int(body, "seed", minimum=0, maximum=MAX_SEED) if body.get("seed") is not None else None,
        stop=_stop(body.get("stop")),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", allow_empty=True),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=_bool(stream_options or {}, "include_usage", False, param="stream_options.include_usage"),
        priority=_priority(body.get("priority")),
        **_choices(body, stream),
        logprobs=logprobs,
        echo=echo,
        sampling={**{name: _sampling_option(body, name, kind) for name, kind in SAMPLING_OPTIONS.items()
                     if body.get(name) is not None}, **structured},
        structured_field=structured_field,
        cache_salt=_cache_salt(body.get("cache_salt")),
        return_token_ids=_bool(body, "return_token_ids", False),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        truncate_prompt_tokens=(_int(body, "truncate_prompt_tokens", minimum=-1, maximum=MAX_SEED)
                                if body.get("truncate_prompt_tokens") is not None else None),
        truncation_side=_one_of(body, "truncation_side", ("left", "right"), "left"),
        prompt_logprobs=_prompt_logprobs(body, stream),
        use_beam_search=_bool(body, "use_beam_search", False),
        repetition_detection=_repetition_detection(body.get("repetition_detection")),
        length_penalty=_number(body, "length_penalty", 1.0, minimum=-math.inf, maximum=math.inf),
    )


def with_model_defaults(options: GenerationOptions, defaults: GenerationDefaults) -> GenerationOptions:
    """vLLM's server's precedence for sampling options: the request's value, else the model's
    generation config's, else OpenAI's (temperature and top_p 1; the others the engine's)."""
    model = defaults.sampling
    return replace(
        options,
        temperature=next(v for v in (options.temperature, model.get("temperature"), 1.0) if v is not None),
        top_p=next(v for v in (options.top_p, model.get("top_p"), 1.0) if v is not None),
        sampling={**{k: v for k, v in model.items() if k not in ("temperature", "top_p")}, **options.sampling})


def _field_of(sampling_option: str, options: GenerationOptions) -> str:
    """The request field a SamplingParams option came from (a structured output's kind from either field)."""
    return options.structured_field or sampling_option if sampling_option in STRUCTURED_KINDS else sampling_option


def _repetition_detection(value: Any) -> RepetitionDetection | None:
    """vLLM's RepetitionDetectionParams and its rules; all sizes 0 (its defaults) turn it off."""
    param = "repetition_detection"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _wrong_type(param, "an object", value)
    unknown = set(value) - {"max_pattern_size", "min_pattern_size", "min_count"}
    if unknown:
        raise InvalidRequest(f"{param} has no field {sorted(unknown)[0]!r}", param=param, code="invalid_value")
    sizes = {name: 0 if value.get(name) is None else value[name]
             for name in ("max_pattern_size", "min_pattern_size", "min_count")}
    for name, size in sizes.items():
        if not _is_int(size) or size < 0:
            raise InvalidRequest(f"{param}.{name} must be an integer >= 0, got {size!r}", param=f"{param}.{name}",
                                 code="invalid_value")
    if sizes["min_pattern_size"] > sizes["max_pattern_size"]:
        raise InvalidRequest(f"{param}: min_pattern_size must be <= max_pattern_size", param=param,
                             code="invalid_value")
    if not sizes["max_pattern_size"]:
        return None
    if sizes["max_pattern_size"] > MAX_PATTERN_SIZE:
        raise InvalidRequest(f"{param}.max_pattern_size may be at most {MAX_PATTERN_SIZE} (this gateway's bound: it "
                             "checks every token)", param=f"{param}.max_pattern_size", code="invalid_value")
    if sizes["min_count"] < 2:
        raise InvalidRequest(f"{param}: min_count must be >= 2 to find a pattern repeated", param=param,
                             code="invalid_value")
    return RepetitionDetection(**sizes)


def _check_beam_search(options: GenerationOptions, body: Mapping[str, Any], *, chat: bool) -> GenerationOptions:
    """vLLM's beam search applies only the width (n), temperature, max_tokens, ignore_eos,
    length_penalty, how the text is shown and (chat) tools read from the answer; anything else a
    request asks of it is a 400 rather than silently dropped (vLLM drops it). length_penalty means
    nothing without beam search."""
    if not options.use_beam_search:
        if options.length_penalty != 1.0:
            raise InvalidRequest("length_penalty ranks beams: it needs use_beam_search", param="length_penalty",
                                 code="invalid_value")
        return options
    tools = body.get("tools") is not None and body.get("tool_choice") != "none"
    if options.stream and (not chat or tools):
        # vLLM's completions refuse it; a chat streams its answer once searched, tool calls not.
        raise InvalidRequest("beam search cannot be streamed" + (" with tools" if chat else " (as in vLLM)"),
                             param="stream", code="invalid_value")
    if 2 * options.n > MAX_LOGPROBS:
        raise InvalidRequest(f"beam search asks each step for 2 x n alternatives, at most {MAX_LOGPROBS}: "
                             f"n must be at most {MAX_LOGPROBS // 2}", param="n", code="invalid_value")
    if options.echo and options.logprobs is not None:
        raise InvalidRequest("echo with logprobs needs the prompt's log probabilities, which beam search does not "
                             "compute (as in vLLM)", param="echo", code="invalid_value")
    unapplied = {"best_of": options.best_of != options.n, "stop": bool(options.stop), "seed": options.seed is not None,
                 "stop_token_ids": bool(options.stop_token_ids), "top_p": options.top_p not in (None, 1.0),
                 "prompt_logprobs": options.prompt_logprobs is not None,
                 "repetition_detection": options.repetition_detection is not None,
                 "tool_choice": tools and body.get("tool_choice") not in (None, "auto"),
                 **{_field_of(name, options): _asks(name, value) for name, value in options.sampling.items()}}
    for name, asked in unapplied.items():
        if asked:
            raise InvalidRequest(f"beam search does not apply {name}; leave it out", param=name,
                                 code="unsupported_parameter")
    return options


def _asks(sampling_option: str, value: Any) -> bool:
    """Whether a sampling option's value changes anything: not its default, nor an empty list or
    object, nor the -1 of top_k and thinking_token_budget (no limit, as their defaults)."""
    default = SamplingParams.__dataclass_fields__[sampling_option].default
    return (value != default and value not in ({}, [], ())
            and not (sampling_option in ("top_k", "thinking_token_budget") and value == -1))


def _prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's prompt_logprobs, up to its default bound (20; its -1, the whole vocabulary, is over
    it). A stream cannot carry them (vLLM's 400) but for 0, which vLLM lets through (an echo's
    prompt then shows no alternatives)."""
    if body.get("prompt_logprobs") is None:
        return None
    top = _int(body, "prompt_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if stream and top:
        raise InvalidRequest("prompt_logprobs are not available when stream is true (as in vLLM)",
                             param="prompt_logprobs", code="invalid_value")
    return top


def _cache_salt(value: Any) -> str | None:
    try:
        check_cache_salt(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="cache_salt", code="invalid_value") from None
    return value


def _structured(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The structured output asked for, by OpenAI's response_format or vLLM's structured_outputs
    (one of them), as SamplingParams fields, and the field that asked (None: neither)."""
    formats, vllm = _response_format(body.get("response_format")), _structured_outputs(body.get("structured_outputs"))
    if formats and vllm:
        raise InvalidRequest("response_format and structured_outputs each ask for a structured output; send one",
                             param="structured_outputs", code="invalid_value")
    if formats:
        return formats, "response_format"
    return vllm, "structured_outputs" if vllm else None


# vLLM's structured-output kinds the gateway honours (json becomes SamplingParams' json_schema), and
# its options honoured as their defaults only.
_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_STRUCTURED_DEFAULTS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                        "whitespace_pattern": None}


def _structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs: exactly one of json (a schema, checked against its metaschema),
    json_object, regex, choice, grammar or structural_tag (JSON text; the engine reads the tag)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _wrong_type("structured_outputs", "an object", value)
    for name in value:
        if name not in _VLLM_KINDS and value[name] is not None and (
                name not in _STRUCTURED_DEFAULTS or value[name] != _STRUCTURED_DEFAULTS[name]):
            raise InvalidRequest(f"structured_outputs.{name} is not honoured by llumdask's gateway; leave it out",
                                 param=f"structured_outputs.{name}", code="unsupported_parameter")
    kinds = [name for name in _VLLM_KINDS if value.get(name) is not None]
    if len(kinds) != 1:
        raise InvalidRequest(f"structured_outputs needs exactly one of {', '.join(_VLLM_KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}", param="structured_outputs", code="invalid_value")
    (kind,) = kinds
    given, param = value[kind], f"structured_outputs.{kind}"
    if kind == "json":
        try:
            schema = json.loads(given) if isinstance(given, str) else given
        except (ValueError, RecursionError):
            schema = None
        if not isinstance(schema, Mapping):
            raise _wrong_type(param, "a JSON schema object", given)
        check_schema(schema, param)
        return {"json_schema": json.dumps(schema)}
    if kind == "json_object":
        if given is not True:
            raise InvalidRequest(f"{param} must be true when given", param=param, code="invalid_value")
        return {"json_object": True}
    if kind == "choice" and not (isinstance(given, list) and given and all(isinstance(c, str) for c in given)):
        raise _wrong_type(param, "a non-empty list of strings", given)
    if kind in ("regex", "grammar", "structural_tag") and not (isinstance(given, str) and given):
        raise _wrong_type(param, "a non-empty string", given)
    try:
        SamplingParams(**{kind: given})
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=param, code="invalid_value") from None
    return {kind: given}


def _response_format(value: Any) -> dict[str, Any]:
    """OpenAI's response_format as SamplingParams fields: text (nothing), json_object, json_schema
    with a schema that must itself be valid (checked against its metaschema), or vLLM's
    structural_tag (the engine reads the tag)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":  # vLLM's: the object itself is the tag, read by the engine
        try:
            return {"structural_tag": SamplingParams(structural_tag=json.dumps(value)).structural_tag}
        except (ValueError, RecursionError):
            raise InvalidRequest("response_format of type structural_tag must be a structural tag object of text",
                                 param="response_format", code="invalid_value") from None
    if kind != "json_schema":
        raise InvalidRequest("response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                             f"got {kind!r}", param="response_format.type", code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _wrong_type("response_format.json_schema", "an object", spec)
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise _wrong_type("response_format.json_schema.schema", "an object", schema)
    check_schema(schema, "response_format.json_schema.schema")
    return {"json_schema": json.dumps(schema)}


def _choices(body: Mapping[str, Any], stream: bool) -> dict[str, int]:
    n = _int(body, "n", minimum=1, maximum=MAX_CHOICES) if body.get("n") is not None else 1
    best_of = n
    if body.get("best_of") is not None:
        best_of = _int(body, "best_of", minimum=1, maximum=MAX_CHOICES)
        if best_of < n:
            raise InvalidRequest(f"best_of ({best_of}) must be >= n ({n})", param="best_of", code="invalid_value")
        if best_of > n and stream:
            raise InvalidRequest("best_of > n cannot be streamed: the best are known only at the end",
                                 param="best_of", code="invalid_value")
    return {"n": n, "best_of": best_of}


def _sampling_option(body: Mapping[str, Any], name: str, kind: str) -> Any:
    value = body[name]
    if kind == "object":
        if not isinstance(value, Mapping):
            raise _wrong_type(name, "an object", value)
    elif kind in ("token ids", "strings"):
        if not isinstance(value, list):
            raise _wrong_type(name, "an array", value)
        if not value and kind == "token ids":  # no token at all: nothing could be generated
            raise InvalidRequest(f"{name} must not be empty", param=name, code="invalid_value")
    elif kind == "integer" and not _is_int(value):
        raise _wrong_type(name, "an integer", value)
    elif kind == "number" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise _wrong_type(name, "a number", value)
    try:
        SamplingParams(max_tokens=max(1, value) if name == "min_tokens" else 1, **{name: value})
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=name, code="invalid_value") from None
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or any(not isinstance(s, str) for s in values):
        raise _wrong_type("stop", "a string or a list of strings", value)
    try:
        return check_stop(values)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="stop", code="invalid_value") from None


def _priority(value: Any) -> Priority | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong_type("priority", "'high' or 'normal'", value)
    return parse_priority(value, "priority")


def parse_priority(value: str, param: str) -> Priority:
    """'high' or 'normal' (any case), from the body or the x-llumdask-priority header."""
    try:
        return Priority.parse(value)
    except ValueError:
        raise InvalidRequest(f"{param} must be 'high' or 'normal', got {value!r}", param=param,
                             code="invalid_value") from None


# ------------------------------------------------------------------ prompts and messages
def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("you must provide a prompt", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequest("batched prompts are not supported; send one prompt per request",
                                 param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt", code="invalid_value")
        return prompt
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt", allow_empty=False)
    raise _wrong_type("prompt", "a string or a list of token ids", prompt)


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("you must provide messages", param="messages", code="missing_required_parameter")
    return check_messages(messages)


def check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """A conversation as the chat endpoint takes it (OpenAI's message shapes); InvalidRequest
    naming the first bad part."""
    if not isinstance(messages, list):
        raise _wrong_type("messages", "a list of messages", messages)
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages", code="invalid_value")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(message: Any, param: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise _wrong_type(param, "an object", message)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidRequest(f"{param}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                             param=f"{param}.role", code="invalid_value")
    if message.get("function_call"):
        raise InvalidRequest("function_call is deprecated by OpenAI; send tool_calls", param=f"{param}.function_call",
                             code="unsupported_parameter")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), role, f"{param}.content")}
    if message.get("name") is not None:
        out["name"] = _str(message, "name", param=f"{param}.name")
    if message.get("tool_calls"):
        if role != "assistant":
            raise InvalidRequest("only assistant messages carry tool_calls", param=f"{param}.tool_calls",
                                 code="invalid_value")
        out["tool_calls"] = assistant_calls(message["tool_calls"], f"{param}.tool_calls")
    if role == "tool":
        out["tool_call_id"] = _str(message, "tool_call_id", param=f"{param}.tool_call_id")
    return out


def _content(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{param}[{i}] must be a text part ({{'type': 'text', 'text': ...}}); "
                                     "only text is supported", param=f"{param}[{i}]", code="unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong_type(param, "a string or a list of text parts", content)


# ------------------------------------------------------------------ typed field readers
def _token_ids(value: Any, param: str, *, allow_empty: bool) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or any(not _is_int(t) or t < 0 for t in value):
        raise _wrong_type(param, "a list of non-negative integer token ids", value)
    if not value and not allow_empty:
        raise InvalidRequest(f"{param} is empty", param=param, code="invalid_value")
    return tuple(value)


def _str(body: Mapping[str, Any], name: str, *, param: str | None = None) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise _wrong_type(param or name, "a string", value)
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool, *, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(param or name, "a boolean", value)
    return value


def _one_of(body: Mapping[str, Any], name: str, allowed: Sequence[str], default: str | None) -> str | None:
    """One of the `allowed` strings, or `default` when not given."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str) or value not in allowed:
        raise InvalidRequest(f"{name} must be one of {', '.join(allowed)}, got {value!r:.80}", param=name,
                             code="invalid_value")
    return value


def _int(body: Mapping[str, Any], name: str, *, minimum: int, maximum: int | None = None) -> int:
    value = body.get(name)
    if not _is_int(value):
        raise _wrong_type(name, "an integer", value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise InvalidRequest(f"{name} must be {bound}, got {value}", param=name, code="invalid_value")
    return value


def _number(body: Mapping[str, Any], name: str, default: float | None, *, minimum: float, maximum: float,
            exclusive_minimum: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise _wrong_type(name, "a number", value)
    if value < minimum or value > maximum or (exclusive_minimum and value == minimum):
        low = "(" if exclusive_minimum else "["
        raise InvalidRequest(f"{name} must be in {low}{minimum:g}, {maximum:g}], got {value}", param=name,
                             code="invalid_value")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wrong_type(param: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"{param} must be {expected}, not {_json_type(value)}", param=param, code="invalid_type")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__
