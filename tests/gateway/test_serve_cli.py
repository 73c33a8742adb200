"""`llumdask serve` options, without starting anything."""

from __future__ import annotations

import pytest

from llumdask.api.serve import banner, build_parser, engine_overrides, parse_engine_args, serve_main


def test_defaults_are_two_instances_on_localhost_8000():
    args = build_parser().parse_args([])
    assert (args.instances, args.host, args.port, args.scheduler) == (2, "127.0.0.1", 8000, None)


def test_engine_options_pass_through_as_typed_values():
    assert parse_engine_args(["--total-blocks", "128", "--real-time", "--max_num_seqs=8", "--profile", "x"]) == {
        "total-blocks": 128, "real-time": True, "max-num-seqs": 8, "profile": "x"}
    with pytest.raises(ValueError, match="'stray'"):
        parse_engine_args(["stray"])


def test_sim_instances_draw_tokens_the_tokenizer_can_decode():
    assert engine_overrides("sim", "/m", 512, {"total-blocks": 64}) == {
        "engine": "sim", "sim-engine": {"vocab-size": 512, "total-blocks": 64}}


def test_bad_options_exit_2_naming_the_problem(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the tiny model is built there
    assert serve_main(["--port", "0", "--no-such-key", "1"]) == 2
    assert "llumdask.sim-engine.no-such-key is not a known key" in capsys.readouterr().err
    assert serve_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--instances", "0"])
    assert exit_.value.code == 2


def test_banner_shows_urls_and_a_working_curl():
    text = banner("m", "2 sim instances", "http://127.0.0.1:8000", "tcp://127.0.0.1:1", "http://127.0.0.1:8787/status",
                  needs_key=True)
    assert "http://127.0.0.1:8000/v1" in text and "http://127.0.0.1:8787/status" in text
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert 'Authorization: Bearer $LLUMDASK_API_KEY' in text and '"model": "m"' in text
