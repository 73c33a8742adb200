"""Prometheus metrics of one gateway, in a registry of its own.

A registry per app (not prometheus-client's global one) keeps two gateways in one process, and
tests, from counting into each other. Latency histograms follow the paper's metrics: time to
first token (prefill latency, queueing included), time per output token after the first
(decode latency) and end-to-end latency, all measured where the client sees them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import Response

PREFIX = "llumdask_gateway"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status code",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "Errors answered or met mid-stream, by error code",
                              ["code"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Generation requests being served now", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Request accepted to first token received (queueing included)",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              ["endpoint"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request accepted to last token",
                             ["endpoint"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests",
                                     ["endpoint"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated and sent to clients",
                                         ["endpoint"], registry=r)

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def response(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def finished(self, endpoint: str, prompt_tokens: int, output_tokens: int, first_token: float | None,
                 last_token: float | None, start: float) -> None:
        """Record one completed generation; times are `time.perf_counter()` readings."""
        self.prompt_tokens.labels(endpoint=endpoint).inc(prompt_tokens)
        self.generation_tokens.labels(endpoint=endpoint).inc(output_tokens)
        if first_token is None or last_token is None:
            return
        self.ttft.labels(endpoint=endpoint).observe(first_token - start)
        self.e2e.labels(endpoint=endpoint).observe(last_token - start)
        if output_tokens > 1:
            self.tpot.labels(endpoint=endpoint).observe((last_token - first_token) / (output_tokens - 1))

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
