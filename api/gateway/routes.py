"""The HTTP routes: OpenAI's completions, chat completions and models, plus /health and /metrics.

Order of checks for a generation request, cheapest and most specific first: body size (413),
JSON and field types (400), model (404), prompt tokens and context length (400), admission
(429), dispatch (503 when no instance is ready). Only then does a response start, so every
refusal gets its own status; what fails after the first streamed byte arrives as an error event.
"""

from __future__ import annotations

import asyncio
import json
import re
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import llumdask
from llumdask.api.gateway.backend import Backend
from llumdask.api.gateway.beam_search import Beam, beam_search
from llumdask.api.gateway.disconnect import ClientDisconnected, until_disconnect
from llumdask.api.gateway.errors import APIError, InvalidRequest, ModelNotFound, RequestTooLarge, Unavailable, unexpected
from llumdask.api.gateway.fim import fill_in_the_middle
from llumdask.api.gateway.detok import IncrementalText
from llumdask.api.gateway.generation_config import GenerationDefaults
from llumdask.api.gateway.generation import Delta, Generation, InFlight, merged_deltas, total_usage
from llumdask.api.gateway.logprobs import prompt_logprobs, within_top
from llumdask.api.gateway.metrics import GatewayMetrics
from llumdask.api.gateway.openapi import openapi_document
from llumdask.api.gateway.rate_limits import ANONYMOUS, Charge, RateLimited, RateLimits
from llumdask.api.gateway.responses import ChatFormat, Choice, CompletionFormat, ResponseFormat, Usage
from llumdask.api.gateway.schemas import (
    MAX_SEED,
    ChatRendering,
    GenerationOptions,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_priority,
    parse_tokenize,
    with_model_defaults,
)
from llumdask.api.gateway.sse import DONE, EventStreamResponse, event
from llumdask.api.gateway.tokenizer import ChatTemplateError, Tokenizer, named_stop_token_ids, stop_token_ids
from llumdask.api.gateway.tools import AnswerReader, AnswerReading, Piece
from llumdask.config import GatewayConfig
from llumdask.engine.base import TokenLogprob
from llumdask.request import STRUCTURED_KINDS, Priority, SamplingParams, is_text, new_request_id

logger = logging.getLogger(__name__)

PRIORITY_HEADER = "x-llumdask-priority"
# Sent as the status of a request whose client left (nginx's convention); nobody reads it.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class Gateway:
    """Everything a route needs; one per app, made by the lifespan (routes get it as request.state.gateway)."""

    backend: Backend
    tokenizer: Tokenizer
    settings: GatewayConfig
    metrics: GatewayMetrics
    in_flight: InFlight
    rate_limits: RateLimits
    answers: AnswerReading
    # The model's generation config, as vLLM's server applies it (api/gateway/generation_config.py).
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


Handler = Callable[[Request, Gateway], Awaitable[Response]]


def endpoint(name: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: APIError -> its JSON error, anything else -> a logged 500; count both."""

    async def run(request: Request) -> Response:
        gateway: Gateway = request.state.gateway
        try:
            response = await handler(request, gateway)
        except APIError as exc:
            response = exc.response()
            gateway.metrics.error(exc.code)
        except ClientDisconnected:
            response = Response(status_code=CLIENT_CLOSED_REQUEST)
            gateway.metrics.error("client_disconnected")
        except Exception as exc:  # a bug; never show its trace to the client
            error = unexpected(exc, request)
            response = error.response()
            gateway.metrics.error(error.code)
        gateway.metrics.response(name, response.status_code)
        return response

    return run


# ------------------------------------------------------------------ generation endpoints
async def completions(request: Request, gateway: Gateway) -> Response:
    parsed = parse_completion(await read_json(request, gateway.settings.max_body_bytes))
    check_model(gateway.backend, parsed.options.model)
    special = parsed.add_special_tokens
    if parsed.suffix is not None:
        if parsed.options.truncate_prompt_tokens is not None:
            raise InvalidRequest("suffix cannot be used with truncate_prompt_tokens (as in vLLM)", param="suffix",
                                 code="invalid_value")
        prompt_ids = gateway.tokenizer.encode(fill_in_the_middle(gateway.tokenizer, parsed.prompt, parsed.suffix),
                                              add_special_tokens=special)
    elif isinstance(parsed.prompt, str):
        prompt_ids = gateway.tokenizer.encode(parsed.prompt, add_special_tokens=special)
    else:
        prompt_ids = list(parsed.prompt)
        check_token_ids(prompt_ids, gateway.tokenizer.vocab_size, "prompt")
    whole = len(prompt_ids)
    prompt_ids = truncated(prompt_ids, parsed.options, gateway.backend.model.max_context)
    request_id = new_request_id()
    fmt = CompletionFormat(f"cmpl-{request_id}", int(time.time()), gateway.backend.model.name,
                           *token_ids_shown(parsed.options, prompt_ids))
    echo = None
    if parsed.options.echo:
        # With the prompt's ids returned, vLLM echoes its log probabilities but not its text.
        echo = ("" if parsed.options.return_token_ids else
                parsed.prompt if isinstance(parsed.prompt, str) and len(prompt_ids) == whole
                else gateway.tokenizer.decode(prompt_ids))
    return await generate(request, gateway, "completions", fmt, request_id, prompt_ids, parsed.options, echo)


async def chat_completions(request: Request, gateway: Gateway) -> Response:
    parsed = parse_chat(await read_json(request, gateway.settings.max_body_bytes))
    check_model(gateway.backend, parsed.options.model)
    options, use, readers, answers = parsed.options, parsed.tools, None, gateway.answers
    text, prompt_ids = chat_prompt(gateway.tokenizer, parsed.messages, parsed.rendering,
                                   use.tools if use is not None else None)
    prompt_ids = truncated(prompt_ids, options, gateway.backend.model.max_context)
    if answers.reads(use):
        own = {k: v for k, v in options.sampling.items() if k in STRUCTURED_KINDS}
        reading = await answers.readers(use, options.best_of, prompt_ids, parsed.rendering.variables,
                                        parsed.include_reasoning, own, options.structured_field, parsed.messages)
        readers = reading.readers
        if reading.grammar is not None and options.use_beam_search:  # each step would start the grammar over
            raise InvalidRequest("beam search does not apply the grammar vLLM's tool-call parser puts on this "
                                 "request's calls (for a strict tool, parallel_tool_calls false, or the gateway's "
                                 "--tool-strict-level); leave use_beam_search out", param="tools",
                                 code="unsupported_parameter")
        if reading.grammar is not None:  # the tools' grammar replaces response_format, as in vLLM
            sampling = {k: v for k, v in options.sampling.items() if k not in STRUCTURED_KINDS}
            options = replace(options, sampling={**sampling, **reading.grammar})
        if reading.structured:  # vLLM's server tells its engine where the grammar starts, and the template's switches
            variables = parsed.rendering.variables
            options = replace(options, sampling={**options.sampling, "reasoning_ended": readers[0].thinking_ended(),
                                                 "reasoning_kwargs": json.dumps(dict(variables)) if variables else None})
        if reading.keep_special:
            options = replace(options, skip_special_tokens=False)
    # vLLM's: reasoning left out shows no log probabilities nor output ids (their tokens would tell it).
    hidden = answers.parses and not parsed.include_reasoning
    if hidden:
        options = replace(options, logprobs=None)
    request_id = new_request_id()
    fmt = ChatFormat(f"chatcmpl-{request_id}", int(time.time()), gateway.backend.model.name,
                     *token_ids_shown(options, prompt_ids), prompt_text=text if parsed.return_prompt_text else None,
                     shows_reasoning=answers.reasoning_parser is not None, hides_output_ids=hidden)
    return await generate(request, gateway, "chat_completions", fmt, request_id, prompt_ids, options,
                          readers=readers)


def truncated(prompt_ids: list[int], options: GenerationOptions, max_context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last (or, truncation_side "right", first) that
    many tokens; -1 keeps what leaves room for one generated token."""
    keep = options.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep > max_context:
        raise InvalidRequest(f"truncate_prompt_tokens={keep} cannot be greater than the model's context "
                             f"({max_context} tokens)", param="truncate_prompt_tokens", code="invalid_value")
    if keep < 0:
        keep = max_context - 1
    if keep >= len(prompt_ids):
        return prompt_ids
    return prompt_ids[len(prompt_ids) - keep:] if options.truncation_side == "left" else prompt_ids[:keep]


def token_ids_shown(options: GenerationOptions, prompt_ids: Sequence[int]) -> tuple[Sequence[int] | None, bool]:
    """A response format's `prompt_token_ids` and `as_token_ids`, as the request asks."""
    return (prompt_ids if options.return_token_ids else None), options.return_tokens_as_token_ids


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], rendering: ChatRendering,
                tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """A conversation's prompt, text and ids: rendered with the model's template as `rendering`
    asks; a template that cannot render it is the request's fault (400)."""
    try:
        text = tokenizer.render_chat(messages, rendering.add_generation_prompt, tools,
                                     continue_final_message=rendering.continue_final_message,
                                     variables=rendering.variables)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages", code="invalid_value") from None
    return text, tokenizer.encode(text, add_special_tokens=rendering.add_special_tokens)


async def generate(request: Request, gateway: Gateway, name: str, fmt: ResponseFormat, request_id: str,
                   prompt_ids: list[int], options: GenerationOptions, echo: str | None = None,
                   readers: Sequence[AnswerReader] | None = None) -> Response:
    """The response's id carries `request_id`, the cluster's name for the request (an operator
    migrates or inspects it by that name); with several choices, choice i > 0 is `request_id-i`.
    best_of > n generates best_of and returns the n with the highest log probability per token.
    `echo`: the prompt's text, to come first in every choice (and its tokens in the logprobs; ""
    with return_token_ids, which shows it as ids).
    `readers`: one per generation, reading its answer for tool calls and reasoning (chat)."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty after tokenization", param="prompt", code="invalid_value")
    options = with_model_defaults(options, gateway.generation)
    sampling = sampling_params(gateway, options, len(prompt_ids))
    if options.use_beam_search:
        return await generate_beams(request, gateway, fmt, request_id, prompt_ids, options, sampling.max_tokens, echo,
                                    readers)
    if options.best_of > options.n and sampling.logprobs is None:
        sampling = replace(sampling, logprobs=0)  # the ranking reads the tokens' own
    priority = request_priority(request, options)
    generations = [Generation(gateway.backend, gateway.metrics, name, request_id if i == 0 else f"{request_id}-{i}",
                              prompt_ids, choice_sampling(sampling, i), priority,
                              IncrementalText(gateway.tokenizer, options.stop,
                                              include_stop=options.include_stop_str_in_output,
                                              skip_special_tokens=options.skip_special_tokens,
                                              stop_token_ids=sampling.stop_token_ids, min_tokens=sampling.min_tokens),
                              gateway.settings.retry_after, options.cache_salt, options.repetition_detection,
                              named_stop_token_ids(gateway.tokenizer, options.stop_token_ids, options.ignore_eos,
                                                   gateway.generation.eos_token_ids))
                   for i in range(options.best_of)]
    gateway.in_flight.acquire(len(generations))
    try:
        charge = gateway.rate_limits.admit(getattr(request.state, "api_key", ANONYMOUS),
                                           len(prompt_ids) + sampling.max_tokens * len(generations))
    except RateLimited:
        gateway.in_flight.release(len(generations))
        raise
    try:
        # A client gone while its request waits for room (held at the scheduler) gives up its place.
        await until_disconnect(request.receive, Generation.start_all(generations))
        if options.stream:
            async def on_close(complete: bool) -> None:
                if not complete:
                    gateway.metrics.error("client_disconnected")
                await finish(gateway, generations, charge)

            events = stream_events(request, gateway, fmt, generations, prompt_ids, options, echo, readers)
            # Owns the generations and the slots from here.
            return EventStreamResponse(events, on_close, gateway.settings.write_timeout)

        async def texts() -> list[str]:
            return await asyncio.gather(*(g.text() for g in generations))

        choices = await until_disconnect(request.receive, texts())
    except BaseException:
        await finish(gateway, generations, charge)
        raise
    await finish(gateway, generations, charge)
    body = []
    for i in best(options.n, generations):
        g, text = generations[i], choices[i]
        logprobs = None
        if options.logprobs is not None:
            ids, entries = g.token_ids, g.logprobs(0, g.num_output_tokens)
            if echo is not None:
                prompt = [e if e is None else within_top(e, t, options.logprobs) for t, e in zip(prompt_ids, g.prompt_logprobs)]
                ids, entries = [*prompt_ids, *ids], [*prompt, *entries]
            logprobs = fmt.logprobs(gateway.tokenizer, ids, entries, 0)
        if readers is not None:
            answer = readers[i].whole(text, g.token_ids)
            body.append(Choice(answer.content, readers[i].finish_reason(g.finish_reason), logprobs, answer.calls,
                               g.token_ids, g.stop_reason, answer.reasoning))
        else:
            body.append(Choice(text if echo is None else echo + text, g.finish_reason, logprobs, (), g.token_ids,
                               g.stop_reason))
    scored = None
    if sampling.prompt_logprobs is not None:
        scored = prompt_logprobs(gateway.tokenizer, prompt_ids, generations[0].prompt_logprobs)
    return JSONResponse(fmt.body(body, usage(gateway, generations, readers), scored))


async def generate_beams(request: Request, gateway: Gateway, fmt: ResponseFormat, request_id: str,
                         prompt_ids: list[int], options: GenerationOptions, max_tokens: int, echo: str | None,
                         readers: Sequence[AnswerReader] | None) -> Response:
    """vLLM's beam search (api/gateway/beam_search.py) with n beams, each step's requests named
    `request_id`-beamSTEP-BEAM on the cluster (and counted as "beam_search" in the gateway's
    metrics); the response's choices are the n best, best first, streamed (chat) once known."""
    width, priority = options.n, request_priority(request, options)
    step_sampling = SamplingParams(max_tokens=1, temperature=options.temperature, logprobs=2 * width)
    produced = 0  # tokens the steps generated: what the key is charged for

    async def step(tokens: Sequence[int], index: int) -> tuple[int, TokenLogprob] | None:
        nonlocal produced
        g = Generation(gateway.backend, gateway.metrics, "beam_search", f"{request_id}-beam{len(tokens)}-{index}",
                       [*prompt_ids, *tokens], step_sampling, priority, IncrementalText(gateway.tokenizer, ()),
                       gateway.settings.retry_after, options.cache_salt)
        try:
            await Generation.start_all([g])  # cancelled while placed: the backend runs nothing of it
            await g.text()
        finally:
            await g.close()
        if not g.token_ids:
            if g.finish_reason == "abort":  # the engine gave up on it: vLLM ends the search
                return None
            raise Unavailable(f"a beam's step ended without a token ({g.finish_reason})")
        produced += 1
        return g.token_ids[0], g.logprobs(0, 1)[0]

    gateway.in_flight.acquire(width)
    try:
        charge = gateway.rate_limits.admit(getattr(request.state, "api_key", ANONYMOUS),
                                           len(prompt_ids) + max_tokens * width)
    except RateLimited:
        gateway.in_flight.release(width)
        raise
    try:
        beams = await until_disconnect(request.receive, beam_search(
            step, width=width, max_tokens=max_tokens, prompt_tokens=len(prompt_ids),
            eos_token_id=gateway.tokenizer.eos_token_id, ignore_eos=options.ignore_eos,
            length_penalty=options.length_penalty))
    finally:
        gateway.in_flight.release(width)
        gateway.rate_limits.refund(charge, charge.tokens - len(prompt_ids) - produced)
    choices = [beam_choice(gateway.tokenizer, fmt, beam, options, echo, readers[i] if readers else None)
               for i, beam in enumerate(beams)]
    usage = Usage(len(prompt_ids), sum(len(c.token_ids) for c in choices),
                  reasoning_tokens=reasoning_tokens(gateway, readers, [c.token_ids for c in choices]))
    if not options.stream:
        return JSONResponse(fmt.body(choices, usage))

    async def events() -> AsyncGenerator[bytes, None]:
        for i, choice in enumerate(choices):
            for chunk in (*fmt.opening_chunks(i), fmt.text_chunk(i, choice.text, choice.logprobs, choice.token_ids,
                                                                 first=True, reasoning=choice.reasoning),
                          fmt.final_chunk(i, choice.finish_reason, stop_reason=choice.stop_reason)):
                yield event(chunk)
        if options.include_usage:
            yield event(fmt.usage_chunk(usage))
        yield DONE

    async def on_close(complete: bool) -> None:
        if not complete:
            gateway.metrics.error("client_disconnected")

    return EventStreamResponse(events(), on_close, gateway.settings.write_timeout)


def beam_choice(tokenizer: Tokenizer, fmt: ResponseFormat, beam: Beam, options: GenerationOptions,
                echo: str | None, reader: AnswerReader | None) -> Choice:
    """One beam as a choice: an end of sequence ends its text, is its stop_reason, and is among its
    token ids (and log probabilities) only with include_stop_str_in_output, as in vLLM; read as
    tool calls where the request offered tools."""
    ended = beam.finish_reason == "stop"
    stop_reason = beam.tokens[-1] if ended else None
    said = beam.tokens[:-1] if ended else beam.tokens
    ids = beam.tokens if ended and options.include_stop_str_in_output else said
    text = tokenizer.decode(said, skip_special_tokens=options.skip_special_tokens)
    logprobs = None
    if options.logprobs is not None:
        entries = [e._replace(top=e.top[:options.logprobs]) for e in beam.entries[:len(ids)]]
        logprobs = fmt.logprobs(tokenizer, ids, entries, 0)
    if reader is not None:
        answer = reader.whole(text, said)
        return Choice(answer.content, reader.finish_reason(beam.finish_reason), logprobs, answer.calls, ids, stop_reason,
                      answer.reasoning)
    return Choice(text if echo is None else echo + text, beam.finish_reason, logprobs, (), ids, stop_reason)


def best(n: int, generations: Sequence[Generation]) -> list[int]:
    """The indices of the n generations with the highest mean log probability per token, best
    first (all of them, in order, when there are only n)."""
    if len(generations) == n:
        return list(range(n))

    def per_token(i: int) -> float:
        g = generations[i]
        return sum(e.logprob for e in g.logprobs(0, g.num_output_tokens)) / max(1, g.num_output_tokens)

    return sorted(range(len(generations)), key=per_token, reverse=True)[:n]


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: a seeded one gets seed + index, as vLLM seeds its n samples."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))


def usage(gateway: Gateway, generations: Sequence[Generation], readers: Sequence[AnswerReader] | None) -> Usage:
    """The response's usage: every choice's tokens, and of them the reasoning where the gateway
    reads it (vLLM's completion_tokens_details)."""
    return replace(total_usage(generations),
                   reasoning_tokens=reasoning_tokens(gateway, readers, [g.token_ids for g in generations]))


def reasoning_tokens(gateway: Gateway, readers: Sequence[AnswerReader] | None,
                     outputs: Sequence[Sequence[int]]) -> int | None:
    """Of the choices' output tokens, those a reasoning parser counts as reasoning; None without one."""
    if gateway.answers.reasoning_parser is None or not readers:
        return None
    return sum(r.reasoning_tokens(ids) for r, ids in zip(readers, outputs))


async def finish(gateway: Gateway, generations: Sequence[Generation], charge: Charge) -> None:
    """Abort every choice's request still running somewhere, free their admission slots, and give
    the key back the tokens they did not use. The aborts are tasks of their own: a cancelled
    caller (a client gone) still gets them all done."""
    closing = [asyncio.ensure_future(g.close()) for g in generations]
    try:
        await asyncio.shield(asyncio.gather(*closing))
    finally:
        gateway.in_flight.release(len(generations))
        used = total_usage(generations)
        gateway.rate_limits.refund(charge, charge.tokens - used.prompt_tokens - used.completion_tokens)


async def stream_events(request: Request, gateway: Gateway, fmt: ResponseFormat, generations: Sequence[Generation],
                        prompt_ids: Sequence[int], options: GenerationOptions, echo: str | None,
                        readers: Sequence[AnswerReader] | None) -> AsyncGenerator[bytes, None]:
    """Each choice's chunks: its opening, its echoed prompt (with the first tokens: the prompt's
    log probabilities come with them), a chunk per token batch with those tokens' log
    probabilities, its finish; then the usage if asked for. Read as tool calls (`readers`), a
    batch's chunk carries what the reader made of it: text, call deltas, or nothing yet (sent,
    with an empty delta, only to carry the batch's log probabilities or token ids)."""
    wanted = options.logprobs is not None
    sent = [0] * len(generations)  # each choice's next text offset
    shown: set[int] = set()  # the choices that sent a chunk past their opening

    def first(index: int) -> bool:
        if index in shown:
            return False
        shown.add(index)
        return True

    def chunk(index: int, text: str | None, token_ids: Sequence[int], entries: Sequence,
              shown_ids: Sequence[int], reasoning: str | None = None) -> bytes:
        """`token_ids` with their log probabilities; `shown_ids`, the output tokens it carries."""
        logprobs = fmt.logprobs(gateway.tokenizer, token_ids, entries, sent[index]) if wanted else None
        if logprobs and logprobs.get("tokens"):
            # vLLM's rule: on from the tokens just shown (text held back for a stop string lags them).
            sent[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        else:
            sent[index] += len(text or "")
        return event(fmt.text_chunk(index, text, logprobs, shown_ids, first(index), reasoning))

    def calls_chunk(index: int, piece: Piece, token_ids: Sequence[int] = (), entries: Sequence = (),
                    with_logprobs: bool = False) -> bytes:
        logprobs = fmt.logprobs(gateway.tokenizer, token_ids, entries, 0) if with_logprobs else None
        return event(fmt.tool_chunk(index, piece.content, [c.to_dict() for c in piece.calls], logprobs,  # type: ignore[attr-defined]
                                    token_ids, piece.reasoning))

    def events(index: int, delta: Delta | None) -> Iterator[bytes]:
        g = generations[index]
        if echo is not None and index not in shown:
            yield chunk(index, echo, prompt_ids, g.prompt_logprobs if wanted else (), ())
        if delta is None:
            finish_reason = g.finish_reason
            if readers is not None:
                last = readers[index].last()
                if last.calls:
                    yield calls_chunk(index, last)
                elif last:
                    yield chunk(index, last.content, (), (), (), last.reasoning)
                finish_reason = readers[index].finish_reason(finish_reason)
            yield event(fmt.final_chunk(index, finish_reason, first(index), g.stop_reason))
            return
        entries = g.logprobs(delta.start, delta.end) if wanted else ()
        token_ids = g.token_ids[delta.start:delta.end]
        if readers is None:
            yield chunk(index, delta.text, token_ids, entries, token_ids)
            return
        piece = readers[index].delta(delta.text, token_ids)
        if piece.calls:
            yield calls_chunk(index, piece, token_ids, entries, wanted)
        elif piece or wanted or (fmt.prompt_token_ids is not None and not fmt.hides_output_ids):
            # Nothing to show yet still carries its tokens' log probabilities and ids, as vLLM's.
            yield chunk(index, piece.content, token_ids, entries, token_ids, piece.reasoning)

    # What is ready together goes out in one write: a write per chunk costs the gateway a
    # system call and a pass through the ASGI stack per choice and token.
    opening = b"".join(event(c) for index in range(len(generations)) for c in fmt.opening_chunks(index))
    if opening:
        yield opening
    tail = b""
    try:
        async for ready in merged_deltas(generations):
            body = b"".join(c for index, delta in ready for c in events(index, delta))
            if body:
                yield body
        if options.include_usage:
            tail = event(fmt.usage_chunk(usage(gateway, generations, readers)))
    except APIError as exc:
        gateway.metrics.error(exc.code)
        tail = event(exc.body())
    except Exception as exc:  # a bug; the client gets a generic error event
        error = unexpected(exc, request)
        gateway.metrics.error(error.code)
        tail = event(error.body())
    yield tail + DONE


def sampling_params(gateway: Gateway, options: GenerationOptions, num_prompt_tokens: int) -> SamplingParams:
    model = gateway.generation
    requested = options.max_tokens
    if model.caps_max_tokens and requested is not None and model.max_tokens is not None:
        requested = min(requested, model.max_tokens)
    max_tokens = max_tokens_within_context(requested, num_prompt_tokens, gateway.backend.model.max_context,
                                           model.max_tokens)
    check_token_ids(options.stop_token_ids, gateway.tokenizer.vocab_size, "stop_token_ids")
    extra = options.sampling
    if extra.get("min_tokens", 0) > max_tokens:
        raise InvalidRequest(f"min_tokens ({extra['min_tokens']}) must not exceed max_tokens ({max_tokens})",
                             param="min_tokens", code="invalid_value")
    if "logit_bias" in extra:
        check_token_ids([int(t) for t in extra["logit_bias"]], gateway.tokenizer.vocab_size, "logit_bias")
    check_token_ids(extra.get("allowed_token_ids", ()), gateway.tokenizer.vocab_size, "allowed_token_ids")
    if extra.get("thinking_token_budget", -1) != -1 and gateway.answers.reasoning_parser is None:
        raise InvalidRequest("thinking_token_budget needs a reasoning parser to tell the thinking: serve with "
                             "--reasoning-parser", param="thinking_token_budget", code="unsupported_parameter")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p,
                              seed=options.seed, ignore_eos=options.ignore_eos,
                              stop_token_ids=stop_token_ids(gateway.tokenizer, options.stop_token_ids, options.ignore_eos,
                                                            gateway.generation.eos_token_ids),
                              logprobs=options.logprobs, prompt_logprobs=computed_prompt_logprobs(options),
                              **extra)
    except ValueError as exc:  # options each valid alone that do not go together (SamplingParams says which)
        raise InvalidRequest(str(exc), code="invalid_value") from None


def computed_prompt_logprobs(options: GenerationOptions) -> int | None:
    """The prompt's alternatives the engine computes: those asked for, else an echo's (vLLM's
    rule); none where nothing would show them (a stream without an echo of logprobs)."""
    echoed = options.echo and options.logprobs is not None
    if options.prompt_logprobs is not None and (echoed or not options.stream):
        return options.prompt_logprobs
    return options.logprobs if echoed else None


def max_tokens_within_context(requested: int | None, num_prompt_tokens: int, max_context: int,
                              default: int | None = None) -> int:
    """`requested`, or when None the room left in the context (at most the model's `default`, as
    vLLM's server caps it); 400 with the numbers if it does not fit."""
    if num_prompt_tokens >= max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion",
            param="prompt", code="context_length_exceeded")
    if requested is None:
        return min(max_context - num_prompt_tokens, default or max_context)
    if num_prompt_tokens + requested > max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    return requested


def request_priority(request: Request, options: GenerationOptions) -> Priority:
    """The body's priority, else the x-llumdask-priority header, else normal."""
    if options.priority is not None:
        return options.priority
    header = request.headers.get(PRIORITY_HEADER)
    return Priority.NORMAL if header is None else parse_priority(header, PRIORITY_HEADER)


def check_model(backend: Backend, model: str) -> None:
    if model != backend.model.name:
        raise ModelNotFound(model, backend.model.name)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param} has token id {bad}, outside the vocabulary of {vocab_size} tokens",
                             param=param, code="invalid_value")


async def read_json(request: Request, limit: int) -> object:
    """The body as JSON; 413 past `limit` bytes (declared or actually sent), 400 if it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(limit)
    try:
        # RFC 8259: JSON exchanged is UTF-8. Decoded strictly here (json.loads of bytes would take
        # UTF-16 and UTF-32 too, and let encoded surrogates through).
        text = bytes(body).decode("utf-8")
        parsed = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested deeper than the parser recurses
        raise InvalidRequest("The request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text) and not _all_text(parsed):  # only an escape makes one now
        where = _lone_surrogate(parsed).encode("utf-8", "backslashreplace").decode("utf-8")  # a key may hold it
        raise InvalidRequest(f"{where or 'The request body'} holds a lone surrogate (a \\ud800-\\udfff escape "
                             "without its pair), which is no text", param=where or None, code="invalid_value")
    return parsed


def _all_text(parsed: Any) -> bool:
    """Whether every string of a parsed body (keys too) is text: no half of a UTF-16 pair."""
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except RecursionError:  # as deep as the parser allowed: the string check alone
        return _lone_surrogate(parsed) is None
    return True


def _lone_surrogate(value: Any) -> str | None:
    """Where in `value` a string (or key) holds half a UTF-16 pair, as a param ('' for the body
    itself); None where none does. Each node keeps only its parent and its step; the path is
    written for the one found."""
    stack: list[tuple[Any, tuple | None]] = [(value, None)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                steps = []
                while at is not None:
                    at, step = at
                    steps.append(step)
                return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in reversed(steps)).lstrip(".")
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((child, (at, key)))
                stack.append((key, (at, key)))
        elif isinstance(item, list):
            stack.extend((child, (at, i)) for i, child in enumerate(item))
    return None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


# ------------------------------------------------------------------ models, health, metrics
def model_card(backend: Backend) -> dict:
    model = backend.model
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owned_by,
            "max_model_len": model.max_context}


async def tokenize(request: Request, gateway: Gateway) -> Response:
    """vLLM's /tokenize: a prompt's token ids (or a conversation's, rendered with the chat template)."""
    parsed = parse_tokenize(await read_json(request, gateway.settings.max_body_bytes))
    if parsed.model is not None:
        check_model(gateway.backend, parsed.model)
    tokenizer = gateway.tokenizer
    if parsed.messages is not None:
        _, tokens = chat_prompt(tokenizer, parsed.messages, parsed.rendering, parsed.tools)
    else:
        tokens = tokenizer.encode(parsed.prompt, add_special_tokens=parsed.rendering.add_special_tokens)
    return JSONResponse({"count": len(tokens), "max_model_len": gateway.backend.model.max_context, "tokens": tokens,
                         "token_strs": tokenizer.token_strings(tokens) if parsed.return_token_strs else None})


async def detokenize(request: Request, gateway: Gateway) -> Response:
    """vLLM's /detokenize: the text of token ids (special tokens left out, as in completions)."""
    model, tokens = parse_detokenize(await read_json(request, gateway.settings.max_body_bytes))
    if model is not None:
        check_model(gateway.backend, model)
    check_token_ids(tokens, gateway.tokenizer.vocab_size, "tokens")
    return JSONResponse({"prompt": gateway.tokenizer.decode(tokens)})


async def version(request: Request, gateway: Gateway) -> Response:
    return JSONResponse({"version": llumdask.__version__})


async def list_models(request: Request, gateway: Gateway) -> Response:
    return JSONResponse({"object": "list", "data": [model_card(gateway.backend)]})


async def get_model(request: Request, gateway: Gateway) -> Response:
    check_model(gateway.backend, request.path_params["model"])
    return JSONResponse(model_card(gateway.backend))


async def health(request: Request, gateway: Gateway) -> Response:
    """200 when at least one instance is ready to take requests, 503 otherwise."""
    try:
        ready = await gateway.backend.ready_instances()
    except Exception as exc:  # the cluster is unreachable: that is what health reports
        logger.warning("health check could not reach the cluster: %s", exc)
        ready = 0
    status = 200 if ready > 0 else 503
    return JSONResponse({"status": "ok" if ready > 0 else "unavailable", "ready_instances": ready},
                        status_code=status)


async def metrics(request: Request, gateway: Gateway) -> Response:
    return gateway.metrics.render()


async def openapi(request: Request, gateway: Gateway) -> Response:
    # Off the event loop: the first call imports vLLM's protocol models (seconds).
    return JSONResponse(await asyncio.to_thread(openapi_document))


ROUTES = [
    Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
    Route("/v1/chat/completions", endpoint("chat_completions", chat_completions), methods=["POST"]),
    Route("/v1/models", endpoint("models", list_models), methods=["GET"]),
    Route("/v1/models/{model:path}", endpoint("models", get_model), methods=["GET"]),
    Route("/tokenize", endpoint("tokenize", tokenize), methods=["POST"]),
    Route("/detokenize", endpoint("detokenize", detokenize), methods=["POST"]),
    Route("/version", endpoint("version", version), methods=["GET"]),
    Route("/health", endpoint("health", health), methods=["GET"]),
    Route("/metrics", endpoint("metrics", metrics), methods=["GET"]),
    Route("/openapi.json", endpoint("openapi", openapi), methods=["GET"]),
]
