"""``llumdask bench migration``: live migration's downtime against a blocking copy and recompute.

Two instances in this process, driven by llumlets over the in-process transport (see
benchmarks/migration_engines.py for what is measured and how). ``--engine vllm`` builds a random
Llama model larger than the test model (the default 12 layers, hidden 1024) so that recomputing
a prompt costs what it does on a real model; ``--engine sim`` runs the sim engine in real time
(steps sleep their modelled duration; its KV buffers are real bytes).

The vLLM engines run their torch ops on ``--threads`` threads (default 1, what vLLM sets for
serving in `set_torch_threads_for_runtime`, a call its in-process CPU worker turns into a no-op).
With two threads on a two-core machine that other processes share, every parallel region of a
step waits for whichever thread is descheduled: steps of 27 ms took 200-800 ms next to one busy
process, and a migration's token gap, which contains a step, took whatever step it caught.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from llumdask.api.argtypes import check_out_dir, non_negative, positive
from llumdask.api.bench import format_table as fixed_width
from llumdask.config import LlumdaskConfig, load_config
from llumdask.engine.base import Engine
from llumdask.benchmarks.migration_engines import BenchSettings, LengthResult, MigrationBench, median_result, results_dict

TABLE_COLUMNS = (
    ("length", "length", "{}"),
    ("live_downtime_ms", "live downtime ms", "{:.1f}"),
    ("live_token_gap_ms", "live gap ms", "{:.1f}"),
    ("live_destination_step_ms", "dst step ms", "{:.1f}"),
    ("normal_step_ms", "normal step ms", "{:.1f}"),
    ("live_stages", "stages", "{}"),
    ("live_bytes", "live MiB", "{:.1f}"),
    ("blocking_downtime_ms", "blocking ms", "{:.1f}"),
    ("blocking_token_gap_ms", "blocking gap ms", "{:.1f}"),
    ("recompute_downtime_ms", "recompute ms", "{:.1f}"),
    ("recompute_over_live", "recompute/live", "{:.1f}"),
    ("source_slowdown", "src slowdown", "{:.2f}"),
    ("destination_slowdown", "dst slowdown", "{:.2f}"),
    ("tokens_identical", "identical", "{}"),
    ("load_average", "load", "{:.1f}"),
)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--lengths must be positive integers, got {text!r}")
    return tuple(values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llumdask bench migration",
        description="Migrate one request per prompt length between two instances that decode a background batch; "
        "compare live migration's downtime with a blocking copy and with recomputing on the destination.",
    )
    parser.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--lengths", type=_lengths, default=_lengths("256,1024,2048"), help="prompt lengths, comma-separated")
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json")
    parser.add_argument("--model", help="vllm: model directory (default: a random Llama of --layers x --hidden, built once)")
    parser.add_argument("--layers", type=positive(int), default=12, help="vllm: layers of the built model (default %(default)s)")
    parser.add_argument("--hidden", type=positive(int), default=1024, help="vllm: hidden size of the built model (default %(default)s)")
    parser.add_argument("--kv-cache-mib", type=positive(int), default=1024, help="vllm: KV cache per instance, MiB (default %(default)s)")
    parser.add_argument("--threads", type=positive(int), default=1,
                        help="vllm: torch threads of the engines (default %(default)s: steady steps on a shared machine)")
    parser.add_argument("--background", type=positive(int), default=BenchSettings.background, help="co-running requests per instance")
    parser.add_argument("--output-tokens", type=positive(int), default=BenchSettings.output_tokens,
                        help="tokens the migrated request generates in all")
    parser.add_argument("--last-stage-blocks", type=int, default=None,
                        help="migration.last-stage-blocks for this run (default: the configured value); vLLM's CPU blocks "
                        "hold 128 tokens, so 0 (only the partly filled block in the last stage) matches the default 2 of 16-token blocks")
    parser.add_argument("--repeats", type=positive(int), default=1, help="runs per length; each figure is their median")
    parser.add_argument("--seed", type=non_negative(int), default=0)
    return parser


def _vllm_engines(args: argparse.Namespace, max_len: int) -> tuple[list[Engine], dict[str, Any]]:
    from llumdask.engine.vllm.engine import VllmEngine
    from llumdask.tiny_model import build_llama_like, llama_like_shape

    facts: dict[str, Any] = {"torch_threads": _set_torch_threads(args.threads)}
    model = args.model
    if model is None:
        positions = max(4096, 1 << (max_len - 1).bit_length())  # rope positions: lengths up to max_len
        model = str(build_llama_like(args.layers, args.hidden, positions=positions))
        facts["model_shape"] = asdict(llama_like_shape(args.layers, args.hidden, positions))
    engine_args = {"dtype": "float32", "max_model_len": max_len, "kv_cache_memory_bytes": args.kv_cache_mib * 2**20, "seed": 0}
    facts |= {"model": model, "engine_args": engine_args, "vocab_size": model_vocabulary(model)}
    return [VllmEngine(model, engine_args) for _ in range(2)], facts


def model_vocabulary(model: str) -> int:
    """Token ids a prompt may hold: vLLM rejects any id its tokenizer does not have."""
    from llumdask.api.gateway.tokenizer import load_tokenizer

    return load_tokenizer(model).vocab_size


def _set_torch_threads(threads: int) -> int:
    """Set torch's thread count before vLLM starts (afterwards its CPU worker ignores the
    call); the count in effect, which differs when an engine already ran in this process."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()


def _sim_engines(config: LlumdaskConfig) -> tuple[list[Engine], dict[str, Any]]:
    from llumdask.engine.sim import SimEngine

    sim = replace(config.sim_engine, real_time=True)
    engines = [SimEngine(sim, block_size=config.block_size, clock=time.perf_counter, instance_id=name)
               for name in ("source", "destination")]
    return engines, {"sim_engine": asdict(sim), "vocab_size": sim.vocab_size}  # type: ignore[return-value]


def format_table(rows: Sequence[LengthResult]) -> str:
    return fixed_width([asdict(row) | {"live_bytes": row.live_bytes / 2**20} for row in rows], TABLE_COLUMNS)


def main(argv: Sequence[str], progress: Callable[[str], None] = print) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_out_dir(parser, args.out)
    try:
        settings = BenchSettings(lengths=args.lengths, background=args.background, output_tokens=args.output_tokens,
                                 seed=args.seed, repeats=args.repeats)
    except ValueError as exc:
        parser.error(str(exc).replace("output tokens", "--output-tokens", 1))
    config = load_config()
    if args.last_stage_blocks is not None:
        if args.last_stage_blocks < 0:
            parser.error(f"--last-stage-blocks must be >= 0, got {args.last_stage_blocks}")
        config = replace(config, migration=replace(config.migration, last_stage_blocks=args.last_stage_blocks))
    if args.engine == "vllm":
        engines, facts = _vllm_engines(args, settings.longest_sequence)
    else:
        engines, facts = _sim_engines(config)
    settings = replace(settings, vocab_size=facts["vocab_size"])  # prompts drawn from the model's vocabulary
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        try:
            bench = MigrationBench(*engines, config=config, settings=settings)
        except ValueError as exc:  # lengths the instances cannot hold
            parser.error(str(exc))
        args.out.mkdir(parents=True, exist_ok=True)  # every option is checked: made before the run, not after
        runs = bench.run(progress)
    finally:
        for engine in engines:
            getattr(engine, "close", lambda: None)()
    facts = {"command": shlex.join(["llumdask", "bench", "migration", *argv]), "engine": args.engine,
             "driver": "two llumlets in one process over InProcessTransport",
             "settings": asdict(settings), "migration": asdict(config.migration), "wall_seconds": time.perf_counter() - started,
             "load_average_before": load_before, "load_average_after": os.getloadavg()[0], **facts}
    results = [median_result(length_runs) for length_runs in runs]
    summary = results_dict(results, runs, facts)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(results))
    print(f"live downtime longest/shortest: {summary['live_downtime_longest_over_shortest']:.2f} (goal <= 1.5), "
          f"token gap {summary['live_token_gap_longest_over_shortest']:.2f}; "
          f"recompute/live token gap at {results[-1].length}: {summary['recompute_over_live_at_longest']:.1f}x (goal >= 20)")
    print(f"wrote {args.out / 'results.json'}")
    return 0
