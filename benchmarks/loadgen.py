"""Load from a real load tool: GuideLLM (``pip install guidellm``) against an OpenAI server.

`run_guidellm` writes a GuideLLM scenario (synthetic prompts of a fixed token count from the
model's own tokenizer, streamed /v1/completions with a fixed output length and ignore_eos, one
sub-benchmark per offered constant request rate, each bounded in seconds), runs the `guidellm`
command offline, and reduces its JSON report to one row per rate.

GuideLLM depends on torch, and a plain `pip install guidellm` pulls the multi-GB CUDA build;
benchmarks/README.md shows how to install it next to the project's CPU torch instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GUIDELLM_VENV = Path(".venv-guidellm/bin/guidellm")


@dataclass(frozen=True)
class Load:
    """Constant request rates to offer, one level after another.

    Each level runs `settle + seconds + settle`; only the middle `seconds` are measured, so that
    requests still starting up or cut off at the end (a level stops at its time limit) do not
    count: a sustained rate then completes as many requests per second as it offers.
    """

    rates: tuple[float, ...]
    seconds: float
    prompt_tokens: int
    output_tokens: int
    settle: float = 5.0


def add_load_options(p: argparse.ArgumentParser, *, seconds: float, settle: float, prompt: int, output: int) -> None:
    p.add_argument("--seconds", type=float, default=seconds, help="measured seconds of each level")
    p.add_argument("--settle", type=float, default=settle, help="unmeasured seconds before and after each level")
    p.add_argument("--prompt", type=int, default=prompt, help="prompt tokens")
    p.add_argument("--output", type=int, default=output, help="output tokens per request")


def load_from(args: argparse.Namespace, rates: list[int]) -> Load:
    """The Load the options describe; --quick keeps the first two rates, 6 s each."""
    if args.quick:
        return Load(tuple(rates[:2]), 6.0, args.prompt, args.output, settle=3.0)
    return Load(tuple(rates), args.seconds, args.prompt, args.output, settle=args.settle)


def find_guidellm(explicit: str | None) -> str:
    """The guidellm command: --guidellm, else on PATH, else .venv-guidellm/bin/guidellm."""
    found = explicit or shutil.which("guidellm") or (str(GUIDELLM_VENV) if GUIDELLM_VENV.exists() else None)
    if found is None:
        raise SystemExit("guidellm not found: install it as benchmarks/README.md shows, or pass --guidellm PATH")
    return found


def scenario(target: str, model: str, tokenizer_dir: str, load: Load, output: Path) -> dict[str, Any]:
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model,
                        "request_format": "/v1/completions"},
            "profile": {"kind": "constant", "warmup": {"value": load.settle, "mode": "duration"},
                        "cooldown": {"value": load.settle, "mode": "duration"}},
            "data": [{"kind": "synthetic_text", "prompt_tokens": load.prompt_tokens,
                      "output_tokens": load.output_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
            "constraints": [{"kind": "max_duration", "seconds": load.seconds + 2 * load.settle}],
            "outputs": [{"kind": "json", "path": str(output)}],
        },
        "benchmarks": [{"profile.rate": rate} for rate in load.rates],
    }


def run_guidellm(guidellm: str, target: str, model: str, tokenizer_dir: str, load: Load,
                 work_dir: Path) -> list[dict[str, Any]]:
    """Run the scenario; rows of offered load, achieved rate, TTFT/TPOT/ITL (ms) and request counts."""
    work_dir = work_dir.resolve()  # guidellm runs in it
    work_dir.mkdir(parents=True, exist_ok=True)
    report = work_dir / "guidellm.json"
    spec = work_dir / "scenario.json"
    spec.write_text(json.dumps(scenario(target, model, tokenizer_dir, load, report), indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # One load-generating process: these machines have two cores for everything.
           "GUIDELLM__MAX_WORKER_PROCESSES": "1",
           "GUIDELLM__LOGGING__LOG_FILE": str(work_dir / "guidellm.log")}
    with (work_dir / "guidellm.out").open("w") as out:
        done = subprocess.run([guidellm, "run", "--scenario", str(spec), "--disable-progress"], env=env,
                              stdout=out, stderr=subprocess.STDOUT, cwd=work_dir, check=False)
    if done.returncode != 0 or not report.exists():
        tail = "\n".join((work_dir / "guidellm.out").read_text().splitlines()[-20:])
        raise RuntimeError(f"guidellm failed with status {done.returncode}:\n{tail}")
    return [summary_row(b) for b in json.loads(report.read_text())["benchmarks"]]


def summary_row(benchmark: dict[str, Any]) -> dict[str, Any]:
    """One GuideLLM benchmark as a flat row; latencies of successful requests only."""
    metrics = benchmark["metrics"]
    strategy = benchmark["config"]["strategy"]
    totals = metrics["request_totals"]

    def stat(name: str, which: str) -> float | None:
        summary = metrics[name]["successful"]
        if not summary["count"]:
            return None
        return summary["mean"] if which == "mean" else summary["percentiles"][which]

    offered = strategy["rate"]
    achieved = stat("requests_per_second", "mean")
    return {
        "offered": offered,
        "achieved_rps": achieved,
        "achieved_over_offered": None if achieved is None else achieved / offered,
        "successful": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
        "ttft_mean_ms": stat("time_to_first_token_ms", "mean"), "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
        # TPOT as vLLM's benchmarks define it: (latency - TTFT) / (output tokens - 1), which
        # GuideLLM calls inter-token latency (its own "TPOT" spreads the TTFT over every token).
        "tpot_mean_ms": stat("inter_token_latency_ms", "mean"), "tpot_p99_ms": stat("inter_token_latency_ms", "p99"),
        "latency_mean_ms": _ms(stat("request_latency", "mean")), "latency_p99_ms": _ms(stat("request_latency", "p99")),
        "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
        "duration_s": benchmark["duration"],
        "error_messages": sorted({str(r["info"].get("error"))[:300] for r in benchmark["requests"]["errored"]}),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
