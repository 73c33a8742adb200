"""Per-API-key rate limits: token buckets of requests and tokens per minute, refilled continuously;
past them 429 rate_limit_exceeded with retry-after, each key on its own."""

from __future__ import annotations

import pytest
from gatewayfakes import MODEL
from inprocess import ManualClock

from llumdask.api.gateway.rate_limits import ANONYMOUS, RateLimited, RateLimits, key_id


def test_requests_per_minute_refill_continuously_per_key():
    clock = ManualClock()
    limits = RateLimits(requests_per_minute=2, tokens_per_minute=None, clock=clock)
    limits.admit("a", 10)
    limits.admit("a", 10)
    with pytest.raises(RateLimited) as refused:
        limits.admit("a", 10)
    assert refused.value.headers["retry-after"] == "30"  # one request comes back every 30 s
    limits.admit("b", 10)  # another key has its own buckets
    clock.now = 30.0
    limits.admit("a", 10)
    with pytest.raises(RateLimited):
        limits.admit("a", 10)


def test_tokens_per_minute_take_what_a_request_may_use_and_get_the_unused_back():
    clock = ManualClock()
    limits = RateLimits(requests_per_minute=None, tokens_per_minute=100, clock=clock)
    charge = limits.admit("a", 80)
    with pytest.raises(RateLimited, match="100 tokens per minute"):
        limits.admit("a", 30)  # 20 left
    limits.refund(charge, 60)  # it used 20 of its 80
    limits.admit("a", 30)
    with pytest.raises(RateLimited, match="more than the 100 tokens per minute"):
        limits.admit("a", 101)  # could never fit
    assert not RateLimits(None, None) and RateLimits(1, None)


def test_keys_are_held_by_digest():
    assert key_id(None) == ANONYMOUS and key_id("s3cret") != "s3cret" and "s3cret" not in key_id("s3cret")


def test_through_the_gateway_each_key_has_its_limit(make_client, backend):
    client = make_client(backend, api_keys=("key-a", "key-b"), requests_per_minute=2)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}

    def post(key: str):
        return client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})

    assert [post("key-a").status_code for _ in range(2)] == [200, 200]
    refused = post("key-a")
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert post("key-b").status_code == 200
    assert len(backend.submitted) == 3  # the refused request reached nothing
    assert "key-a" not in refused.text


def test_through_the_gateway_tokens_not_generated_go_back(make_client, backend, script):
    # Each request may use its prompt and 60 tokens, but the backend's script ends sooner: only
    # what it generated stays taken, so five fit where 200 // 60 = 3 would without the refunds.
    client = make_client(backend, tokens_per_minute=200)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 60}
    statuses = [client.post("/v1/completions", json=body).status_code for _ in range(5)]
    assert statuses == [200] * 5 and len(script) <= 25
    too_big = client.post("/v1/completions", json={**body, "max_tokens": 250})
    assert too_big.status_code in (400, 429)  # past the context (400) or past a minute's tokens (429)
