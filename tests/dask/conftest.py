"""Fixtures for tests on a real multi-process Dask cluster (all marked slow).

One small cluster per module (starting one takes seconds on two cores); after every test each
worker must be idle with every block free and the block manager's integrity intact.
"""

from __future__ import annotations

import pytest
from daskhelpers import CLUSTER_OVERRIDES, assert_workers_clean, nannies_kept

from llumdask.config import LlumdaskConfig, load_config


@pytest.fixture(scope="module")
def cluster_config() -> LlumdaskConfig:
    return load_config(CLUSTER_OVERRIDES)


@pytest.fixture(scope="module")
def cluster():
    """Tests kill workers and break engines for their nannies to restart (`nannies_kept`)."""
    from llumdask.clusters.local import local_cluster

    with nannies_kept():
        cluster = local_cluster(2, config_overrides=CLUSTER_OVERRIDES)
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="module")
def llum(cluster):
    from llumdask.api.client import connect

    client = connect(cluster)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def clean(llum):
    """Use in every test on the shared cluster: checks for leaks afterwards."""
    yield llum
    assert_workers_clean(llum.dask_client)
