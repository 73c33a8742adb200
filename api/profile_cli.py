"""``llumdask profile``: latency profiles for the simulator, from measurements.

Subcommands:
  fit-vidur   fit a profile to GPU operator tables from Vidur's profiler (mlp.csv, attention.csv)
  measure     measure a real engine's step times over a grid and fit a profile to them
  headroom    derive the high-priority headroom from a profile (and store it in the profile)

fit-vidur and measure write a profile JSON that ``--profile PATH`` (or, once under
llumdask/engine/profiles/, ``--profile NAME``) loads.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from llumdask.api.argtypes import non_negative, positive
from llumdask.engine.headroom import DEFAULT_SEQUENCE_TOKENS, DEFAULT_TOLERANCE, decode_step, derive_headroom
from llumdask.engine.latency import LatencyProfile, load_profile
from llumdask.benchmarks.profile_measure import GRIDS
from llumdask.benchmarks.profile_fit import (
    DEFAULT_CPU_OVERHEAD_S,
    DEFAULT_MEMORY_BYTES,
    FitOptions,
    FitQuality,
    fit_vidur,
    profile_json,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llumdask profile", description="Build latency profiles for the simulator from measurements.")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND", title="subcommands")
    fit = commands.add_parser(
        "fit-vidur",
        help="fit a profile to Vidur's GPU operator tables",
        description="Fit prefill and decode step-time coefficients to Vidur's per-operator GPU timings "
        "(mlp.csv and attention.csv, plain or .xz) and write the profile JSON, its derivation included.",
    )
    fit.add_argument("--data", required=True, type=Path, help="folder holding mlp.csv[.xz] and attention.csv[.xz]")
    fit.add_argument("--out", required=True, type=Path, help="profile JSON to write; its file name (without .json) is the profile's name")
    fit.add_argument("--layers", type=positive(int), help="transformer layers (the tables profile one); default: known from the model shape")
    fit.add_argument("--parameters", type=positive(int), help="model parameters, for the weights' memory; default: known from the model shape")
    fit.add_argument("--memory-bytes", type=positive(int), default=DEFAULT_MEMORY_BYTES,
                     help="device memory for weights + KV cache (default: %(default)s, that of the LLaMA-7B A10 profile)")
    fit.add_argument("--cpu-overhead-s", type=non_negative(float), default=DEFAULT_CPU_OVERHEAD_S,
                     help="fixed CPU cost per step, seconds (default: %(default)s, as the A10 profiles)")
    fit.add_argument("--device", help="the GPU the tables were measured on, for the derivation text")
    fit.set_defaults(run=lambda args: _fit_vidur(args, fit))
    measure = commands.add_parser(
        "measure",
        help="measure a real engine and fit a profile",
        description="Drive a real engine step by step over a grid of prompt lengths (prefill) and batch sizes x "
        "context tokens (decode), fit the profile's coefficients to the median step times and write the profile JSON.",
    )
    measure.add_argument("--engine", choices=("vllm",), default="vllm", help="the engine to measure (default: %(default)s)")
    measure.add_argument("--model", help="model directory or hub name (default: the configured one, else the offline tiny model)")
    measure.add_argument("--out", type=Path, default=Path("measured.json"),
                         help="profile JSON to write; its file name (without .json) is the profile's name (default: %(default)s)")
    measure.add_argument("--grid", choices=tuple(GRIDS), default="quick", help="how much to measure (default: %(default)s)")
    measure.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    measure.set_defaults(run=lambda args: _measure(args, measure))
    headroom = commands.add_parser(
        "headroom",
        help="derive the high-priority headroom from a profile",
        description="The paper's headroom (section 4.4.1): the batched-token load at which a decode step is within "
        "--tolerance of a lone sequence's, and capacity minus it; prints it with the ceiling speedup the profile "
        "allows (a full instance's step over a lone sequence's).",
    )
    headroom.add_argument("--profile", required=True, help="profile name or JSON path")
    headroom.add_argument("--tolerance", type=positive(float), default=DEFAULT_TOLERANCE,
                          help="near-ideal: a step at most this fraction slower than a lone sequence's (default: %(default)s)")
    headroom.add_argument("--sequence-tokens", type=positive(int), default=DEFAULT_SEQUENCE_TOKENS,
                          help="tokens per sequence of the batch, lone one included (default: %(default)s)")
    headroom.add_argument("--write", type=Path, help="store the headroom in this profile JSON (the profile's own file)")
    headroom.set_defaults(run=lambda args: _headroom(args, headroom))
    return parser


def _headroom(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        profile = load_profile(args.profile)
        derived = derive_headroom(profile, tolerance=args.tolerance, sequence_tokens=args.sequence_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    stored: LatencyProfile | None = None  # read before printing: a bad --write fails with no output
    if args.write is not None:
        try:
            stored = replace(load_profile(args.write), headroom=derived.to_dict())
        except (ValueError, OSError) as exc:
            parser.error(f"--write: {exc}")
        if stored.name != profile.name:
            parser.error(f"--write {args.write} holds profile {stored.name!r}, not {profile.name!r}")
    lone = decode_step(profile, args.sequence_tokens, args.sequence_tokens)
    print(f"profile {profile.name}: capacity {profile.capacity_tokens:,} tokens; sequences of {args.sequence_tokens} tokens")
    print(f"lone sequence decode step {lone * 1e3:.2f} ms; near-ideal (within {args.tolerance:.0%}) up to "
          f"{derived.near_ideal_tokens:,} batched tokens")
    print(f"headroom {derived.tokens:,} tokens (capacity - near-ideal load)")
    print(f"ceiling: a full instance's step is {derived.ceiling:.3f}x a lone sequence's (the most a high-priority request gains)")
    if stored is not None:
        args.write.write_text(profile_json(stored))
        print(f"wrote {args.write}")
    return 0


def _write(out: Path, profile: LatencyProfile, prefill: FitQuality, decode: FitQuality) -> int:
    out.write_text(profile_json(profile))
    print(f"wrote {out}: capacity {profile.capacity_tokens:,} tokens, KV {profile.model_kv_bytes_per_token:,} B/token")
    print(f"prefill: {prefill.describe()}")
    print(f"decode:  {decode.describe()}")
    return 0


def _fit_vidur(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    options = FitOptions(name=args.out.stem, layers=args.layers, parameters=args.parameters,
                         memory_bytes=args.memory_bytes, cpu_overhead_s=args.cpu_overhead_s, device=args.device)
    try:
        result = fit_vidur(args.data, options)
    except ValueError as exc:
        parser.error(str(exc))
    return _write(args.out, result.profile, result.prefill, result.decode)


def _measure(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    from llumdask.config import load_config
    from llumdask.engine.vllm.factory import create_engine, resolve_model
    from llumdask.benchmarks.profile_measure import fit_measured, measure

    config = load_config().vllm_engine
    if args.model is not None:
        config = replace(config, model=args.model)
    model = resolve_model(config)
    engine = create_engine(config)
    try:
        measurement = measure(engine, GRIDS[args.grid], seed=args.seed)
        result = fit_measured(engine, measurement, name=args.out.stem, model=model, grid_name=args.grid)
    except ValueError as exc:
        parser.error(str(exc))
    finally:
        engine.close()
    return _write(args.out, result.profile, result.prefill, result.decode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return args.run(args)
