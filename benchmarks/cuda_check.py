"""The CUDA side of live migration on a GPU machine, in one run: tests, transfer speed, end to end.

1. `tests/cuda`: stages round-trip bit-exactly in vLLM's KV layout (bf16, fp16, several layers),
   exports and imports never wait on the engine's stream, and sim engines with their KV on the GPU
   migrate to the tokens they make in place, to and from CPU instances;
2. `llumdask.benchmarks.cuda_staging`: device->host and host->device GB/s of the side-stream path
   against a plain copy and against the link's limit (a pinned `copy_`), and the slowdown of a
   loop of matrix products while stages are exported beside it;
3. `llumdask.benchmarks.migration --gpus 0`: two sim-engine instances with CUDA KV sharing one GPU
   in a `LocalCUDACluster` migrate requests of 256-8192 tokens (staged and blocking, side by
   side); tokens checked against the same requests unmigrated; downtime against length; then the
   same with the KV in host memory on the same machine (OUT/cpu/), the reference for the CUDA run.

Each step runs with its own time limit and its output in OUT/STEP.log; a step that fails does not
stop the next. A short summary is printed last.

    python -m llumdask.benchmarks.cuda_check --out DIR [--quick] [--tests tests/cuda]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from llumdask.benchmarks.common import parser


def steps(out: Path, quick: bool, tests: Path) -> dict[str, tuple[list[str], float]]:
    python = sys.executable
    lengths = "256,2048" if quick else "256,512,1024,2048,4096,8192"
    return {
        "tests": ([python, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-o", "addopts=",
                   str(tests)], 180.0),
        "staging": ([python, "-m", "llumdask.benchmarks.cuda_staging", "--out", str(out)]
                    + (["--quick"] if quick else []), 180.0),
        "migration": ([python, "-m", "llumdask.benchmarks.migration", "--gpus", "0", "--out", str(out),
                       "--lengths", lengths, "--repeats", "1" if quick else "2"], 300.0),
        # The same with the KV in host memory, on the same machine: the reference for the above.
        "migration_cpu": ([python, "-m", "llumdask.benchmarks.migration", "--out", str(out / "cpu"),
                           "--lengths", lengths, "--repeats", "1" if quick else "2"], 300.0),
    }


def run_step(name: str, command: list[str], limit: float, out: Path) -> dict:
    started = time.monotonic()
    log = out / f"{name}.log"
    with log.open("w") as sink:
        try:
            code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.monotonic() - started
    tail = log.read_text().splitlines()[-25:]
    print(f"---- {name}: exit {code} in {seconds:.0f} s\n" + "\n".join(tail), flush=True)
    return {"step": name, "exit": code, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, default=Path("tests/cuda"), help="the CUDA tests (default tests/cuda)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_step(name, command, limit, args.out) for name, (command, limit) in steps(args.out, args.quick, args.tests).items()]
    (args.out / "cuda_check.json").write_text(json.dumps(results, indent=1) + "\n")
    print("== cuda_check: " + ", ".join(f"{r['step']} exit {r['exit']} ({r['seconds']:.0f} s)" for r in results))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
