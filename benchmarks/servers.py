"""OpenAI-compatible servers run as child processes on 127.0.0.1 for the gateway benchmarks.

`serving` starts a command that takes `--host 127.0.0.1 --port PORT` (``llumdask serve``,
``vllm serve``), waits until its /health answers 200, yields the base URL, and stops it with
SIGINT (both shut down cleanly on it), then SIGKILL if it hangs. The port is a free one the
system picked a moment before the server binds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(command: Sequence[str], log: Path, timeout: float = 600.0,
            env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `command --host 127.0.0.1 --port PORT` until the block ends; yield http://127.0.0.1:PORT."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        _wait_healthy(url, proc, log, timeout)
        yield url
    finally:
        _stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text().splitlines()[-20:])
            raise RuntimeError(f"{proc.args[0]} exited with status {proc.returncode}; its log ends:\n{tail}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout} s (log: {log})")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (a local cluster's workers too), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Whatever the server left in its group (worker processes that outlived it) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def serve_process(port: int) -> psutil.Process:
    """The `llumdask serve` process (as `serving` starts it) listening on `port`."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "llumdask.api.serve" in cmdline and str(port) in cmdline:
            return proc
    raise LookupError(f"no llumdask serve process on port {port}")


def tree_rss(process: psutil.Process) -> tuple[int, int]:
    """Resident bytes of `process` and every process below it, and how many there are (the
    `llumdask serve` of a local cluster: gateway, scheduler and workers)."""
    total = count = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
            count += 1
        except psutil.Error:
            continue  # it left between the listing and the reading
    return total, count


def llumdask_serve(*args: str) -> list[str]:
    """The `llumdask serve` command of this interpreter's installation."""
    return [sys.executable, "-m", "llumdask.api.serve", "--dashboard-address", "127.0.0.1:0", *args]
