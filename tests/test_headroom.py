"""High-priority headroom derived from a latency profile, stored in it, and taken by the scheduler."""

from __future__ import annotations

import json

import pytest

from llumdask.api.profile_cli import main as profile_main
from llumdask.config import LlumdaskConfig
from llumdask.engine.headroom import Headroom, decode_step, derive_headroom
from llumdask.engine.latency import DecodeCost, LatencyProfile, PrefillCost, available_profiles, load_profile
from llumdask.benchmarks.profile_fit import profile_json
from llumdask.global_scheduler import GlobalScheduler
from llumdask.load import InstanceLoad
from llumdask.request import Priority

# Round numbers: a lone 100-token sequence decodes in 10 + 1 + 1 = 12 ms; every 100 batched tokens
# add 1 + 1 = 2 ms (one more sequence, 100 more context tokens).
TOY = LatencyProfile("toy", 10_000, 16, 1024, PrefillCost(0.001, 1e-5, 0.0), DecodeCost(0.010, 0.001, 1e-5), "made up")


def test_near_ideal_load_and_headroom_by_hand():
    derived = derive_headroom(TOY, tolerance=0.5, sequence_tokens=100)
    # Within 50% of 12 ms is 18 ms: 10 ms + 2 ms per 100 tokens -> 400 tokens.
    assert derived.near_ideal_tokens == 400
    assert derived.tokens == 10_000 - 400
    assert decode_step(TOY, derived.near_ideal_tokens, 100) == pytest.approx(1.5 * decode_step(TOY, 100, 100))
    # A full instance: 10 ms + 2 ms x 100 = 210 ms, 17.5x the lone sequence's 12 ms.
    assert derived.ceiling == pytest.approx(0.210 / 0.012)


def test_a_looser_tolerance_needs_less_headroom():
    tight, loose = derive_headroom(TOY, tolerance=0.05), derive_headroom(TOY, tolerance=0.5)
    assert loose.tokens < tight.tokens
    assert derive_headroom(TOY, tolerance=1e9).tokens == 0  # near-ideal all the way to capacity


@pytest.mark.parametrize("kwargs", [{"tolerance": 0}, {"tolerance": -0.1}, {"sequence_tokens": 0},
                                    {"sequence_tokens": 10_001}])
def test_bad_derivation_inputs_are_refused(kwargs):
    with pytest.raises(ValueError):
        derive_headroom(TOY, **kwargs)


@pytest.mark.parametrize("name", available_profiles())
def test_every_built_in_profile_carries_the_headroom_it_derives(name):
    profile = load_profile(name)
    stored = Headroom.from_dict(profile.headroom)
    assert stored == derive_headroom(profile, tolerance=stored.tolerance, sequence_tokens=stored.sequence_tokens)
    assert profile.headroom_tokens == stored.tokens


def test_profile_headroom_command_prints_and_writes(tmp_path, capsys):
    path = tmp_path / "toy.json"
    path.write_text(profile_json(TOY))
    assert profile_main(["headroom", "--profile", str(path), "--tolerance", "0.5", "--sequence-tokens", "100",
                         "--write", str(path)]) == 0
    out = capsys.readouterr().out
    assert "headroom 9,600 tokens" in out and "17.500x" in out
    assert json.loads(path.read_text())["headroom"]["tokens"] == 9600
    assert load_profile(path).headroom_tokens == 9600


@pytest.mark.parametrize("content", [None, "{", '{"name": "toy"}'])
def test_profile_headroom_rejects_a_write_file_it_cannot_read_before_printing(content, tmp_path, capsys):
    path = tmp_path / "toy.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        profile_main(["headroom", "--profile", "llama-7b-a10", "--write", str(path)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "--write" in captured.err and captured.out == ""


@pytest.mark.parametrize("tolerance", ["inf", "nan", "0", "-0.1"])
def test_profile_headroom_needs_a_finite_positive_tolerance(tolerance, capsys):
    with pytest.raises(SystemExit) as exc:
        profile_main(["headroom", "--profile", "llama-7b-a10", "--tolerance", tolerance])
    assert exc.value.code == 2
    assert "--tolerance" in capsys.readouterr().err


def test_a_profile_with_a_bad_headroom_is_refused(tmp_path):
    data = json.loads(profile_json(TOY)) | {"headroom": {"tokens": 20_000}}
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="headroom.tokens"):
        load_profile(path)


def _headroom_blocks(config: LlumdaskConfig, derived: int | None) -> float:
    """The headroom an instance registered with `derived` tokens carries, read off its freeness."""
    gs = GlobalScheduler(config)
    gs.register_instance("i", 1000, 16, 0.0, derived)
    gs.mark_ready("i", 0.0)
    gs.report(InstanceLoad("i", 1000, 16, 990, 1, 0, running_blocks={Priority.HIGH: 10},
                           running_count={Priority.HIGH: 1}), 0.0)
    return 1000 - 10 - gs.freeness("i")


def test_the_scheduler_takes_the_profiles_headroom_unless_configured():
    default = LlumdaskConfig()
    assert _headroom_blocks(default, 1600) == 100
    assert _headroom_blocks(default, None) == 0  # no profile (vLLM)
    configured = LlumdaskConfig(headroom_tokens={Priority.HIGH: 320, Priority.NORMAL: 0})
    assert _headroom_blocks(configured, 1600) == 20
    with pytest.raises(ValueError, match="high_priority_headroom"):
        _headroom_blocks(default, -1)
