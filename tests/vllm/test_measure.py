"""`llumdask profile measure` on a real vLLM instance: the quick grid gives a loadable profile."""

from __future__ import annotations

import pytest

from llumdask.engine.latency import load_profile
from llumdask.benchmarks.profile_fit import profile_json
from llumdask.benchmarks.profile_measure import GRIDS, MeasureGrid, fit_measured, measure

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_quick_grid_gives_a_loadable_profile_with_positive_monotonic_predictions(vllm_engine, tiny_model, tmp_path):
    grid = GRIDS["quick"]
    measurement = measure(vllm_engine, grid)
    assert [n for n, _ in measurement.prefill] == list(grid.prompt_lengths)
    assert len(measurement.decode) == len(grid.batch_sizes) * len(grid.context_lengths)
    assert all(seconds > 0 for *_, seconds in (*measurement.prefill, *measurement.decode))
    # The decode context is what the batch held: batch x (prompt + a few generated tokens).
    for batch, context, _ in measurement.decode:
        assert any(batch * length <= context <= batch * (length + grid.repeats + 4) for length in grid.context_lengths)

    result = fit_measured(vllm_engine, measurement, "tiny-measured", str(tiny_model), "quick")
    path = tmp_path / "tiny-measured.json"
    path.write_text(profile_json(result.profile))
    profile = load_profile(path)
    assert profile == result.profile
    assert profile.capacity_tokens == vllm_engine.total_blocks * vllm_engine.block_size
    assert profile.block_size == vllm_engine.block_size
    assert profile.model_kv_bytes_per_token == 2 * 2 * 2 * 64 * 4  # layers x K,V x heads x dims x float32
    prefill = [profile.prefill_time([n]) for n in (1, 64, 512, 2048, 8192)]
    decode = [profile.decode_time(batch, batch * 300) for batch in (1, 4, 16, 64)]
    assert prefill[0] > 0 and decode[0] > 0
    assert prefill == sorted(prefill) and decode == sorted(decode)
    assert "measure --engine vllm --grid quick" in profile.derivation

    assert not vllm_engine.has_work()
    snap = vllm_engine.snapshot()
    assert snap.free_blocks == snap.total_blocks


def test_a_grid_longer_than_the_model_allows_is_refused(vllm_engine):
    grid = MeasureGrid(prompt_lengths=(vllm_engine.max_model_len + 1,), batch_sizes=(1,), context_lengths=(8,), repeats=1)
    with pytest.raises(ValueError, match="max_model_len"):
        measure(vllm_engine, grid)
