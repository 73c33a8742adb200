"""A cluster under Dask security (mutual TLS between scheduler, workers and clients): requests are
served and live-migrated, KV stages and tokens travel over TLS with the cluster's certificates."""

from __future__ import annotations

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens
from distributed import Security

from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config

pytestmark = pytest.mark.slow

OVERRIDES = {"sim-engine": {"total-blocks": 256}}


def test_a_tls_cluster_serves_and_migrates_with_every_channel_under_its_certificates():
    config = load_config(OVERRIDES)
    with local_cluster(2, config_overrides=OVERRIDES, security=Security.temporary(), protocol="tls://") as cluster, \
            connect(cluster) as llum:
        assert cluster.scheduler_address.startswith("tls://")
        prompt = prompt_of(7, 60)
        stream = llum.stream(prompt, max_tokens=120)
        tokens = [next(stream)]
        source = stream.instance
        destination = next(row["instance"] for row in llum.instances().rows if row["instance"] != source)
        llum.migrate(stream.request_id, to=destination)
        tokens += list(stream)
        assert tokens == reference_tokens(config, prompt, 120)
        assert stream.instance == destination
        assert llum.requester.token_address.startswith("tls://")
        assert [m["kind"] for m in llum.migrations().rows] == ["committed"]
        assert_workers_clean(llum.dask_client)
