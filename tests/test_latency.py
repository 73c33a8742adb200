import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llumdask.engine.latency import LatencyProfile, available_profiles, load_profile


def profile_dict(**changes):
    data = {
        "name": "toy",
        "capacity_tokens": 1024,
        "block_size": 16,
        "model_kv_bytes_per_token": 1000,
        "prefill": {"base_s": 0.01, "per_token_s": 0.001, "per_token_squared_s": 1e-6},
        "decode": {"base_s": 0.02, "per_seq_s": 0.002, "per_context_token_s": 1e-5},
        "derivation": ["made up for a test"],
    }
    data.update(changes)
    return data


TOY = LatencyProfile.from_dict(profile_dict())


def test_builtin_profiles_load():
    assert {"llama-7b-a10", "llama-30b-4xa10"} <= set(available_profiles())
    p7 = load_profile("llama-7b-a10")
    assert p7.capacity_tokens == 13616 and p7.block_size == 16
    assert p7.model_kv_bytes_per_token == 2 * 32 * 4096 * 2
    assert "125 TFLOPS" in p7.derivation and "600 GB/s" in p7.derivation
    p30 = load_profile("llama-30b-4xa10")
    assert p30.model_kv_bytes_per_token == 2 * 60 * 6656 * 2
    assert "all-reduce" in p30.derivation


def test_builtin_7b_coefficients_follow_their_derivation():
    """The numbers in the JSON are the arithmetic its derivation text states (within rounding)."""
    peak, bandwidth, params, weights, vocab = 125e12, 600e9, 6_738_415_616, 13_476_831_232, 32_000 * 4096
    p = load_profile("llama-7b-a10")
    expected = {
        "prefill.base_s": (p.prefill.base_s, weights / (bandwidth * 0.8)),
        "prefill.per_token_s": (p.prefill.per_token_s, 2 * (params - 2 * vocab) / (peak * 0.6)),
        "prefill.per_token_squared_s": (p.prefill.per_token_squared_s, 2 * 4096 * 32 / (peak * 0.4)),
        "decode.base_s": (p.decode.base_s, weights / (bandwidth * 0.8)),
        "decode.per_seq_s": (p.decode.per_seq_s, 2 * (params - vocab) / (peak * 0.5)),
        "decode.per_context_token_s": (p.decode.per_context_token_s, 524288 / (bandwidth * 0.8)),
    }
    for key, (stored, derived) in expected.items():
        assert stored == pytest.approx(derived, rel=1e-3), key


def test_step_time_is_the_formula():
    assert TOY.prefill_time([]) == 0.0
    assert TOY.decode_time(0, 0) == 0.0
    assert TOY.prefill_time([100]) == pytest.approx(0.01 + 0.001 * 100 + 1e-6 * 100**2)
    assert TOY.prefill_time([100, 50]) == pytest.approx(0.01 + 0.001 * 150 + 1e-6 * (100**2 + 50**2))
    assert TOY.decode_time(8, 4000) == pytest.approx(0.02 + 0.002 * 8 + 1e-5 * 4000)
    assert TOY.step_time([(0, 100)], 0, 0) == pytest.approx(TOY.prefill_time([100]))
    assert TOY.step_time([], 8, 4000) == pytest.approx(TOY.decode_time(8, 4000))


def test_a_mixed_step_pays_one_fixed_cost():
    """Prefills and decodes of one step run in one forward pass: the smaller base (prefill's
    10 ms here) is not paid a second time."""
    mixed = TOY.step_time([(0, 100)], 8, 4000)
    assert mixed == pytest.approx(TOY.prefill_time([100]) + TOY.decode_time(8, 4000) - 0.01)
    assert mixed > max(TOY.prefill_time([100]), TOY.decode_time(8, 4000))


@given(
    n=st.integers(1, 20_000),
    extra=st.integers(1, 5_000),
    batch=st.integers(1, 512),
    context=st.integers(0, 100_000),
)
def test_more_work_never_takes_less_time(n, extra, batch, context):
    for profile in (TOY, load_profile("llama-7b-a10"), load_profile("llama-30b-4xa10")):
        assert profile.prefill_time([n + extra]) > profile.prefill_time([n])
        assert profile.prefill_time([n, extra]) > profile.prefill_time([n])
        assert profile.decode_time(batch + 1, context) > profile.decode_time(batch, context)
        assert profile.decode_time(batch, context + extra) > profile.decode_time(batch, context)


def test_load_profile_from_a_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(profile_dict(name="mine")))
    assert load_profile(path).name == "mine"
    assert load_profile(str(path)).decode.per_seq_s == 0.002


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"capacity_tokens": 0}, "'capacity_tokens' must be a positive integer"),
        ({"capacity_tokens": 8}, "smaller than one block"),
        ({"block_size": 1.5}, "'block_size' must be a positive integer"),
        ({"decode": {"base_s": -1, "per_seq_s": 0, "per_context_token_s": 0}}, "'decode.base_s' must be a finite number"),
        ({"prefill": {"base_s": 0.0, "per_token_s": 0.0}}, "'prefill' must be an object with exactly the keys"),
        ({"derivation": ""}, "'derivation' must say where the numbers come from"),
        ({"speed": 3}, "unknown keys \\['speed'\\]"),
    ],
)
def test_invalid_profiles_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        LatencyProfile.from_dict(profile_dict(**changes), source="test profile")


def test_missing_key_is_named():
    data = profile_dict()
    del data["decode"]
    with pytest.raises(ValueError, match="missing keys \\['decode'\\]"):
        LatencyProfile.from_dict(data)


def test_unknown_profile_lists_the_builtin_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown latency profile 'llama-70b'.*llama-7b-a10"):
        load_profile("llama-70b")
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(bad)


@pytest.mark.parametrize(("prompt", "output"), [(1, 1), (100, 1), (100, 2), (37, 250)])
def test_solo_latency_is_a_prefill_then_lone_decode_steps(prompt, output):
    steps = TOY.prefill_time([prompt]) + sum(TOY.decode_time(1, prompt + k) for k in range(1, output))
    assert TOY.solo_latency(prompt, output) == pytest.approx(steps)
