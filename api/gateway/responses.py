"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

The two endpoints differ only in shape (``text`` versus a ``message`` / ``delta``), so each
shape is a small class and the serving logic in routes.py is written once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from llumdask.api.gateway.logprobs import chat_logprobs, completion_logprobs
from llumdask.api.gateway.tokenizer import Tokenizer
from llumdask.engine.base import TokenLogprob


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Of the prompt tokens, those found in the engine's prefix cache (None: the engine does not say).
    cached_tokens: int | None = None
    # Of the completion tokens, those a reasoning parser counts as reasoning (None: no parser).
    reasoning_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


class Choice(NamedTuple):
    """One choice of a whole response."""

    # None: a chat answer that is only tool calls.
    text: str | None
    finish_reason: str | None
    logprobs: dict | None = None
    # OpenAI's message.tool_calls (chat only).
    tool_calls: Sequence[dict[str, Any]] = ()
    # Its output tokens (shown with vLLM's return_token_ids).
    token_ids: Sequence[int] = ()
    # vLLM's stop_reason: the stop string or stop token that ended it (`Generation.stop_reason`).
    stop_reason: int | str | None = None
    # vLLM's message.reasoning (chat with a reasoning parser): what the model thought before answering.
    reasoning: str | None = None


@dataclass(frozen=True)
class ResponseFormat(ABC):
    """Fields shared by every body and chunk of one response."""

    id: str
    created: int
    model: str
    # vLLM's return_token_ids: the prompt's tokens (once per choice in a stream, as vLLM places
    # them) and each choice's, or chunk's, output tokens. None: not asked for.
    prompt_token_ids: Sequence[int] | None = None
    # vLLM's return_tokens_as_token_ids: log probabilities name tokens "token_id:ID".
    as_token_ids: bool = False
    # vLLM's return_prompt_text (chat): the prompt as the template rendered it, after its ids.
    prompt_text: str | None = None
    # Chat messages carry vLLM's `reasoning` (null where there was none): the gateway reads it.
    shows_reasoning: bool = False
    # With return_token_ids, the output's ids are null (vLLM's, for reasoning left out: they would tell it).
    hides_output_ids: bool = False

    object = ""
    chunk_object = ""
    # Where vLLM puts the prompt's tokens and log probabilities: in each choice (completions) or
    # the response (chat).
    prompt_tokens_per_choice = True

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def body(self, choices: Sequence[Choice], usage: Usage,
             prompt_logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """The whole response, its choices in index order; vLLM's `prompt_logprobs` where computed,
        placed as the prompt's ids are."""
        body = self._envelope(self.object, [self._choice(i, choice) for i, choice in enumerate(choices)])
        if self.prompt_token_ids is not None:
            for shown, choice in zip(body["choices"], choices):
                shown["token_ids"] = None if self.hides_output_ids else list(choice.token_ids)
        # In vLLM's order: after each choice's own fields, or after the usage.
        if self.prompt_tokens_per_choice:
            for shown in body["choices"]:
                self._prompt_fields(shown, prompt_logprobs)
            body["usage"] = usage.to_dict()
        else:
            body["usage"] = usage.to_dict()
            self._prompt_fields(body, prompt_logprobs)
        return body

    def _prompt_fields(self, shown: dict[str, Any], prompt_logprobs: list[dict[str, Any] | None] | None) -> None:
        """The prompt's fields asked for, in vLLM's order."""
        if prompt_logprobs is not None:
            shown["prompt_logprobs"] = prompt_logprobs
        if self.prompt_token_ids is not None:
            shown["prompt_token_ids"] = self.prompt_token_ids
        if self.prompt_text is not None:
            shown["prompt_text"] = self.prompt_text

    def opening_chunks(self, index: int) -> list[dict[str, Any]]:
        """Chunks sent before choice `index`'s first token (chat announces the role)."""
        return []

    def text_chunk(self, index: int, text: str | None, logprobs: dict | None = None, token_ids: Sequence[int] = (),
                   first: bool = False, reasoning: str | None = None) -> dict[str, Any]:
        """`text` (None: an empty delta); `token_ids`: the chunk's tokens; `first`: the choice's
        first chunk after its opening; `reasoning`: a chat delta's reasoning."""
        return self._with_ids(self._envelope(self.chunk_object, [self._delta(index, text, None, logprobs, reasoning)]),
                              token_ids, first)

    def final_chunk(self, index: int, finish_reason: str | None, first: bool = False,
                    stop_reason: int | str | None = None) -> dict[str, Any]:
        """The chunk that ends choice `index`, with vLLM's stop_reason (which only it carries in chat)."""
        choice = self._delta(index, None, finish_reason, None)
        choice["stop_reason"] = stop_reason
        return self._with_ids(self._envelope(self.chunk_object, [choice]), (), first)

    def _with_ids(self, chunk: dict[str, Any], token_ids: Sequence[int], first: bool) -> dict[str, Any]:
        """A chunk with its tokens, and the prompt's on a completion choice's first (return_token_ids)."""
        if self.prompt_token_ids is not None:
            choice = chunk["choices"][0]
            choice["token_ids"] = None if self.hides_output_ids else list(token_ids)
            if first and self.prompt_tokens_per_choice:
                choice["prompt_token_ids"] = self.prompt_token_ids
        return chunk

    @abstractmethod
    def logprobs(self, tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                 text_offset: int) -> dict[str, Any]:
        """This shape's log probabilities of `token_ids`, the first at `text_offset` in the text."""

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """stream_options.include_usage: one last chunk with no choices and the usage."""
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage.to_dict()
        return chunk

    @abstractmethod
    def _choice(self, index: int, choice: Choice) -> dict[str, Any]: ...

    @abstractmethod
    def _delta(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
               reasoning: str | None = None) -> dict[str, Any]: ...


class CompletionFormat(ResponseFormat):
    object = "text_completion"
    chunk_object = "text_completion"

    def logprobs(self, tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                 text_offset: int) -> dict[str, Any]:
        return completion_logprobs(tokenizer, token_ids, entries, text_offset, self.as_token_ids)

    def _choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return {"index": index, "text": choice.text or "", "logprobs": choice.logprobs,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def _delta(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
               reasoning: str | None = None) -> dict[str, Any]:
        return self._choice(index, Choice(text, finish_reason, logprobs))


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_tokens_per_choice = False

    def logprobs(self, tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                 text_offset: int) -> dict[str, Any]:
        return chat_logprobs(tokenizer, token_ids, entries, self.as_token_ids)

    def _choice(self, index: int, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if self.shows_reasoning or choice.reasoning is not None:  # a tool-call parser may read reasoning too (Cohere's)
            message["reasoning"] = choice.reasoning
        if choice.tool_calls:
            message["tool_calls"] = list(choice.tool_calls)
        return {"index": index, "message": message, "logprobs": choice.logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}

    def tool_chunk(self, index: int, text: str | None, calls: Sequence[dict[str, Any]],
                   logprobs: dict | None = None, token_ids: Sequence[int] = (), reasoning: str | None = None,
                   ) -> dict[str, Any]:
        """A chunk with tool call deltas (OpenAI's delta.tool_calls), and text (and reasoning) where
        the model wrote some."""
        chunk = self._with_ids(self._envelope(self.chunk_object, [self._delta(index, text, None, logprobs, reasoning)]),
                               token_ids, False)
        chunk["choices"][0]["delta"]["tool_calls"] = list(calls)
        return chunk

    def _delta(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
               reasoning: str | None = None) -> dict[str, Any]:
        delta = {} if reasoning is None else {"reasoning": reasoning}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening_chunks(self, index: int) -> list[dict[str, Any]]:
        chunk = self._envelope(self.chunk_object, [self._delta(index, "", None, None)])
        chunk["choices"][0]["delta"]["role"] = "assistant"
        self._prompt_fields(chunk, None)  # vLLM's first chunk of each choice carries the prompt's ids and text
        return [chunk]
