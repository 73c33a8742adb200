"""What every benchmark shares: its command line, latency summaries, the printed table and JSON.

Each benchmark compares its variants inside one run (interleaved where it can), because these
machines are noisy: the ratios printed side by side are the result, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from llumdask.api.bench import format_table
from llumdask.engine.base import Engine
from llumdask.request import Request
from llumdask.sim.run import write_json

Column = tuple[str, str, str]


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --out DIR for its JSON, --logs DIR for servers' and load
    tools' files, --quick for a smoke-sized run."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                   help="directory for NAME.json (default benchmarks/results)")
    p.add_argument("--logs", type=Path, default=Path("out/benchmarks"),
                   help="directory for server logs and load-tool reports (default out/benchmarks, git-ignored)")
    p.add_argument("--quick", action="store_true", help="a much smaller run, to check that it works")
    return p


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """mean, p50, p99, max and count of `values` times `scale` (None when there are none)."""
    data = np.fromiter(values, dtype=np.float64) * scale
    if data.size == 0:
        return {"mean": None, "p50": None, "p99": None, "max": None, "n": 0}
    return {"mean": float(data.mean()), "p50": float(np.percentile(data, 50)),
            "p99": float(np.percentile(data, 99)), "max": float(data.max()), "n": int(data.size)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def model_shape(text: str) -> tuple[int, int]:
    """"8x768" -> (layers, hidden): a random Llama-like model's shape (tiny_model.build_llama_like)."""
    try:
        layers, hidden = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYERSxHIDDEN such as 8x768, got {text!r}") from None
    if layers < 1 or hidden < 64 or hidden % 64:
        raise argparse.ArgumentTypeError(f"need at least one layer and a hidden size that is a multiple of 64, got {text!r}")
    return layers, hidden


@dataclass(frozen=True)
class BenchModel:
    """The model a benchmark serves: the offline tiny one, or a larger random Llama (--shape)."""

    path: str
    label: str
    suffix: str  # added to the results file's name, so that runs of both models sit side by side


def bench_model(shape: tuple[int, int] | None) -> BenchModel:
    """Build (or find) the model for `--shape` (None: the offline tiny model). Imported here:
    the benchmarks without a model need not load the tokenizer and safetensors libraries."""
    from llumdask.tiny_model import build_llama_like, build_tiny_model, default_model_dir

    if shape is None:
        return BenchModel(str(build_tiny_model(default_model_dir())), "offline tiny llama", "")
    layers, hidden = shape
    return BenchModel(str(build_llama_like(layers, hidden)), f"random llama {layers}x{hidden}", f"_{layers}x{hidden}")


def float_list(text: str) -> list[float]:
    """"0.5,2" -> [0.5, 2.0]; for list-valued options."""
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need positive numbers separated by commas, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]; for list-valued options."""
    values = [int(s) for s in text.split(",") if s.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers separated by commas, got {text!r}")
    return values


def seed_range(text: str) -> list[int]:
    """"0-9" or "0,3,5" -> the seeds."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST or distinct comma-separated seeds >= 0, got {text!r}")
    return seeds


def times(value: float | None) -> str:
    """A ratio for a sentence: 1.23x, or - when undefined."""
    return "-" if value is None else f"{value:.2f}x"


def tokens_alone(engine: Engine, request: Request) -> list[int]:
    """The tokens `request` yields run alone on `engine` to its end, never migrated: what a
    migrated run must reproduce."""
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    return list(request.output_token_ids)


def report(name: str, out: Path, rows: Sequence[dict[str, Any]], columns: Sequence[Column],
           facts: dict[str, Any], notes: Sequence[str] = (), extra: dict[str, Any] | None = None) -> Path:
    """Print the facts, the table and the notes; write out/NAME.json with all of them, and with
    `extra` (data too long to print) beside them."""
    print(f"== {name}: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    print(format_table(rows, columns))
    for note in notes:
        print(note)
    path = out / f"{name}.json"
    write_json(path, {"benchmark": name, "facts": facts, "rows": list(rows), "notes": list(notes),
                      "machine": machine(), **(extra or {})})
    print(f"wrote {path}")
    return path


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(), "time": time.time()}
