"""DaskBackend on a real cluster with no instance: health says 503, and so does a request, quickly."""

from __future__ import annotations

import time

import pytest
from gatewayfakes import MODEL
from starlette.testclient import TestClient

from llumdask.api.gateway import ModelInfo, create_app
from llumdask.config import GatewayConfig
from llumdask.api.gateway.dask_backend import DaskBackend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def empty_cluster():
    from llumdask.clusters.local import local_cluster

    cluster = local_cluster(0)
    try:
        yield cluster
    finally:
        cluster.close()


def test_no_ready_instance_is_503(empty_cluster, tokenizer):
    model = ModelInfo(MODEL, 256)
    app = create_app(lambda: DaskBackend.connect(empty_cluster.scheduler_address, model, placement_timeout=0.5),
                     tokenizer, GatewayConfig())
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["ready_instances"] == 0
        start = time.monotonic()
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_ready_instance"
        assert time.monotonic() - start < 5  # the placement timeout, not the default minute
