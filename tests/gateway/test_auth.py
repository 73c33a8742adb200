"""API keys: enforced on /v1/* when configured, with OpenAI's 401 shape; /health and /metrics stay open."""

from __future__ import annotations

import pytest
from gatewayfakes import MODEL

from llumdask.api.gateway.auth import APIKeys

BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


@pytest.fixture
def secured(make_client, backend):
    return make_client(backend, api_keys=("key-one", "key-two"))


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer key-one-and-more", "Basic key-one", "Bearer ",
                                    "key-one"])
def test_requests_without_a_valid_key_are_401(secured, backend, header):
    headers = {} if header is None else {"authorization": header}
    r = secured.post("/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert secured.get("/v1/models", headers=headers).status_code == 401
    assert backend.submitted == []


@pytest.mark.parametrize("key", ["key-one", "key-two"])
def test_any_configured_key_is_accepted(secured, key):
    r = secured.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert secured.get("/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200


def test_health_and_metrics_need_no_key(secured):
    assert secured.get("/health").status_code == 200
    secured.post("/v1/completions", json=BODY)
    text = secured.get("/metrics").text
    assert 'llumdask_gateway_errors_total{code="invalid_api_key"} 1.0' in text


def test_without_keys_everything_is_open(client):
    assert client.post("/v1/completions", json=BODY).status_code == 200


def test_key_check_compares_every_key():
    keys = APIKeys(["a", "b"])
    assert keys.accepts("a") and keys.accepts("b") and not keys.accepts("c") and not keys.accepts("")
    assert not APIKeys([]) and APIKeys(["a"])
