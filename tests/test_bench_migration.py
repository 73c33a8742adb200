"""`llumdask bench migration`: arguments, and a small real-time run on the sim engine (real bytes)."""

from __future__ import annotations

import json

import pytest

from llumdask.api.bench import main as bench_main
from llumdask.api.bench_migration import build_parser, model_vocabulary
from llumdask.config import load_config
from llumdask.tiny_model import TinyLlamaShape, build_tiny_model
from llumdask.benchmarks.migration_engines import BenchSettings, LengthResult, Prompts, median_result

ROW_KEYS = set(LengthResult.__dataclass_fields__)


def test_median_of_runs_takes_each_figure_apart():
    def run(downtime: float, stages: int, identical: bool) -> LengthResult:
        return LengthResult(
            length=256, live_downtime_ms=downtime, live_token_gap_ms=downtime + 0.5, live_stages=stages, live_blocks=3,
            live_bytes=100, live_destination_steps=1, live_destination_step_ms=0.5, live_destination_prefill_tokens=1,
            normal_step_ms=0.6, blocking_downtime_ms=8.0, blocking_token_gap_ms=9.0, blocking_bytes=100,
            recompute_downtime_ms=50.0, recompute_over_live=50.0 / downtime, source_slowdown=1.1,
            destination_slowdown=1.2, tokens_identical=identical, blocking_tokens_identical=True, load_average=1.5)

    median = median_result([run(3.0, 2, True), run(1.0, 1, True), run(2.0, 2, False)])
    assert median.live_downtime_ms == 2.0 and median.live_stages == 2 and median.recompute_over_live == 25.0
    assert median.tokens_identical is False and median.blocking_tokens_identical is True


def test_lengths_are_parsed_sorted_and_deduplicated(tmp_path):
    args = build_parser().parse_args(["--lengths", "2048, 256,1024,256", "--out", str(tmp_path)])
    assert args.lengths == (256, 1024, 2048) and args.engine == "vllm"


@pytest.mark.parametrize("lengths", ["", "0,256", "a,b", "-5"])
def test_bad_lengths_are_rejected_naming_the_option(lengths, tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lengths", lengths, "--out", str(tmp_path)])
    assert "--lengths" in capsys.readouterr().err


def test_out_must_be_a_directory(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(SystemExit):
        bench_main(["migration", "--engine", "sim", "--out", str(afile)])
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--background", "0"), ("--background", "-3"), ("--seed", "-1")])
def test_bad_background_and_seed_are_rejected_naming_the_option(option, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["migration", "--engine", "sim", option, value, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [("background", 0), ("background", -3), ("seed", -1)])
def test_bench_settings_need_a_background_batch_and_a_seed_numpy_takes(field, value):
    with pytest.raises(ValueError, match=field):
        BenchSettings(lengths=(64,), **{field: value})


def test_lengths_the_instances_cannot_hold_are_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main(["migration", "--engine", "sim", "--lengths", "10000000", "--out", str(tmp_path)])
    assert "KV blocks" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_too_few_output_tokens_to_outlast_the_move_are_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main(["migration", "--engine", "sim", "--output-tokens", "12", "--out", str(tmp_path)])
    assert "--output-tokens (12) must be at least" in capsys.readouterr().err


def test_negative_last_stage_blocks_are_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_main(["migration", "--engine", "sim", "--last-stage-blocks", "-1", "--out", str(tmp_path)])
    assert "--last-stage-blocks must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_sim_run_writes_every_figure(tmp_path, capsys):
    assert bench_main(["migration", "--engine", "sim", "--lengths", "64,1024", "--background", "1",
                       "--output-tokens", "30", "--last-stage-blocks", "0", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["length"] for row in results["lengths"]] == [64, 1024]
    for row in results["lengths"]:
        assert set(row) == ROW_KEYS
        assert row["tokens_identical"] is True and row["blocking_tokens_identical"] is True
        assert row["live_downtime_ms"] > 0 and row["blocking_downtime_ms"] > 0 and row["live_stages"] >= 1
        assert row["live_bytes"] > 0 and row["blocking_bytes"] > 0
    # Recomputing a 1024-token prompt in the modelled A10 time costs more than the live move.
    assert results["lengths"][1]["recompute_downtime_ms"] > results["lengths"][1]["live_downtime_ms"]
    assert results["migration"]["last_stage_blocks"] == 0
    assert results["settings"]["vocab_size"] == results["vocab_size"] == load_config().sim_engine.vocab_size
    assert {"command", "engine", "settings", "live_downtime_longest_over_shortest", "live_token_gap_longest_over_shortest",
            "recompute_over_live_at_longest",
            "load_average_before", "load_average_after"} <= set(results)
    assert [row["length"] for row in results["runs"]] == [64, 1024]  # one run per length
    for row in results["lengths"]:
        assert row["live_destination_steps"] >= 1 and row["live_downtime_ms"] < row["live_token_gap_ms"]
        assert row["blocking_downtime_ms"] < row["blocking_token_gap_ms"]
    assert "recompute/live" in capsys.readouterr().out


def test_prompts_come_from_the_model_vocabulary(tmp_path):
    # A model with fewer tokens than the settings' default once got prompts it could not read.
    small = build_tiny_model(tmp_path / "small", shape=TinyLlamaShape(vocab_size=300))
    vocabulary = model_vocabulary(str(small))
    assert vocabulary <= 300 < BenchSettings(lengths=(1,)).vocab_size
    assert max(Prompts(vocabulary, seed=0).tokens(5_000)) < vocabulary
