"""A llumdask deployment of separate processes on 127.0.0.1, as an operator would run it.

`dask scheduler --preload llumdask.plugins.scheduler` and N `dask worker --preload
llumdask.plugins.worker` processes (one engine instance each), configured by a YAML file in a
temporary DASK_CONFIG directory. The benchmark's own process is only a client, so what it
measures is not sharing an event loop or the GIL with the scheduler (`LocalCluster` runs its
scheduler inside the calling process).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml
from distributed import Client

from llumdask.clusters.instances import wait_for_instances
from llumdask.config import load_config


@dataclass
class Deployment:
    """The processes of a running deployment: the scheduler first, then the workers."""

    address: str
    env: dict[str, str]
    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, args: list[str], log: str) -> subprocess.Popen:
        with (self.root / log).open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def start_scheduler(self, port: int = 0, scheduler_file: Path | None = None,
                        log: str = "scheduler.log") -> subprocess.Popen:
        """`dask scheduler` with the llumdask preload, first of `procs` (port 0: any free port)."""
        args = ["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
                "--preload", "llumdask.plugins.scheduler"]
        if scheduler_file is not None:
            args += ["--scheduler-file", str(scheduler_file)]
        proc = self.spawn(args, log)
        self.procs.insert(0, self.procs.pop())
        return proc

    def restart_scheduler(self) -> None:
        """SIGKILL the scheduler and start a new one at its address. Its workers exit with it (as
        Dask workers do); starting new ones is a supervisor's job (`add_worker`)."""
        old = self.procs.pop(0)
        old.kill()
        old.wait()
        self.start_scheduler(int(self.address.rsplit(":", 1)[1]), log="scheduler-restarted.log")

    def add_worker(self) -> subprocess.Popen:
        """One more `dask worker` hosting an instance (it joins once its engine is up)."""
        return self.spawn(["distributed.cli.dask_worker", self.address, "--host", "127.0.0.1", "--nthreads", "1",
                           "--no-dashboard", "--preload", "llumdask.plugins.worker"], f"worker-{len(self.procs) - 1}.log")


@contextlib.contextmanager
def process_cluster(n_instances: int, overrides: dict[str, Any] | None = None,
                    timeout: float = 120.0) -> Iterator[str]:
    """Start the scheduler and `n_instances` workers; yield the scheduler address once all are ready."""
    with deployment(n_instances, overrides, timeout) as running:
        yield running.address


@contextlib.contextmanager
def deployment(n_instances: int, overrides: dict[str, Any] | None = None,
               timeout: float = 120.0) -> Iterator[Deployment]:
    """`process_cluster`, yielding the processes too (to add workers, to watch them)."""
    load_config(overrides)  # a bad override fails here, naming its key, not in every worker
    with tempfile.TemporaryDirectory(prefix="llumdask-bench-") as tmp:
        root = Path(tmp)
        running = Deployment("", config_env(root / "config", overrides), root)
        scheduler_file = root / "scheduler.json"
        try:
            running.start_scheduler(scheduler_file=scheduler_file)
            running.address = _address_from(scheduler_file, running.procs[0], timeout)
            for _ in range(n_instances):
                running.add_worker()
            _wait_ready(running.address, n_instances, running.procs, timeout)
            yield running
        except BaseException:
            for log in sorted(root.glob("*.log")):
                print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:]),
                      file=sys.stderr)
            raise
        finally:
            _stop(running.procs)


def config_env(directory: Path, overrides: dict[str, Any] | None) -> dict[str, str]:
    """This process's environment plus DASK_CONFIG pointing at `directory`, where a llumdask.yaml
    with `overrides` is written: how every process of a deployment gets the same settings."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "llumdask.yaml").write_text(yaml.safe_dump({"llumdask": overrides or {}}))
    return dict(os.environ, DASK_CONFIG=str(directory))


def _address_from(scheduler_file: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dask scheduler exited with status {proc.returncode}")
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads(scheduler_file.read_text())["address"]
        time.sleep(0.1)
    raise TimeoutError(f"the dask scheduler wrote no {scheduler_file.name} within {timeout} s")


def _wait_ready(address: str, n: int, procs: list[subprocess.Popen], timeout: float) -> None:
    """Until `n` llumlets are ready; a process that exits or an instance that fails to start
    meanwhile fails it at once."""
    def all_running() -> None:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"exited while starting: {dead[0]}")

    with Client(address, timeout=timeout) as client:
        wait_for_instances(client, n, timeout, check=all_running)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Workers first (they unregister from the scheduler), then the scheduler."""
    for group in (procs[1:], procs[:1]):
        for proc in group:
            if proc.poll() is None:
                proc.terminate()
        for proc in group:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
