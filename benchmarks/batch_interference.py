"""Interactive latency beside a batch job: gateway TTFT and TPOT with and without `llm.map` running.

`llumdask serve --engine sim --instances N` with sim instances that take their modelled step time
(`--real-time`, the llama-7b-a10 profile), so that a batch job competes with interactive requests
for the instances' steps and memory as it would on GPUs. The official `openai` client sends
interactive requests arriving at `--rate` a second (Poisson; benchmarks/openai_load.py), or keeps
`--streams` busy, for `--seconds` in three phases: alone; while a batch job scores prompts at
normal priority through the notebook client on the same cluster
(`llumdask.connect(scheduler).map(bag)`, bags of `--batch-prompts` text prompts resubmitted until
the window ends) with the interactive requests at high priority; and the same with them at normal
priority, as a user who sets no priority gets. The phases rotate for `--repeats` rounds. The ratio
columns are each busy phase over "alone"; the batch job's throughput is beside them.

What the policy predicts is printed beside them: the same cluster in the simulator on its virtual
clock (`predicted`), offered each phase's measured rates as Poisson arrivals (interactive requests
at the rate they completed, batch prompts at the rate they were scored). The simulator has no
gateway, no HTTP clients and no cores to share; the measured run has all three. Closed-loop
streams compare less well with it: a stream sends its next request as its last token arrives,
just after a step of the instance that served it began, so that request waits most of a step
where a Poisson arrival waits half of one on average.

    python -m llumdask.benchmarks.batch_interference --out DIR [--rate 3.6 | --streams 4] [--seconds 20]
        [--repeats 2] [--batch-prompts 64]
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Any

import dask.bag as db
import numpy as np

from llumdask.benchmarks.common import parser, ratio, report, summarize
from llumdask.benchmarks.openai_load import Level, Run, Workload, row
from llumdask.benchmarks.servers import llumdask_serve, serving
from llumdask.api.client import connect
from llumdask.api.gateway.tokenizer import load_tokenizer
from llumdask.config import load_config
from llumdask.request import Priority
from llumdask.sim.run import make_spec, run_cluster
from llumdask.sim.workload import TraceRequest, arrivals_within
from llumdask.tiny_model import build_tiny_model, default_model_dir

MODEL = "llumdask-tiny-llama"
COLUMNS = (
    ("phase", "phase", "{}"),
    ("successful", "interactive requests", "{}"),
    ("errored", "errors", "{}"),
    ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_mean_ms", "TPOT mean ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("batch_prompts_per_s", "batch prompts/s", "{:.2f}"),
    ("ttft_p99_ratio", "TTFT p99 / alone", "{:.2f}"),
    ("tpot_p99_ratio", "TPOT p99 / alone", "{:.2f}"),
    ("predicted_ttft_p99_ratio", "predicted TTFT p99 / alone", "{:.2f}"),
    ("predicted_tpot_p99_ratio", "predicted TPOT p99 / alone", "{:.2f}"),
)
# Simulated seconds of each phase's prediction.
PREDICTED_SECONDS = 300.0
# Each phase: the interactive requests' priority, and whether the batch job runs beside them.
PHASES = {"alone": ("high", False), "batch, interactive high": ("high", True), "batch, interactive normal": ("normal", True)}


class BatchJob:
    """Bags of prompts scored one after another on a thread until `stop`; counts what finished."""

    def __init__(self, scheduler: str, prompts: int, max_tokens: int) -> None:
        self._llm = connect(scheduler)
        self.prompts = [f"Batch row {k}: summarize the review" for k in range(prompts)]
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.scored = 0
        self.failed = 0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            bag = self._llm.map(db.from_sequence(self.prompts, npartitions=4), max_tokens=self._max_tokens,
                                ignore_eos=True)
            for result in self._llm.dask_client.compute(bag).result():
                if isinstance(result, BaseException):
                    self.failed += 1
                else:
                    self.scored += 1

    def close(self) -> None:
        self._llm.close()


def predicted(rows: list[dict[str, Any]], instances: int, interactive: tuple[int, int], batch: tuple[int, int],
              seed: int = 0) -> list[dict[str, float]]:
    """Each phase's interactive TTFT and TPOT (ms; mean and P99) in the simulator, which runs the
    production scheduler and llumlets on a virtual clock: Poisson arrivals at the phase's measured
    rates, `interactive` and `batch` (prompt, output) tokens, the default configuration."""
    spec = make_spec("llumnix", instances, base=load_config())
    predictions = []
    for r in rows:
        rng = np.random.default_rng(seed)
        priority = Priority[PHASES[r["phase"]][0].upper()]
        workload = _poisson(rng, r["achieved_rps"], *interactive, priority)
        workload += _poisson(rng, r["batch_prompts_per_s"], *batch, Priority.NORMAL)
        outcome, _ = run_cluster(spec, sorted(workload, key=lambda w: w.arrival))
        mine = [q for q in outcome.requests if q.execution_priority is priority
                and q.sampling.max_tokens == interactive[1] and len(q.prompt_token_ids) == interactive[0]]
        ttft = summarize((q.timing.prefill_latency for q in mine), 1e3)
        tpot = summarize((q.timing.decode_latency(q.num_output_tokens) for q in mine), 1e3)
        predictions.append({"ttft_mean_ms": ttft["mean"], "ttft_p99_ms": ttft["p99"],
                            "tpot_mean_ms": tpot["mean"], "tpot_p99_ms": tpot["p99"]})
    return predictions


def _poisson(rng: np.random.Generator, rate: float, prompt: int, output: int, priority: Priority) -> list[TraceRequest]:
    if rate <= 0:
        return []
    return [TraceRequest(float(t), prompt, output, priority) for t in arrivals_within(rng, rate, PREDICTED_SECONDS)]


def scheduler_address(log: Path) -> str:
    found = re.search(r"scheduler:\s+(tcp://\S+)", log.read_text())
    if found is None:
        raise RuntimeError(f"no scheduler address in {log}")
    return found.group(1)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=2)
    interactive = p.add_mutually_exclusive_group()
    interactive.add_argument("--rate", type=float, default=3.6, help="interactive requests a second (Poisson)")
    interactive.add_argument("--streams", type=int, help="interactive streams kept busy instead (a closed loop)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase and round")
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--batch-prompts", type=int, default=64, help="prompts per bag the batch job scores")
    p.add_argument("--batch-tokens", type=int, default=64, help="tokens each batch prompt generates")
    args = p.parse_args(argv)
    if args.rate <= 0 or (args.streams is not None and args.streams < 1):
        p.error("--rate and --streams must be positive")
    if args.quick:
        args.seconds, args.repeats, args.settle = 5.0, 1, 1.0
    model_dir = str(build_tiny_model(default_model_dir()))
    tokenizer = load_tokenizer(model_dir)
    work = Workload(MODEL, tokenizer.vocab_size, args.prompt_tokens, args.output_tokens)
    log = args.logs / "batch_interference" / "serve.log"
    command = llumdask_serve("--engine", "sim", "--instances", str(args.instances), "--model", model_dir,
                             "--served-model-name", MODEL, "--real-time")
    level = Level(streams=args.streams) if args.streams else Level(rate=args.rate)
    runs: dict[str, list[Run]] = {phase: [] for phase in PHASES}
    scored = dict.fromkeys(PHASES, 0)
    batch_seconds = dict.fromkeys(PHASES, 0.0)
    with serving(command, log) as url:
        job = BatchJob(scheduler_address(log), args.batch_prompts, args.batch_tokens)
        try:
            number = 0
            for round_ in range(args.repeats):
                order = list(PHASES)[round_ % 3:] + list(PHASES)[:round_ % 3]
                for phase in order:
                    priority, with_batch = PHASES[phase]
                    if with_batch:
                        before = job.scored
                        job.start()
                        time.sleep(args.settle)  # the batch fills the instances first
                        began = time.perf_counter()
                    run = asyncio.run(level.run(url, dataclasses.replace(work, priority=priority), args.seconds,
                                                args.settle, number))
                    number += len(run.samples) + len(run.errors)
                    if with_batch:
                        job.stop()
                        batch_seconds[phase] += time.perf_counter() - began
                        scored[phase] += job.scored - before
                    runs[phase].append(run)
        finally:
            job.close()
    rows: list[dict[str, Any]] = [
        {"phase": phase, **row(args.streams or args.rate, phase_runs),
         "batch_prompts_per_s": scored[phase] / batch_seconds[phase] if batch_seconds[phase] else 0.0}
        for phase, phase_runs in runs.items()]
    batch_prompt_tokens = round(float(np.mean([len(tokenizer.encode(t)) for t in job.prompts])))
    predictions = predicted(rows, args.instances, (args.prompt_tokens, args.output_tokens),
                            (batch_prompt_tokens, args.batch_tokens))
    for r, prediction in zip(rows, predictions):
        r["predicted"] = prediction
    alone = rows[0]
    for r in rows:
        for key in ("ttft_p99", "tpot_p99", "ttft_mean", "tpot_mean"):
            r[f"{key}_ratio"] = ratio(r[f"{key}_ms"], alone[f"{key}_ms"])
            r[f"predicted_{key}_ratio"] = ratio(r["predicted"][f"{key}_ms"], alone["predicted"][f"{key}_ms"])
    facts = {"instances": args.instances, "engine": "sim (real time, llama-7b-a10)", "interactive": str(level),
             "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "seconds": args.seconds,
             "repeats": args.repeats, "batch_prompts_per_bag": args.batch_prompts, "batch_tokens": args.batch_tokens,
             "batch_scored": job.scored, "batch_failed": job.failed}
    notes = [f"{r['phase']} / alone: TTFT mean {r['ttft_mean_ratio']:.2f}x, P99 {r['ttft_p99_ratio']:.2f}x; "
             f"TPOT mean {r['tpot_mean_ratio']:.2f}x, P99 {r['tpot_p99_ratio']:.2f}x" for r in rows[1:]]
    notes += [f"{r['phase']} / alone, predicted by the simulator at the measured rates: TTFT mean "
              f"{r['predicted_ttft_mean_ratio']:.2f}x, P99 {r['predicted_ttft_p99_ratio']:.2f}x; TPOT mean "
              f"{r['predicted_tpot_mean_ratio']:.2f}x, P99 {r['predicted_tpot_p99_ratio']:.2f}x" for r in rows[1:]]
    notes.append("the load generator, the gateway, the scheduler and the instances share the machine's cores")
    report("batch_interference", args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
