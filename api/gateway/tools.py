"""Tool calling and reasoning in chat completions: the tools a request offers, and the model's
answer read as reasoning, content and calls.

The model's chat template renders the tools. The answer is read the way vLLM's server reads it:
- with one of vLLM's tool-call parsers (``--tool-call-parser``) that reads "required" and named
  calls in the model's own syntax, its composed parser decides the grammar, as in `vllm serve`: a
  structural tag in the model's markup where the parser has one (hermes, llama, qwen3_coder, ...:
  for "required", a named function, and "auto" with a strict tool, parallel_tool_calls false or a
  strict level; beside a response format, a call or the format), none otherwise; the parser reads
  the calls back as for "auto". Cohere Command's (cohere_command3 / 4) does so for every choice but
  "none": its own tag for the tools (and a response format) whatever the choice, read by melody.
- as `vllm serve`, a chat with tool_choice "none" (or no tools) has the parser adjust it only with
  a reasoning parser (or a parser that always asks), so it otherwise goes as it came: no tag, and
  special tokens left out of the text.
- without a tool-call parser, or with one that reads vLLM's JSON (xlam, pythonic, ...), tool_choice
  "required" or a named function constrains the output, through structured outputs, to the JSON
  schema vLLM derives from the tools (a list of {"name", "parameters"}, or the named function's
  arguments); the gateway turns that JSON into calls.
- whatever is not such JSON, vLLM's parser, composed as `vllm serve` composes it, reads whole or as
  streaming deltas: one of vLLM's reasoning parsers (``--reasoning-parser``) takes out what the
  model thought before answering, and the tool-call parser finds the calls in the model's own
  syntax in what follows.
- "none" renders the tools and reads no calls.
vLLM's protocol, parsers and the tokenizer they take are imported in a thread on the first request
that needs them (about ten seconds), so a gateway that never sees one never pays for them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from llumdask.api.gateway.errors import InvalidRequest
from llumdask.api.gateway.json_schema import check_schema
from llumdask.api.gateway.parser_model import ParserModelConfig, parser_model_config
from llumdask.request import SamplingParams

TOOL_CHOICES = ("none", "auto", "required")
# vLLM's --tool-strict-level: what its parsers' structural tags constrain at least (auto: the
# calls tool_choice forces, and the arguments of tools marked strict; function: every call's
# envelope; parameter: every call's arguments too).
TOOL_STRICT_LEVELS = ("auto", "function", "parameter")
# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and how it wants them used, validated."""

    # OpenAI's shape, {"type": "function", "function": {"name", "description", "parameters"}}.
    tools: tuple[dict[str, Any], ...]
    # "none", "auto", "required", or "function" (the one named by `function`).
    choice: str
    function: str | None
    parallel: bool

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        """The output is forced into JSON calls (required, or a named function)."""
        return self.choice in ("required", "function")

    def choice_param(self) -> str | dict[str, Any]:
        """tool_choice as OpenAI (and vLLM's protocol) spell it."""
        if self.choice == "function":
            return {"type": "function", "function": {"name": self.function}}
        return self.choice


def parse_tool_use(body: Mapping[str, Any]) -> ToolUse | None:
    """The body's tools, tool_choice and parallel_tool_calls; None when it offers no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") or body.get("function_call") is not None:
        raise InvalidRequest("functions and function_call are deprecated by OpenAI; send tools and tool_choice",
                             param="functions", code="unsupported_parameter")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("tools must be a list of tools", param="tools", code="invalid_type")
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of tools", param="tools", code="invalid_type")
    checked = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names", param="tools", code="invalid_value")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls", code="invalid_type")
    if choice is None or choice in TOOL_CHOICES:
        return ToolUse(checked, choice or "auto", None, parallel)
    if not isinstance(choice, Mapping):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r:.80}",
                             param="tool_choice", code="invalid_value")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest("tool_choice must name a function as {'type': 'function', 'function': {'name': ...}}",
                             param="tool_choice", code="invalid_value")
    if name not in names:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                             code="invalid_value")
    return ToolUse(checked, "function", name, parallel)


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise InvalidRequest(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param,
                             code="invalid_value")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                             param=f"{param}.function.name", code="invalid_value")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{param}.function.description must be a string", param=f"{param}.function.description",
                             code="invalid_type")
    parameters = function.get("parameters")
    if parameters is not None:
        check_schema(parameters, f"{param}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{param}.function.strict must be a boolean", param=f"{param}.function.strict",
                             code="invalid_type")
    out = {"name": name, **({"description": description} if description is not None else {}),
           **({"parameters": dict(parameters)} if parameters is not None else {}),
           **({"strict": strict} if strict is not None else {})}
    return {"type": "function", "function": out}


def assistant_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier tool_calls, checked, with arguments as objects: chat
    templates render them as JSON (vLLM hands templates the same)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{param} must be a list of tool calls", param=param, code="invalid_type")
    out = []
    for i, call in enumerate(calls):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise InvalidRequest(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                 param=where, code="invalid_value")
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            raise InvalidRequest(f"{where}.function.arguments is not JSON", param=f"{where}.function.arguments",
                                 code="invalid_value") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ------------------------------------------------------------------ reading the answer
@dataclass
class ToolCallDelta:
    """Part of one tool call in a stream (OpenAI's delta.tool_calls item)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        if function:
            out["function"] = function
        return out


@dataclass(frozen=True)
class Answer:
    """A whole answer read: its text content (None when there is none, or only calls), its calls,
    and the reasoning before it (with a reasoning parser)."""

    content: str | None
    calls: tuple[dict[str, Any], ...]
    reasoning: str | None = None


class Piece(NamedTuple):
    """What part of a stream adds to one choice: reasoning, content, tool call deltas."""

    reasoning: str | None = None
    content: str | None = None
    calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return self.reasoning is not None or self.content is not None or bool(self.calls)


class AnswerReader:
    """Reads one choice's chat answer (one per choice: vLLM's parsers keep stream state).

    Calls constrained to vLLM's JSON (`reads_json`: tool_choice "required" or a named function
    without a tool-call parser that reads them in the model's syntax): the JSON its grammar allowed,
    read here, after the thinking where a reasoning parser reads that (the grammar then starts where
    the thinking ends). Otherwise vLLM's `Parser`, composed as `vllm serve` composes it, reads the
    reasoning (a reasoning parser) and, from what follows, the tool calls in the model's syntax (a
    tool-call parser; with "none" or no tools, an engine-based one still takes its markup out of
    the content)."""

    def __init__(self, use: ToolUse | None, parser: Any, request: Any, new_id: Callable[[str | None], str],
                 prompt_ids: Sequence[int], auto_tools: bool = False, structured: bool = False,
                 reads_json: bool = False) -> None:
        """`parser`: vLLM's composed parser (with `reads_json`, one reading only the thinking, or None);
        `new_id(name)`: the id of a call of `name` read here from JSON (None: one the parser read
        without an id);
        `auto_tools`: the gateway reads calls in the model's syntax (vLLM's enable_auto_tools);
        `structured`: a grammar holds the answer from where the thinking ends."""
        self._use = use
        self._parser = parser
        self._request = request
        self._new_id = new_id
        self._prompt_ids = list(prompt_ids)
        self._auto_tools = auto_tools
        self._reads_json = reads_json
        self._text = ""  # a required answer's, read at its end
        self._named_id: str | None = None
        self._made_calls = False
        self._last_calls = False  # the latest delta carried calls
        # Whether the answer goes through the parser: not where the grammar held from its first
        # token (the thinking ended before it), so all of it is the structured output, unless a
        # tool-call parser still reads it for calls (then vLLM's composed parser reads it all, as
        # vLLM's server does).
        self._thinks = parser is not None and not (
            structured and self.thinking_ended() and (reads_json or parser.tool_parser is None))

    @property
    def _choice(self) -> str:
        return "none" if self._use is None else self._use.choice

    def whole(self, text: str, token_ids: Sequence[int]) -> Answer:
        if self._thinks:
            self._parser.set_prompt_token_ids(self._prompt_ids)
            reasoning, content, found = self._parser.parse(text, self._request, enable_auto_tools=self._auto_tools,
                                                           model_output_token_ids=list(token_ids))
            reasoning = reasoning if self._request.include_reasoning else None
            if self._reads_json:  # only the thinking was read: the calls are what follows it
                return Answer(None, self._constrained_calls(content or ""), reasoning)
            calls = tuple({"id": getattr(c, "id", None) or self._new_id(None), "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}} for c in found or ())
            calls = calls[:1] if self._one_call else calls
            self._made_calls = bool(calls)
            return Answer(content or None if calls else content, calls, reasoning)
        return Answer(None, self._constrained_calls(text)) if self._reads_json else Answer(text, ())

    def delta(self, text: str, token_ids: Sequence[int]) -> Piece:
        """What `text` (made of `token_ids`) adds to the stream."""
        if not self._thinks:
            return self._json_delta(text) if self._reads_json else Piece(content=text)
        if self._reads_json:
            read = self._read(self._parser.parse_delta(text, list(token_ids), self._request, self._prompt_ids,
                                                       finished=False))
            return Piece(read.reasoning, None, self._json_delta(read.content or "").calls)
        piece = self._read(self._parser.parse_delta(text, list(token_ids), self._request, self._prompt_ids,
                                                    finished=False))
        self._last_calls = bool(piece.calls)
        return piece._replace(calls=self._first_call(piece.calls))

    def last(self) -> Piece:
        """What the stream still owes at its end: a required answer's calls (a named function's
        opening, if no argument came), or what vLLM's parser held back (an auto call's arguments,
        text an engine-based parser buffered)."""
        flushed = Piece() if not self._thinks else self._read(
            self._parser.parse_delta("", [], self._request, self._prompt_ids, finished=True))
        if self._reads_json:
            if self._choice == "required":
                self._text += flushed.content or ""
                calls = tuple(ToolCallDelta(i, c["id"], c["function"]["name"], c["function"]["arguments"])
                              for i, c in enumerate(self._constrained_calls(self._text)))
            else:
                calls = self._json_delta(flushed.content or "", opening=True).calls
            return Piece(flushed.reasoning or None, None, calls)
        if not self._thinks:
            return Piece()
        calls, tools = flushed.calls, self._parser.tool_parser
        if not calls and self._last_calls and tools is not None:
            # vLLM's parser adds the arguments it held back to the last delta if that one carries
            # calls (it knows which is last; here the flush comes after it).
            rest = tools.get_remaining_unstreamed_args()
            if rest:
                calls = (ToolCallDelta(len(tools.prev_tool_call_arr) - 1, arguments=rest),)
        # An empty flush is no chunk of its own.
        return Piece(flushed.reasoning or None, flushed.content or None, self._first_call(calls))

    @property
    def _one_call(self) -> bool:
        """parallel_tool_calls false: vLLM's server keeps the first call the parser reads, and only it."""
        return self._use is not None and not self._use.parallel

    def _first_call(self, calls: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
        return tuple(c for c in calls if c.index == 0) if self._one_call else calls

    def _constrained_calls(self, text: str) -> tuple[dict[str, Any], ...]:
        """A constrained answer's calls: the named function's with `text` as its arguments, or the
        required list's."""
        if self._choice == "function":
            return (self._call(self._use.function, text),)  # type: ignore[union-attr]
        return tuple(self._call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in _json_calls(text))

    def _json_delta(self, text: str, opening: bool = False) -> Piece:
        """A constrained answer's `text` in a stream: a named function's arguments as they come (its
        id and name with the first; without a reasoning parser at once, even before any argument,
        else with the first argument or `opening`), a required list's kept for its end."""
        if self._choice == "required":
            self._text += text
            return Piece()
        first = self._named_id is None
        if not text and not (first and (opening or not self._thinks)):
            return Piece()
        if first:
            self._named_id = self._new_id(self._use.function)  # type: ignore[union-attr]
        return Piece(calls=(ToolCallDelta(0, self._named_id if first else None,
                                          self._use.function if first else None, text),))  # type: ignore[union-attr]

    def _read(self, message: Any) -> Piece:
        if message is None:
            return Piece()
        calls = tuple(ToolCallDelta(c.index, c.id, c.function.name if c.function else None,
                                    c.function.arguments if c.function else None) for c in message.tool_calls)
        self._made_calls = self._made_calls or bool(calls)
        return Piece(message.reasoning, message.content, calls)

    def thinking_ended(self) -> bool:
        """Whether the thinking ended before the answer's first token (vLLM's `reasoning_ended`:
        the prompt closed it, or the request leaves reasoning out), so a grammar applies from it."""
        return not self._request.include_reasoning or self._parser.is_reasoning_end(self._prompt_ids)

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of the answer's tokens are reasoning (vLLM's count; 0 without a reasoning parser)."""
        return self._parser.count_reasoning_tokens(list(token_ids)) if self._thinks else 0

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's, once the answer was read: "tool_calls" where "auto" called a tool or
        "required" stopped (a named function's call stops as "stop", as OpenAI's and vLLM's do)."""
        if reason == "stop" and (self._choice == "required" or (self._made_calls and self._choice == "auto")):
            return "tool_calls"
        return reason

    def _call(self, name: str | None, arguments: str) -> dict[str, Any]:
        return {"id": self._new_id(name), "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_calls(text: str) -> list[dict[str, Any]]:
    """A required answer: the JSON list of {"name", "parameters"} its grammar allowed (a cut-off
    one, at max_tokens, reads as no calls)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    return [c for c in calls if isinstance(c, dict) and "name" in c and "parameters" in c] \
        if isinstance(calls, list) else []


# ------------------------------------------------------------------ vLLM's side
class Reading(NamedTuple):
    """How a chat's answers are constrained and read."""

    # The tools' structured output, SamplingParams' fields (it replaces the request's own), or None.
    grammar: dict[str, Any] | None
    # A grammar holds the answer once a reasoning parser's thinking ends (vLLM's reasoning_ended).
    structured: bool
    # The parsers need special tokens left in the text.
    keep_special: bool
    readers: list[AnswerReader]


class AnswerReading:
    """A gateway's machinery for reading chat answers: vLLM's schema derivation for tools, and its
    parsers as `vllm serve` composes them: the tool-call parser `parser` (tool_choice "auto") and
    the reasoning parser `reasoning_parser` (every chat answer)."""

    def __init__(self, model: str | None = None, parser: str | None = None, engine: str | None = None,
                 reasoning_parser: str | None = None, engines_reason: bool = False,
                 tool_strict_level: str = "auto", trust_remote_code: bool = False,
                 model_config: ParserModelConfig | None = None) -> None:
        """`model`: where the served model's tokenizer is (a parser reads its vocabulary);
        `model_config`: the served model's config as the instances read it (`parser_model_config`;
        None: read from `model` when a parser needs it);
        `engine`: the cluster's engine when known ("sim" models no tools); `engines_reason`: the
        instances were started with the reasoning parser too, so they apply a structured output's
        grammar only once the thinking ends (as `vllm serve`'s engine); `tool_strict_level`:
        vLLM's floor for the calls its parsers constrain (one of TOOL_STRICT_LEVELS);
        `trust_remote_code`: the parsers' tokenizer runs the model's own tokenizer code (vLLM's flag)."""
        if (parser is not None or reasoning_parser is not None) and model is None:
            raise ValueError("a parser needs the model's tokenizer: give the model too")
        if tool_strict_level not in TOOL_STRICT_LEVELS:
            raise ValueError(f"tool_strict_level must be one of {', '.join(TOOL_STRICT_LEVELS)}, "
                             f"got {tool_strict_level!r}")
        self.model = model
        self.parser = parser
        self.tool_strict_level = tool_strict_level
        self.trust_remote_code = trust_remote_code
        self.model_config = model_config
        self.reasoning_parser = reasoning_parser
        self.engines_reason = engines_reason
        self.engine = engine
        self._vllm: _Vllm | None = None
        self._loading: asyncio.Lock | None = None

    @property
    def parses(self) -> bool:
        """Whether one of vLLM's parsers reads every chat answer, as `vllm serve` with it."""
        return self.parser is not None or self.reasoning_parser is not None

    def reads(self, use: ToolUse | None) -> bool:
        """Whether a chat with these tools has its answers read (calls, or reasoning)."""
        return self.parses or (use is not None and use.reads_calls)

    async def readers(self, use: ToolUse | None, count: int, prompt_ids: Sequence[int],
                      template_kwargs: Mapping[str, Any], include_reasoning: bool = True,
                      own: Mapping[str, Any] | None = None, own_field: str | None = None,
                      messages: Sequence[Mapping[str, Any]] = ()) -> Reading:
        """How a chat's answers are constrained and read; 400 when the request cannot be served here.
        `messages`: the conversation (Kimi's call ids count the calls in it);
        `template_kwargs`: what the prompt was rendered with (a parser reads whether thinking is on);
        `own`: the request's own structured output as SamplingParams' fields, from the body's field
        `own_field` (vLLM's parsers may widen it to "calls or the format")."""
        calls = use is not None and use.reads_calls
        if calls and self.engine == "sim":
            raise InvalidRequest("the sim engine does not model tools (its tokens are random draws)",
                                 param="tools", code="unsupported_parameter")
        if calls and use.choice == "auto" and self.parser is None:  # type: ignore[union-attr]
            raise InvalidRequest('tool_choice "auto" needs the gateway started with --tool-call-parser NAME '
                                 '(vLLM\'s parser for the model\'s tool-call syntax); "required" and a named '
                                 "function need none", param="tool_choice", code="unsupported_parameter")
        vllm = await self._load()
        # In a thread: vLLM's parsers may compile a request's format with xgrammar, seconds for some.
        return await asyncio.to_thread(self._reading, vllm, use, count, prompt_ids, template_kwargs,
                                       include_reasoning, own or {}, own_field, messages)

    def _reading(self, vllm: _Vllm, use: ToolUse | None, count: int, prompt_ids: Sequence[int],
                 template_kwargs: Mapping[str, Any], include_reasoning: bool, own: Mapping[str, Any],
                 own_field: str | None, messages: Sequence[Mapping[str, Any]]) -> Reading:
        request = vllm.request(use, include_reasoning, template_kwargs, own, messages)
        reads_json = use is not None and use.constrained and vllm.reads_json
        grammar, keep_special, parsers = None, False, [None] * count
        if reads_json:  # the calls are read here; a parser reads only the thinking before them
            grammar = {"json_schema": vllm.for_tools(lambda: vllm.schema(request))}
            request = request.model_copy(update={"tool_choice": "none"})
        if not reads_json or self.reasoning_parser is not None:
            try:
                parsers = [vllm.parser(request, template_kwargs) for _ in range(count)]
            except (TypeError, ValueError) as exc:  # a parser that reads the template's switches (enable_thinking)
                raise InvalidRequest(f"vLLM's parser cannot read the template's switches (chat_template_kwargs, "
                                     f"reasoning_effort): {exc}", param="chat_template_kwargs",
                                     code="invalid_value") from None
            # (A format vLLM cannot fold into the tools' tag is left as it is, as vLLM leaves it.)
            adjusted = vllm.for_tools(lambda: parsers[0].adjust_request(request.model_copy())) if vllm.adjusts(use) \
                else request
            keep_special = not adjusted.skip_special_tokens
            if not reads_json:  # vLLM's parser constrains the calls in the model's syntax, and reads the adjusted request
                grammar, request = vllm.grammar(adjusted, request), adjusted
        structured = self.reasoning_parser is not None and (grammar is not None or bool(own))
        if structured and not self.engines_reason:
            raise InvalidRequest("structured outputs with a reasoning parser need the instances started with it (its "
                                 "grammar then applies once the thinking ends), as this gateway starts them; the "
                                 "cluster at --scheduler may not be",
                                 param="tool_choice" if use is not None and use.constrained
                                 else "tools" if grammar is not None else own_field,
                                 code="unsupported_parameter")
        return Reading(grammar, structured, keep_special, [
            AnswerReader(use, p, request, vllm.call_ids(request), prompt_ids, self.parser is not None, structured,
                         reads_json)
            for p in parsers])

    async def _load(self) -> _Vllm:
        if self._vllm is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._vllm is None:
                    try:
                        self._vllm = await asyncio.to_thread(_Vllm, self.model, self.parser, self.reasoning_parser,
                                                             self.tool_strict_level, self.trust_remote_code,
                                                             self.model_config)
                    except ImportError as exc:
                        raise InvalidRequest(f"tools and reasoning need vLLM installed where the gateway runs: {exc}",
                                             param="tools", code="unsupported_parameter") from None
        return self._vllm


class _Vllm:
    """vLLM's pieces, imported once."""

    def __init__(self, model: str | None, parser: str | None, reasoning_parser: str | None,
                 tool_strict_level: str, trust_remote_code: bool,
                 model_config: ParserModelConfig | None = None) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError
        from vllm.parser.utils import count_history_tool_calls
        from vllm.renderers.chat_utils import get_tool_call_id_type, make_tool_call_id
        from vllm.tool_parsers.utils import get_json_schema_from_tools
        from vllm.utils.mistral import is_mistral_tokenizer, is_mistral_tool_parser

        from llumdask.engine.vllm.engine import structured_outputs

        self._request_type = ChatCompletionRequest
        self._refusals = (ValueError, VLLMValidationError)
        self._structured_outputs = structured_outputs
        self._derive = get_json_schema_from_tools
        self._new_id = make_tool_call_id
        self._history_calls = count_history_tool_calls
        self._tokenizer = None
        self._parser_type = None  # vLLM's parser class composed of both, as `vllm serve` composes it
        self._model_config = None
        if parser is not None or reasoning_parser is not None:
            from vllm.tokenizers import get_tokenizer

            self._tokenizer = get_tokenizer(model, trust_remote_code=trust_remote_code)
            self._parser_type = parser_class(parser, reasoning_parser, self._tokenizer, model, tool_strict_level)
            self._model_config = model_config or parser_model_config(model, {"trust-remote-code": trust_remote_code})
        tool_parser = getattr(self._parser_type, "tool_parser_cls", None)
        # Whether "required" and named calls come as vLLM's JSON (read here): not where the tool-call
        # parser reads them in the model's syntax (vLLM's supports_required_and_named), nor where
        # the composed parser is Cohere Command's, which folds every tool choice into its own tag
        # and reads the calls of each with melody.
        self.reads_json = not _reads_every_choice(self._parser_type) and (
            tool_parser is None or tool_parser.supports_required_and_named)
        # Whether vLLM's server has the parser adjust a request with tool_choice "none" (or no tools)
        # too, as its renderer decides: with a reasoning parser, a parser that asks to, or Mistral's
        # grammar-capable tokenizer; otherwise such a request reaches the engine as it came.
        self._adjusts_none = self._parser_type is not None and (
            self._parser_type.always_adjust_request or self._parser_type.reasoning_parser_cls is not None
            or (is_mistral_tool_parser(tool_parser) and is_mistral_tokenizer(self._tokenizer)
                and self._tokenizer.supports_grammar))
        # The form of the ids vLLM's tool-call parser gives the calls it reads from JSON.
        self._id_type = "random" if tool_parser is None else get_tool_call_id_type(self._model_config)

    def adjusts(self, use: ToolUse | None) -> bool:
        """Whether vLLM's server has the parser adjust this chat, as its renderer decides: a tool
        choice other than "none", or a parser that adjusts every chat."""
        return (use is not None and use.reads_calls) or self._adjusts_none

    def call_ids(self, request: Any) -> Callable[[str | None], str]:
        """Ids for one answer's calls as vLLM's tool-call parser makes them for the JSON it reads:
        Kimi's models number them `functions.NAME:INDEX` after the calls earlier in the conversation,
        others get random ones, as does a call a parser read without an id (`name` None), as vLLM's
        server gives it."""
        if self._id_type == "random":
            return lambda name: self._new_id()
        index = itertools.count(self._history_calls(request))
        return lambda name: self._new_id() if name is None else self._new_id(self._id_type, name, next(index))

    def request(self, use: ToolUse | None, include_reasoning: bool, template_kwargs: Mapping[str, Any],
                own: Mapping[str, Any], messages: Sequence[Mapping[str, Any]] = ()) -> Any:
        """vLLM's request as its parsers read it (some read the template kwargs from it, Kimi's the
        calls in the conversation), with the request's own structured output; the messages and the
        output set past vLLM's request checks: the gateway has checked both, a named function's
        schema replaces the output (vLLM's server refuses the two together), and the engine reads a
        structural tag's content (refusing one it cannot read)."""
        tools: dict[str, Any] = {"tool_choice": "none"} if use is None else {
            "tools": list(use.tools), "tool_choice": use.choice_param(), "parallel_tool_calls": use.parallel}
        request = self._request_type(messages=[], include_reasoning=include_reasoning,
                                     chat_template_kwargs=dict(template_kwargs) or None, **tools)
        # As the instances' engine adapter hands it to vLLM.
        checked = {"structured_outputs": self._structured_outputs(SamplingParams(**own))} if own else {}
        return request.model_copy(update={"messages": list(messages), **checked})

    @staticmethod
    def grammar(adjusted: Any, request: Any) -> dict[str, Any] | None:
        """The structured output vLLM's parser set in `adjusted` for the tools, as SamplingParams'
        fields; None where it left `request`'s own (or none)."""
        chosen = adjusted.structured_outputs
        if chosen is None or chosen is request.structured_outputs:
            return None
        fields = {ours: getattr(chosen, theirs) for ours, theirs in _OUR_FIELDS.items()}
        if isinstance(fields["json_schema"], dict):
            fields["json_schema"] = json.dumps(fields["json_schema"])
        return {k: tuple(v) if k == "choice" else v for k, v in fields.items() if v not in (None, False)}

    def for_tools(self, derive: Any) -> Any:
        """`derive()`, vLLM's grammar for a request's tools; a 400 naming the field vLLM names where
        it refuses them (two tools defining one $defs entry differently), else the tools."""
        try:
            return derive()
        except self._refusals as exc:
            param = getattr(exc, "parameter", None) or "tools"
            raise InvalidRequest(f"{param}: {exc}", param=param, code="invalid_value") from None

    def schema(self, request: Any) -> str:
        return json.dumps(self._derive(request.tool_choice, request.tools, request.parallel_tool_calls))

    def parser(self, request: Any, template_kwargs: Mapping[str, Any]) -> Any:
        assert self._parser_type is not None, "a reader needs one of vLLM's parsers"
        return self._parser_type(self._tokenizer, request.tools, chat_template_kwargs=dict(template_kwargs),
                                 model_config=self._model_config)


def _reads_every_choice(parser_type: Any) -> bool:
    """Whether vLLM's composed parser is Cohere Command's with its tool-call parser (ParserManager
    imports its module where it composes one): its adjust_request folds the tools into its own
    structural tag whatever the tool choice, and its parse reads the calls with melody whatever the
    choice but "none". (With Cohere's reasoning parser alone melody reads no calls: "required" and
    named calls go as vLLM's JSON, read here.)"""
    module = sys.modules.get("vllm.parser.cohere_command")
    return (module is not None and parser_type is not None and issubclass(parser_type, module.CohereCommandParser)
            and parser_type.tool_parser_cls is not None)


# SamplingParams' structured-output fields and vLLM's StructuredOutputsParams' names for them.
_OUR_FIELDS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "structural_tag": "structural_tag"}


def parser_class(tool_parser: str | None, reasoning_parser: str | None, tokenizer: Any = None,
                 model: str | None = None, tool_strict_level: str = "auto") -> Any:
    """vLLM's parser composed of the named tool-call and reasoning parsers (None: neither), checked
    against `tokenizer` when given, as `vllm serve` checks them at start; ValueError naming the
    known ones for an unknown name, or saying what the tokenizer lacks."""
    from vllm.parser import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for name, kind, manager in ((tool_parser, "tool-call", ToolParserManager),
                                (reasoning_parser, "reasoning", ReasoningParserManager)):
        if name is not None and name not in manager.list_registered():
            raise ValueError(f"vLLM has no {kind} parser {name!r}; it has: {', '.join(manager.list_registered())}")
    try:
        return ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                                        enable_auto_tools=tool_parser is not None, model_name=model,
                                        tool_strict_level=tool_strict_level, tokenizer=tokenizer)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
