"""Tool calling in chat completions: the tools a request offers, and the model's answer read as calls.

The model's chat template renders the tools. The answer is read as tool calls the way vLLM's
server reads it on its JSON path:
- tool_choice "required" or a named function constrains the output, through structured outputs,
  to the JSON schema vLLM derives from the tools (a list of {"name", "parameters"}, or the named
  function's arguments); the gateway turns that JSON into calls. No parser is needed.
- "auto" lets the model answer freely; one of vLLM's tool-call parsers, named by the operator
  (``--tool-call-parser``, as for ``vllm serve``), finds the calls in the model's own syntax,
  whole or as streaming deltas.
- "none" renders the tools and reads nothing.
vLLM's protocol, parsers and the tokenizer they take are imported in a thread on the first request
with tools (about ten seconds), so a gateway that never sees tools never pays for them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llumdask.api.gateway.errors import InvalidRequest
from llumdask.api.gateway.json_schema import check_schema

TOOL_CHOICES = ("none", "auto", "required")
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
    if isinstance(choice, str):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                             param="tool_choice", code="invalid_value")
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):  # type: ignore[union-attr]
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
    out = {"name": name, **({"description": description} if description is not None else {}),
           **({"parameters": dict(parameters)} if parameters is not None else {})}
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
        except ValueError:
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
    """A whole answer read: its text content (None when it is only calls) and its calls."""

    content: str | None
    calls: tuple[dict[str, Any], ...]


class ToolReader:
    """Reads one choice's answer as tool calls (one per choice: streaming parsers keep state)."""

    def __init__(self, use: ToolUse, parser: Any, request: Any, new_id: Any) -> None:
        self._use = use
        self._parser = parser
        self._request = request
        self._new_id = new_id
        self._text = ""
        self._token_ids: list[int] = []
        self._named_id: str | None = None
        self._made_calls = False

    def whole(self, text: str) -> Answer:
        if self._use.choice == "function":
            return Answer(None, (self._call(self._use.function, text),))
        if self._use.choice == "required":
            return Answer(None, tuple(self._call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                                      for c in _json_calls(text)))
        info = self._parser.extract_tool_calls(text, self._request)
        if not info.tools_called:
            return Answer(text, ())
        self._made_calls = True
        calls = tuple({"id": c.id or self._new_id(), "type": "function",
                       "function": {"name": c.function.name, "arguments": c.function.arguments}}
                      for c in info.tool_calls)
        return Answer(info.content or None, calls)

    def delta(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, list[ToolCallDelta]]:
        """(content, call deltas) that `text` (made of `token_ids`) adds to the stream."""
        previous, previous_ids = self._text, list(self._token_ids)
        self._text += text
        self._token_ids.extend(token_ids)
        if self._use.choice == "function":  # the arguments, as they come
            first = self._named_id is None
            if first:
                self._named_id = self._new_id()
            if not text and not first:
                return None, []
            return None, [ToolCallDelta(0, self._named_id if first else None, self._use.function if first else None,
                                        text)]
        if self._use.choice == "required":  # whole calls, once the list is complete: at the end
            return None, []
        message = self._parser.extract_tool_calls_streaming(previous, self._text, text, previous_ids,
                                                           list(self._token_ids), list(token_ids), self._request)
        if message is None:
            return None, []
        self._made_calls = self._made_calls or bool(message.tool_calls)
        return message.content, [ToolCallDelta(c.index, c.id, c.function.name if c.function else None,
                                               c.function.arguments if c.function else None)
                                 for c in message.tool_calls]

    def last(self) -> list[ToolCallDelta]:
        """What the stream still owes at its end: a required answer's calls, or an auto call's
        arguments the parser held back."""
        if self._use.choice == "required":
            return [ToolCallDelta(i, c["id"], c["function"]["name"], c["function"]["arguments"])
                    for i, c in enumerate(self.whole(self._text).calls)]
        if self._use.choice == "auto" and self._parser.prev_tool_call_arr:
            rest = self._parser.get_remaining_unstreamed_args()
            if rest:
                return [ToolCallDelta(len(self._parser.prev_tool_call_arr) - 1, arguments=rest)]
        return []

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's, once the answer was read: "tool_calls" where "auto" called a tool or
        "required" stopped (a named function's call stops as "stop", as OpenAI's does)."""
        if reason == "stop" and (self._use.choice == "required" or self._made_calls):
            return "tool_calls"
        return reason

    def _call(self, name: str | None, arguments: str) -> dict[str, Any]:
        return {"id": self._new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


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
class ToolCalling:
    """A gateway's tool machinery: vLLM's schema derivation and, for "auto", its parser `parser`."""

    def __init__(self, model: str | None = None, parser: str | None = None, engine: str | None = None) -> None:
        """`model`: where the served model's tokenizer is (a parser reads its vocabulary);
        `engine`: the cluster's engine when known ("sim" models no tools)."""
        if parser is not None and model is None:
            raise ValueError("a tool-call parser needs the model's tokenizer: give the model too")
        self.model = model
        self.parser = parser
        self.engine = engine
        self._vllm: _Vllm | None = None
        self._loading: asyncio.Lock | None = None

    async def readers(self, use: ToolUse, count: int) -> tuple[str | None, bool, list[ToolReader]]:
        """(the JSON schema to constrain the output to, or None; whether special tokens must stay
        in the text for the parser; a reader per choice). 400 when tools cannot be served here."""
        if self.engine == "sim":
            raise InvalidRequest("the sim engine does not model tools (its tokens are random draws)",
                                 param="tools", code="unsupported_parameter")
        if use.choice == "auto" and self.parser is None:
            raise InvalidRequest('tool_choice "auto" needs the gateway started with --tool-call-parser NAME '
                                 '(vLLM\'s parser for the model\'s tool-call syntax); "required" and a named '
                                 "function need none", param="tool_choice", code="unsupported_parameter")
        vllm = await self._load()
        request = vllm.request(use)
        schema = vllm.schema(request) if use.constrained else None
        keep_special = False
        parsers: list[Any] = [None] * count
        if use.choice == "auto":
            parsers = [vllm.parser(request) for _ in range(count)]
            keep_special = not parsers[0].adjust_request(request).skip_special_tokens
        return schema, keep_special, [ToolReader(use, p, request, vllm.new_id) for p in parsers]

    async def _load(self) -> _Vllm:
        if self._vllm is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._vllm is None:
                    try:
                        self._vllm = await asyncio.to_thread(_Vllm, self.model, self.parser)
                    except ImportError as exc:
                        raise InvalidRequest(f"tools need vLLM installed where the gateway runs: {exc}",
                                             param="tools", code="unsupported_parameter") from None
        return self._vllm


class _Vllm:
    """vLLM's pieces, imported once."""

    def __init__(self, model: str | None, parser: str | None) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.renderers.chat_utils import make_tool_call_id
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        self._request_type = ChatCompletionRequest
        self._derive = get_json_schema_from_tools
        self.new_id = make_tool_call_id
        self._parser_type = None
        self._tokenizer = None
        if parser is not None:
            self._parser_type = tool_parser_class(parser)
            from vllm.tokenizers import get_tokenizer

            self._tokenizer = get_tokenizer(model)

    def request(self, use: ToolUse) -> Any:
        return self._request_type(messages=[], tools=list(use.tools), tool_choice=use.choice_param(),
                                  parallel_tool_calls=use.parallel)

    def schema(self, request: Any) -> str:
        return json.dumps(self._derive(request.tool_choice, request.tools, request.parallel_tool_calls))

    def parser(self, request: Any) -> Any:
        assert self._parser_type is not None
        return self._parser_type(self._tokenizer, request.tools)


def tool_parser_class(name: str) -> Any:
    """vLLM's tool-call parser registered as `name`; ValueError naming the known ones."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(ToolParserManager.list_registered())
        raise ValueError(f"vLLM has no tool-call parser {name!r}; it has: {known}") from None
