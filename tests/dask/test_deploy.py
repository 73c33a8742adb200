"""The benchmarks' deployment of separate scheduler and worker processes fails fast and says why."""

from __future__ import annotations

import time

import pytest

from llumdask.benchmarks.deploy import process_cluster
from llumdask.clusters.instances import InstanceStartupError

pytestmark = pytest.mark.slow


def test_an_instance_that_cannot_start_stops_the_deployment_with_its_error():
    started = time.monotonic()
    with pytest.raises(InstanceStartupError, match="unknown latency profile 'no-such-profile'"):
        with process_cluster(1, {"sim-engine": {"profile": "no-such-profile"}}, timeout=300):
            pytest.fail("the deployment came up with an instance that cannot start")
    assert time.monotonic() - started < 60  # not the 300 s timeout
