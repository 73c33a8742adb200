"""The gateway's OpenAPI description, and the gateway fuzzed from it (schemathesis): whatever a
client sends, no 5xx, and every answer as the description says (a documented status, every error
in OpenAI's error shape, every 200 of vLLM's response models). Over the fake backend: this tests
the HTTP layer (validation, routing, errors, response shapes), not serving."""

from __future__ import annotations

import pytest
import schemathesis
from gatewayfakes import MODEL
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)
from starlette.testclient import TestClient

EXAMPLES = 40
STREAM_CONFORMANCE = [status_code_conformance, content_type_conformance]
CONFORMANCE = [*STREAM_CONFORMANCE, response_schema_conformance]

ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/tokenize",
          "/detokenize", "/version", "/health", "/metrics"}
POSTED = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}


def test_openapi_json_describes_every_route_with_vllm_s_request_shapes(client: TestClient):
    document = client.get("/openapi.json").json()
    assert set(document["paths"]) == ROUTES
    completion = document["paths"]["/v1/completions"]["post"]
    request = completion["requestBody"]["content"]["application/json"]["schema"]
    assert request == {"$ref": "#/components/schemas/CompletionRequest"}
    schemas = document["components"]["schemas"]
    assert {"prompt", "max_tokens", "logprobs", "stream"} <= set(schemas["CompletionRequest"]["properties"])
    assert completion["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


# Bodies of the documented shapes everywhere; bodies that break them where there is a body (a GET
# without parameters has nothing to break).
CASES = sorted([(p, "GET", GenerationMode.POSITIVE) for p in ROUTES - POSTED - {"/metrics"}]
               + [(p, "POST", mode) for p in POSTED for mode in GenerationMode])


@pytest.mark.parametrize("path, method, mode", CASES)
def test_no_input_gets_a_server_error_and_every_error_is_openai_shaped(client: TestClient, path: str, method: str,
                                                                       mode: GenerationMode):
    """`positive`: bodies of the documented shapes; `negative`: bodies that break them. The served
    model's name goes in where a body names one, so requests get past the model check."""
    operation = schemathesis.openapi.from_asgi("/openapi.json", client.app)[path][method]

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def send(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        kwargs = case.as_transport_kwargs()
        response = client.request(kwargs.pop("method"), kwargs.pop("url"), **kwargs)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        # Each status documented, each body of its documented shape (OpenAI's error object for
        # every error; vLLM's response models for every 200) and content type. A stream is
        # documented as OpenAPI 3.1 does, one string; schemathesis reads that schema as each
        # event's (3.2's `itemSchema`), so a stream's body is checked by status and type only
        # (its chunks are the openai client's to parse, in the tests that stream).
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        case.validate_response(response, checks=STREAM_CONFORMANCE if streamed else CONFORMANCE)

    send()
