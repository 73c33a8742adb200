"""The simulator-vs-real benchmark's pure parts: the error table, the mean profile, the serving
overheads read from lone requests, and the latency definitions shared with the simulator."""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace

import pytest

from llumdask.benchmarks.sim_validation import (
    PROBES,
    Latencies,
    Observed,
    RealRun,
    ServingCosts,
    error_rows,
    main,
    mean_profile,
    probe_drift,
    probe_rounds,
    real_hit_rate,
    real_latencies,
    serving_costs,
    turn_prompt,
    write_requests,
)
from llumdask.benchmarks.common import model_shape
from llumdask.engine.latency import DecodeCost, LatencyProfile, PrefillCost
from llumdask.sim.workload import TraceRequest

TOY = LatencyProfile("toy", 16384, 128, 1024, PrefillCost(0.002, 1e-5, 0.0), DecodeCost(0.001, 1e-4, 0.0), "made up")


def observed(ttft: float, tpot: float, tokens: int, sent: float = 10.0) -> Observed:
    return Observed(sent=sent, late=0.0, first=sent + ttft, last=sent + ttft + tpot * (tokens - 1), tokens=tokens)


def test_error_rows_compare_every_variant_with_the_real_run():
    real = {"ttft_mean": 0.020, "ttft_p99": 0.100, "tpot_mean": 0.004, "tpot_p99": 0.008}
    simulated = {"engine": {k: v / 2 for k, v in real.items()},
                 "served": real | {"ttft_p99": 0.120, "tpot_mean": 0.0035}}
    rows = error_rows(real, simulated)
    assert [row["metric"] for row in rows] == ["TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99"]
    by_key = {row["key"]: row for row in rows}
    assert by_key["ttft_mean"]["real_ms"] == pytest.approx(20.0)
    assert all(row["engine_error"] == pytest.approx(-0.5) and not row["engine_within_goal"] for row in rows)
    assert by_key["ttft_p99"]["served_error"] == pytest.approx(0.2) and not by_key["ttft_p99"]["served_within_goal"]
    assert by_key["tpot_mean"]["served_error"] == pytest.approx(-0.125) and by_key["tpot_mean"]["served_within_goal"]
    assert by_key["ttft_mean"]["served_ms"] == pytest.approx(20.0) and by_key["ttft_mean"]["served_error"] == 0


def test_latencies_follow_the_simulator_definitions():
    """TTFT from sending; TPOT = (last - first) / (tokens - 1), skipped for single-token requests;
    P99 interpolated as numpy does (llumdask.sim.metrics.mean_and_p99)."""
    requests = [observed(0.010, 0.002, 11), observed(0.030, 0.004, 3), replace(observed(0.020, 0.0, 1), cached=128)]
    latencies = real_latencies(requests)
    assert latencies.tpot[2] is None and latencies.cached == (None, None, 128)
    stats = latencies.stats()
    assert stats["ttft_mean"] == pytest.approx(0.020)
    assert stats["ttft_p99"] == pytest.approx(0.020 + 0.98 * 0.010)
    assert stats["tpot_mean"] == pytest.approx(0.003)
    assert stats["tpot_p99"] == pytest.approx(0.002 + 0.99 * 0.002)


def test_the_request_table_has_every_variants_latencies_and_cached_tokens(tmp_path):
    trace = [TraceRequest(0.0, 300, 4), TraceRequest(0.5, 400, 2)]
    real = Latencies((0.1, 0.2), (0.01, None), (0, 256))
    simulated = {"served": Latencies((0.15, 0.05), (0.012, 0.02), (128, None))}
    with write_requests(tmp_path / "requests.csv", trace, real, simulated).open() as f:
        rows = list(csv.DictReader(f))
    assert rows[1] == {"index": "1", "arrival_s": "0.5000", "input_len": "400", "output_len": "2",
                       "real_ttft_ms": "200.000", "real_tpot_ms": "", "real_cached": "256",
                       "served_ttft_ms": "50.000", "served_tpot_ms": "20.000", "served_cached": ""}
    assert rows[0]["served_cached"] == "128" and rows[0]["real_cached"] == "0"


def test_mean_profile_averages_coefficients_and_keeps_both_derivations():
    other = replace(TOY, prefill=PrefillCost(0.004, 3e-5, 2e-9), decode=DecodeCost(0.003, 3e-4, 1e-7), derivation="second")
    mean = mean_profile([TOY, other], "both", "two at once")
    assert (mean.name, mean.capacity_tokens, mean.block_size) == ("both", 16384, 128)
    assert mean.prefill == PrefillCost(pytest.approx(0.003), pytest.approx(2e-5), pytest.approx(1e-9))
    assert mean.decode == DecodeCost(pytest.approx(0.002), pytest.approx(2e-4), pytest.approx(5e-8))
    assert mean.decode_time(4, 1000) == pytest.approx((TOY.decode_time(4, 1000) + other.decode_time(4, 1000)) / 2)
    assert mean.derivation.splitlines() == ["two at once", "Profile 0: made up", "Profile 1: second"]
    with pytest.raises(ValueError, match="different engines"):
        mean_profile([TOY, replace(TOY, capacity_tokens=8192)], "x", "y")


# The long probe's prompt beyond the lone probe's, and what TOY's prefill says it costs (10 us a token).
EXTRA_TOKENS = PROBES["long"].prompt - PROBES["lone"].prompt
EXTRA_PREFILL = EXTRA_TOKENS * 1e-5


def probes(lone_ttft=0.00908, lone_tpot=0.0021, batched_tpot=0.0030, long_ttft=0.00908 + EXTRA_PREFILL) -> dict:
    """Each probe's median is the given value (a slower outlier beside two equal samples)."""
    return {
        "lone": [observed(lone_ttft, lone_tpot, 65)] * 2 + [observed(0.05, 0.005, 65)],
        "batched": [observed(0.03, batched_tpot, 65)] * 2 + [observed(0.03, 0.009, 65)],
        "long": [observed(long_ttft, 0.002, 65)] * 2 + [observed(0.09, 0.002, 65)],
    }


def test_probe_drift_is_each_probe_after_the_trace_over_before():
    before = probes()
    after = probes(lone_tpot=0.0042, long_ttft=(0.00908 + EXTRA_PREFILL) * 1.5)
    drift = probe_drift(RealRun(before, after, [], 0, 0))
    assert drift["lone_tpot"] == pytest.approx(2.0) and drift["long_ttft"] == pytest.approx(1.5)
    assert drift["batched_tpot"] == pytest.approx(1.0) and drift["lone_ttft"] == pytest.approx(1.0)
    assert set(drift) == {f"{n}_{m}" for n in ("lone", "batched", "long") for m in ("ttft", "tpot")}


def test_serving_costs_are_what_probes_take_beyond_the_profile():
    # TOY: prefill 2 ms + 10 us per token; decode 1 ms + 0.1 ms per sequence, no context cost.
    # Decode beyond the profile: 1.0 ms alone, 1.6 ms four at once: 0.8 ms per step + 0.2 ms per sequence.
    # Prefill: the long probe took what the profile says its extra tokens cost: scale 1.
    costs = serving_costs(probes(), TOY)
    assert costs.per_seq == pytest.approx(0.0002) and costs.per_step == pytest.approx(0.0008)
    assert costs.prefill_scale == pytest.approx(1.0)
    assert costs.request_path == pytest.approx(0.00908 - (0.002 + 0.00128) - 0.0008)
    served = costs.served(TOY)
    assert served.decode_time(4, 1000) == pytest.approx(TOY.decode_time(4, 1000) + 0.0008 + 4 * 0.0002)
    assert served.prefill_time([128]) == pytest.approx(TOY.prefill_time([128]) + 0.0008)
    # A mixed step pays the per-step cost once.
    assert served.step_time([(0, 128)], 4, 1000) == pytest.approx(TOY.step_time([(0, 128)], 4, 1000) + 0.0008 + 4 * 0.0002)
    assert served.name == "toy-served" and served.derivation.endswith("made up")


def test_a_slower_prefill_per_token_scales_the_prompt_terms_only():
    # The long probe took twice what the profile says its extra tokens cost.
    costs = serving_costs(probes(long_ttft=0.00908 + 2 * EXTRA_PREFILL), TOY)
    assert costs.prefill_scale == pytest.approx(2.0)
    served = costs.served(TOY)
    assert served.prefill == PrefillCost(pytest.approx(0.0028), pytest.approx(2e-5), 0.0)
    assert costs.request_path == pytest.approx(0.00908 - served.prefill_time([128]))


def test_a_profile_slower_than_the_cluster_means_no_serving_cost():
    fast = {name: [observed(0.001, 0.0005, 65)] for name in ("lone", "batched", "long")}
    assert serving_costs(fast, TOY) == ServingCosts(request_path=0.0, per_step=0.0, per_seq=0.0, prefill_scale=0.0)
    # 2.0 ms beyond the profile alone, 1.6 ms four at once: no negative cost per sequence, the
    # mean of the two per step.
    costs = serving_costs(probes(lone_tpot=0.0031, batched_tpot=0.0030), TOY)
    assert costs.per_seq == 0.0 and costs.per_step == pytest.approx(0.0018)


def test_probe_rounds_are_counted_and_at_least_one_is_asked_for(tmp_path, capsys):
    rounds = probe_rounds(0, 100, 2)
    assert [name for name, _ in rounds] == ["warm-up", *PROBES, *PROBES]
    with pytest.raises(SystemExit):  # refused before any work
        main(["--probe-rounds", "0", "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")])
    assert "--probe-rounds must be at least 1" in capsys.readouterr().err and not (tmp_path / "logs").exists()


def test_shape_option():
    assert model_shape("8x768") == (8, 768)
    for bad in ("8", "0x768", "8x100", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            model_shape(bad)


def test_a_turn_resends_the_generated_history_and_adds_its_own_tokens_in_the_vocabulary():
    from llumdask.sim.workload import make_workload, prompt_tokens

    trace = make_workload("multi-turn", rate=1.0, num_requests=30, seed=0)
    first = next(i for i, r in enumerate(trace) if r.after is None and any(t.after == i for t in trace))
    follower = next(i for i, r in enumerate(trace) if r.after == first)
    opening = turn_prompt(trace, first, [], vocab=512)
    assert len(opening) == trace[first].input_len and all(1 <= t < 512 for t in opening)
    assert opening == turn_prompt(trace, first, [], vocab=512)  # deterministic
    answer = [7] * trace[first].output_len  # what the instance generated
    history = opening + answer
    turn = turn_prompt(trace, follower, history, vocab=512)
    assert turn[: len(history)] == history and len(turn) == trace[follower].input_len
    # The same own tokens as the simulator's prompt, folded into the vocabulary.
    own = prompt_tokens(trace[follower], follower, history)[len(history):]
    assert turn[len(history):] == [1 + t % 511 for t in own]


def test_the_real_hit_rate_is_cached_prompt_tokens_over_prompt_tokens_where_reported():
    def seen(prompt: int, cached: int | None) -> Observed:
        return replace(observed(0.01, 0.001, 4), prompt=prompt, cached=cached)

    assert real_hit_rate([seen(100, 0), seen(300, 256), seen(50, None)]) == pytest.approx(256 / 400)
    assert real_hit_rate([seen(100, None)]) != real_hit_rate([seen(100, None)])  # NaN: nobody said
