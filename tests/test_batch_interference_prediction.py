"""The batch-interference benchmark's prediction: its phases replayed in the simulator."""

from __future__ import annotations

from llumdask.benchmarks.batch_interference import predicted


def test_a_batch_job_slows_interactive_requests_and_high_priority_keeps_their_decode_faster():
    """Beside a batch job, interactive requests wait and decode longer than alone; at high priority
    the headroom keeps batch work off their instance, so they decode faster than at normal."""
    rows = [{"phase": "alone", "achieved_rps": 3.6, "batch_prompts_per_s": 0.0},
            {"phase": "batch, interactive high", "achieved_rps": 3.6, "batch_prompts_per_s": 13.0},
            {"phase": "batch, interactive normal", "achieved_rps": 3.6, "batch_prompts_per_s": 13.0}]
    alone, high, normal = predicted(rows, 2, (64, 32), (11, 64))
    assert high["ttft_mean_ms"] > alone["ttft_mean_ms"] and normal["ttft_mean_ms"] > alone["ttft_mean_ms"]
    assert alone["tpot_mean_ms"] < high["tpot_mean_ms"] < normal["tpot_mean_ms"]
