"""The gateway's OpenAPI description (`GET /openapi.json`): every route, its request and response
bodies, and the error object every failure comes as.

The OpenAI routes' bodies are vLLM's protocol models where vLLM is installed: the shapes OpenAI
clients send, as vLLM's own server documents them (a field llumdask cannot honour is answered
with a 400 naming it, never ignored). Without vLLM they are described as JSON objects. Errors are
OpenAI's error object, whose `code` is a string here (vLLM's own uses the HTTP status). The
document is built once, on the first request: vLLM's protocol modules take seconds to import.
"""

from __future__ import annotations

import functools
from typing import Any

import llumdask

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
MODEL_CARD = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}},
}
REQUIRED = {"CompletionRequest": {"model", "prompt"}, "ChatCompletionRequest": {"model", "messages"}}
# Statuses a request to each kind of route may get besides 200.
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)
BODY_ERRORS = (400, 401, 404, 413)


@functools.cache
def openapi_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR, "Model": MODEL_CARD}
    bodies = _vllm_bodies(schemas)
    generic = {"type": "object"}

    def body(name: str) -> dict[str, Any]:
        return bodies.get(name, generic)

    paths = {
        "/v1/completions": {"post": _operation(
            "createCompletion", body("CompletionRequest"), body("CompletionResponse"), GENERATION_ERRORS,
            streams=True)},
        "/v1/chat/completions": {"post": _operation(
            "createChatCompletion", body("ChatCompletionRequest"), body("ChatCompletionResponse"), GENERATION_ERRORS,
            streams=True)},
        "/v1/models": {"get": _operation("listModels", None, {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": REF.format(model="Model")}}},
        }, (401,))},
        "/v1/models/{model}": {"get": {
            **_operation("retrieveModel", None, {"$ref": REF.format(model="Model")}, (401, 404)),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        }},
        "/tokenize": {"post": _operation("tokenize", body("TokenizeRequest"), body("TokenizeResponse"), BODY_ERRORS)},
        "/detokenize": {"post": _operation("detokenize", body("DetokenizeRequest"), body("DetokenizeResponse"),
                                           BODY_ERRORS)},
        "/version": {"get": _operation("version", None, {
            "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}, ())},
        "/health": {"get": _operation("health", None, {
            "type": "object", "required": ["status", "ready_instances"],
            "properties": {"status": {"enum": ["ok", "unavailable"]}, "ready_instances": {"type": "integer"}},
        }, (503,))},
        "/metrics": {"get": {"operationId": "metrics", "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "llumdask", "version": llumdask.__version__,
                 "description": "OpenAI-compatible serving over a llumdask cluster"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(operation_id: str, request: dict | None, response: dict, errors: tuple[int, ...], *,
               streams: bool = False) -> dict[str, Any]:
    content = {"application/json": {"schema": response}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status in errors:
        responses[str(status)] = {"description": "error",
                                  "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    operation: dict[str, Any] = {"operationId": operation_id, "responses": responses}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
    return operation


def _vllm_bodies(schemas: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """References to vLLM's protocol models, their schemas (and those they use) entered in
    `schemas`; {} without vLLM."""
    try:
        from pydantic import TypeAdapter
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
        from vllm.entrypoints.serve.tokenize.protocol import (
            DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
        )
    except ImportError:
        return {}
    models = {"CompletionRequest": CompletionRequest, "CompletionResponse": CompletionResponse,
              "ChatCompletionRequest": ChatCompletionRequest, "ChatCompletionResponse": ChatCompletionResponse,
              "TokenizeRequest": TokenizeRequest, "TokenizeResponse": TokenizeResponse,
              "DetokenizeRequest": DetokenizeRequest, "DetokenizeResponse": DetokenizeResponse}
    bodies = {}
    for name, model in models.items():
        schema = TypeAdapter(model).json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
        bodies[name] = {"$ref": REF.format(model=name)}
    # What this gateway requires, as OpenAI's API does (vLLM's server falls back to its one model).
    for name, fields in REQUIRED.items():
        schemas[name]["required"] = sorted(set(schemas[name].get("required", ())) | fields)
    return bodies
