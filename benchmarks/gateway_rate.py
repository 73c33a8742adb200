"""The highest request rate the gateway sustains: `llumdask serve` with 4 sim instances, GuideLLM load.

`llumdask serve --engine sim --instances 4` (gateway, scheduler and the four worker processes on
this machine's cores, with the load generator) serves the offline tiny model's tokenizer; the sim
engines answer in real time with their latency model. GuideLLM offers a constant request rate
for a bounded time per level (streamed /v1/completions, fixed prompt and output lengths) and
reports what completed. A rate is sustained when at least 95% of it completes per second, no
request fails, and the P99 time to first token stays under --ttft-slo-ms.

    python -m llumdask.benchmarks.gateway_rate --out DIR [--rates 4,8,16,24,32] [--seconds 20] [--guidellm PATH]
"""

from __future__ import annotations

from typing import Any

from llumdask.benchmarks.common import int_list, parser, report
from llumdask.benchmarks.loadgen import add_load_options, find_guidellm, load_from, run_guidellm
from llumdask.benchmarks.servers import llumdask_serve, serving
from llumdask.tiny_model import build_tiny_model, default_model_dir

MODEL = "llumdask-tiny-llama"
SUSTAINED_SHARE = 0.95

COLUMNS = (
    ("offered", "offered req/s", "{:g}"),
    ("achieved_rps", "achieved req/s", "{:.2f}"),
    ("achieved_over_offered", "achieved/offered", "{:.2f}"),
    ("errored", "errors", "{}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_mean_ms", "TPOT mean ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("output_tokens_per_s", "out tok/s", "{:.0f}"),
    ("sustained", "sustained", "{}"),
)


def sustained(row: dict[str, Any], ttft_slo_ms: float) -> bool:
    return (row["achieved_over_offered"] is not None and row["achieved_over_offered"] >= SUSTAINED_SHARE
            and row["errored"] == 0 and row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= ttft_slo_ms)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rates", type=int_list, default=int_list("4,8,16,24,32"), help="offered requests/s")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="P99 TTFT bound of a sustained rate")
    add_load_options(p, seconds=20.0, settle=5.0, prompt=64, output=64)
    p.add_argument("--guidellm", default=None, help="the guidellm command (default: on PATH or .venv-guidellm)")
    args = p.parse_args(argv)
    guidellm = find_guidellm(args.guidellm)
    load = load_from(args, args.rates)
    model_dir = str(build_tiny_model(default_model_dir()))
    work = args.logs / "gateway_rate"  # server log, GuideLLM's scenario, report and log
    command = llumdask_serve("--engine", "sim", "--instances", str(args.instances), "--model", model_dir,
                             "--served-model-name", MODEL)
    with serving(command, work / "serve.log") as url:
        rows = run_guidellm(guidellm, url, MODEL, model_dir, load, work / "guidellm")
    for row in rows:
        row["sustained"] = sustained(row, args.ttft_slo_ms)
    best = max((row["offered"] for row in rows if row["sustained"]), default=None)
    facts = {"instances": args.instances, "engine": "sim", "prompt_tokens": load.prompt_tokens,
             "output_tokens": load.output_tokens, "seconds_per_rate": load.seconds, "client": "guidellm",
             "ttft_slo_ms": args.ttft_slo_ms, "max_sustained_rps": best}
    notes = [f"highest sustained rate: {best if best is not None else 'none of those offered'} req/s "
             f"(>= {SUSTAINED_SHARE:.0%} completed per second, no errors, TTFT P99 <= {args.ttft_slo_ms:.0f} ms)",
             "TPOT = (latency - TTFT) / (output tokens - 1); the load generator shares the machine's cores"]
    notes += [f"errors at {row['offered']:g} req/s: {'; '.join(row['error_messages'])}" for row in rows if row["errored"]]
    report("gateway_rate", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
