"""Helpers for tests on a real multi-process Dask cluster: references, worker status, leak checks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import dask

from distributed import Client
from distributed.comm import connect as comm_connect
from distributed.protocol import to_serialize
from waiting import wait_until

from llumdask.clusters.instances import worker_statuses
from llumdask.config import LlumdaskConfig
from llumdask.engine.sim import SimEngine
from llumdask.plugins.control import Op
from llumdask.protocol import PreAlloc
from llumdask.request import Request, SamplingParams

# Small instances: 128 blocks of 16 tokens, so that tests stay light and migrations are quick.
CLUSTER_OVERRIDES: dict[str, Any] = {"sim-engine": {"total-blocks": 128}}


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(length)]


def reference_tokens(config: LlumdaskConfig, prompt: list[int], max_tokens: int, **sampling: Any) -> list[int]:
    """The request run alone in-process on the same engine code, with no migration."""
    engine = SimEngine.from_config(config, clock=lambda: 0.0)
    request = Request("reference", list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))
    engine.add_request(request)
    tokens: dict[int, int] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens.update({out.first_index + k: t for k, t in enumerate(out.token_ids)})
    return [tokens[i] for i in range(len(tokens))]


def assert_workers_clean(client: Client, timeout: float = 20.0) -> None:
    """Every instance idle, no migration in flight, all blocks free, integrity intact."""
    def idle() -> bool:
        return all(not s["has_work"] and s["migrations_in_flight"] == 0 for s in worker_statuses(client).values())

    wait_until(idle, timeout, what="all instances idle")
    for worker, status in worker_statuses(client).items():
        assert status["integrity_error"] is None, f"{worker}: {status['integrity_error']}"
        assert status["free_blocks"] == status["total_blocks"], f"{worker} leaked blocks: {status}"
        assert status["reserved_blocks"] == 0, f"{worker} leaked reservations: {status}"


async def hand_a_reservation(destination: str, source: str, migration_id: str, blocks: int,
                             **connection_args: Any) -> None:
    """Ask `destination`'s worker, over a comm of our own, to reserve `blocks` for a migration from
    `source` (a `PreAlloc` as a source would send it); `connection_args`: the credentials to use."""
    comm = await comm_connect(destination, **connection_args)
    message = PreAlloc(migration_id, source, destination, f"{migration_id}-request", 0, blocks)
    await comm.write({"op": Op.MIGRATION, "sender": source, "message": to_serialize(message), "context": None,
                      "reply": False})
    await comm.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessCluster:
    """`dask scheduler` and `dask worker` processes with the llumdask preloads, like a deployment.

    The scheduler listens on a fixed free port so that it can be restarted at the same address.
    """

    def __init__(self, tmp_path: Path, n_workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.env = dict(os.environ, **(env or {}))
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.scheduler: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._logs = 0
        self.start_scheduler()
        self.add_workers(n_workers)

    def add_workers(self, n: int) -> None:
        """Start `n` worker processes (what a supervisor does after they exit with their scheduler)."""
        for _ in range(n):
            self.workers.append(self._spawn(
                ["distributed.cli.dask_worker", self.address, "--host", "127.0.0.1", "--nthreads", "1",
                 "--no-dashboard", "--preload", "llumdask.plugins.worker"], "worker"))

    def start_scheduler(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self.scheduler = self._spawn(
            ["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", port,
             "--dashboard-address", "127.0.0.1:0", "--preload", "llumdask.plugins.scheduler"], "scheduler")

    def kill_scheduler(self) -> None:
        assert self.scheduler is not None
        self.scheduler.kill()
        self.scheduler.wait(10)

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        self._logs += 1
        log = (self.tmp_path / f"{self._logs:02d}-{name}.log").open("w")
        return subprocess.Popen([sys.executable, "-m", *args], env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def close(self) -> None:
        procs = [*self.workers, *([self.scheduler] if self.scheduler else [])]
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "ProcessCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def nannies_kept() -> Any:
    """A config context for a module whose tests kill workers for their nannies to restart: the
    cluster object closes a nanny whose worker is missing when it checks, `lost-worker-timeout`
    after an earlier loss of that worker, so a second loss within it, caught before the nanny's
    fresh worker registers, would leave the module one instance short."""
    return dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"})
