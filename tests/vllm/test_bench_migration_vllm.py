"""The migration benchmark on two real vLLM instances of the tiny model: every figure, and the
migrated tokens identical to an unmigrated run."""

from __future__ import annotations

import os

import pytest

from llumdask.config import load_config
from llumdask.benchmarks.migration_engines import BenchSettings, MigrationBench

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_one_length_on_vllm(vllm_engine, peer_engine):
    settings = BenchSettings(lengths=(600,), background=2, output_tokens=32)
    result = MigrationBench(vllm_engine, peer_engine, load_config(), settings).measure_length(600)
    assert result.tokens_identical and result.blocking_tokens_identical
    assert result.live_stages >= 2  # 600 tokens = 5 blocks of 128: a copy stage, then the last one
    assert result.live_bytes > 0 and result.blocking_bytes >= result.live_bytes * 0.5
    assert min(result.live_downtime_ms, result.blocking_downtime_ms, result.recompute_downtime_ms) > 0
    # The destination's first step yields the token and computes only the last sampled token:
    # the rest of the KV is the migrated copy, not a recompute.
    assert result.live_destination_steps == 1 and result.live_destination_prefill_tokens == 1
    assert result.live_downtime_ms + result.live_destination_step_ms <= result.live_token_gap_ms * 1.01
    assert result.blocking_downtime_ms < result.blocking_token_gap_ms
    # The figure is this machine's 1-minute load average (not a CPU share or a core count).
    assert result.normal_step_ms > 0 and abs(result.load_average - os.getloadavg()[0]) < os.cpu_count()
    assert result.source_slowdown > 0 and result.destination_slowdown > 0
    for engine in (vllm_engine, peer_engine):
        assert not engine.has_work()
        engine.check_integrity()
        snap = engine.snapshot()
        assert snap.free_blocks == snap.total_blocks and snap.reserved_blocks == 0
