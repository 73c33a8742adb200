"""llumdask in SLURM batch jobs as a user runs it: Debian's slurmctld, slurmd and munge started by
the test on this machine (one node), `slurm_cluster` submitting jobs through dask-jobqueue's
sbatch; the freeness band scales out by a job under load and back in once idle, draining the
instance by migration before its job is cancelled: every request completes exactly."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daskhelpers import free_port, prompt_of, reference_tokens

from llumdask.config import load_config

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
JOB_SCRIPT = Path(__file__).parents[2] / "examples" / "slurm" / "llumdask-instances.sbatch"


def _program(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}",) if os.path.exists(p)), None)



@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """A one-node SLURM cluster of this machine; SLURM_CONF points sbatch at it meanwhile."""
    missing = [d for d in DAEMONS if _program(d) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} here: make test installs Debian's slurmctld, slurmd and munge "
                    "where it runs as root")
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as their users only when it runs as root")
    pytest.importorskip("dask_jobqueue")
    home = tmp_path_factory.mktemp("slurm")
    (home / "state").mkdir()
    (home / "spool").mkdir()
    (home / "munge.key").write_bytes(os.urandom(1024))
    (home / "munge.key").chmod(0o400)
    node = socket.gethostname().split(".")[0]
    config = home / "slurm.conf"
    config.write_text("\n".join([
        "ClusterName=llumdask-test", f"SlurmctldHost={node}(127.0.0.1)", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "AuthType=auth/munge", f"AuthInfo=socket={home / 'munge.socket'}",
        "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={home / 'state'}",
        f"SlurmdSpoolDir={home / 'spool'}", f"SlurmctldPidFile={home / 'slurmctld.pid'}",
        f"SlurmdPidFile={home / 'slurmd.pid'}", f"SlurmctldLogFile={home / 'slurmctld.log'}",
        f"SlurmdLogFile={home / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "SchedulerType=sched/builtin",
        "ReturnToService=2", "MpiDefault=none",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=8000 State=UNKNOWN",
        # Jobs may share the node's cores: two jobs of two instances run at once on two cores.
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4", ""]))
    env = {**os.environ, "SLURM_CONF": str(config)}
    processes = [subprocess.Popen([_program("munged"), "--foreground", "--force", f"--key-file={home / 'munge.key'}",
                                   f"--socket={home / 'munge.socket'}", f"--pid-file={home / 'munged.pid'}",
                                   f"--log-file={home / 'munged.log'}", f"--seed-file={home / 'munge.seed'}"])]
    time.sleep(0.5)
    processes += [subprocess.Popen([_program(daemon), "-D", "-f", str(config)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                  for daemon in ("slurmctld", "slurmd")]
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(config)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip() != "idle":
            assert time.monotonic() < deadline, (home / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.2)
        yield home
    finally:
        subprocess.run(["scancel", "--user", "root"], check=False)
        if previous is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = previous
        for process in reversed(processes):
            process.terminate()
            process.wait(10)


def jobs_queued() -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True).stdout.split("\n")[:-1]


def wait_for(condition, timeout: float, what) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.2)


def test_a_slurm_cluster_scales_out_by_a_job_and_back_in_without_losing_a_request(slurm):
    from llumdask.api.client import connect
    from llumdask.clusters.slurm import slurm_cluster

    overrides = {"sim-engine": {"total-blocks": 128},
                 "scaling": {"enabled": True, "min-instances": 1, "max-instances": 2, "scale-out-period": 0.5,
                             "scale-in-period": 2.0}}
    config = load_config(overrides)
    with slurm_cluster(1, overrides, memory_per_instance="1GB", walltime="00:30:00",
                       log_directory=str(slurm), timeout=120) as cluster, connect(cluster) as llum:
        assert len(jobs_queued()) == 1 and len(llum.instances().rows) == 1
        prompts = [prompt_of(i, 100) for i in range(10)]  # ~19 blocks each: twice what one instance holds
        seen = {"jobs": 1, "instances": 1}
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            running = [pool.submit(lambda p=p: llum.generate(p, max_tokens=200, timeout=60).token_ids) for p in prompts]
            while not all(r.done() for r in running):  # meanwhile the band asks for a second instance
                seen = {"jobs": max(seen["jobs"], len(jobs_queued())),
                        "instances": max(seen["instances"], len(llum.instances().rows))}
                time.sleep(0.2)
            results = [r.result() for r in running]
        assert seen == {"jobs": 2, "instances": 2}  # a second job came and its instance joined
        assert results == [reference_tokens(config, p, 200) for p in prompts]  # nothing lost, nothing changed
        # Idle: the band drains the second instance, then its job is cancelled.
        plugin = cluster.scheduler.plugins["llumdask"]
        wait_for(lambda: len(jobs_queued()) == 1 and len(llum.instances().rows) == 1, 60,
                 lambda: f"the scale-in: jobs {jobs_queued()}, scaling {list(plugin.scaling_log)}")
        assert len(llum.generate([1, 2, 3], max_tokens=4).token_ids) == 4


def test_a_scale_in_drains_a_job_of_several_instances_whole_and_cancels_it(slurm):
    """Two jobs of two instances, idle: the band drains one job's instances together (one drained
    alone could not be cancelled while its job-mate serves) and the job goes."""
    from llumdask.api.client import connect
    from llumdask.clusters.slurm import slurm_cluster

    overrides = {"sim-engine": {"total-blocks": 128},
                 "scaling": {"enabled": True, "min-instances": 2, "max-instances": 4, "scale-out-period": 0.5,
                             "scale-in-period": 2.0}}
    with slurm_cluster(2, overrides, instances_per_job=2, memory_per_instance="1GB", walltime="00:30:00",
                       log_directory=str(slurm), timeout=120) as cluster, connect(cluster) as llum:
        plugin = cluster.scheduler.plugins["llumdask"]
        wait_for(lambda: len(jobs_queued()) == 1 and len(llum.instances().rows) == 2, 90,
                 lambda: f"the scale-in: jobs {jobs_queued()}, instances {len(llum.instances().rows)}, "
                         f"scaling {list(plugin.scaling_log)}")
        assert len(cluster.workers) == 1  # the job left holds both instances still serving
        assert len(llum.generate([1, 2, 3], max_tokens=4).token_ids) == 4


def test_the_example_job_script_brings_instances_to_a_running_scheduler(slurm, tmp_path):
    """examples/slurm/llumdask-instances.sbatch as the README runs it, on this node: no GPU here, so
    its GPU directive is left out and the sim engine serves; everything else as written."""
    from distributed import Client

    from llumdask.api.client import connect
    from llumdask.clusters.instances import wait_for_instances
    from llumdask.clusters.local import local_cluster

    script = tmp_path / JOB_SCRIPT.name
    script.write_text("".join(line for line in JOB_SCRIPT.read_text().splitlines(keepends=True)
                              if "--gpus-per-task" not in line))
    with local_cluster(0, config_overrides={"sim-engine": {"total-blocks": 128}}) as cluster, \
            Client(cluster) as client, connect(client) as llum:
        env = {"LLUMDASK_SCHEDULER": cluster.scheduler_address, "LLUMDASK_PYTHON": sys.executable,
               "DASK_LLUMDASK__ENGINE": "sim", "DASK_LLUMDASK__SIM_ENGINE__TOTAL_BLOCKS": "128"}
        submitted = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", f"--output={tmp_path}/job-%j.out",
                                    str(script)], env={**os.environ, **env}, capture_output=True, text=True, check=True)
        job = submitted.stdout.strip().split(";")[0]
        try:
            wait_for_instances(client, 2, timeout=90)
            rows = llum.instances().rows
            assert len(rows) == 2 and all(r["total_blocks"] == 128 for r in rows)
            prompt = prompt_of(5, 60)
            assert llum.generate(prompt, max_tokens=30).token_ids == reference_tokens(
                load_config({"sim-engine": {"total-blocks": 128}}), prompt, 30)
        finally:
            subprocess.run(["scancel", job], check=False)
