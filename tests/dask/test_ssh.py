"""llumdask over SSH as a user deploys it: Debian's openssh-server started by the test on two
loopback addresses (two "hosts", one sshd each, so each host's log shows what it started), a
key made by the test, `ssh_cluster` with the scheduler and an instance on the first host and an
instance on the second; the cluster serves and live-migrates between them."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daskhelpers import CLUSTER_OVERRIDES, assert_workers_clean, free_port, prompt_of, reference_tokens

from llumdask.config import load_config

pytestmark = pytest.mark.slow

HOSTS = ("127.0.0.1", "127.0.0.2")



def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """asyncssh connect options for two sshd daemons, one per host address, on one port."""
    daemon = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(daemon):
        pytest.skip("no sshd here: make test installs Debian's openssh-server where it runs as root")
    if os.geteuid() != 0:
        pytest.skip("sshd logs users in only when it runs as root")
    pytest.importorskip("asyncssh")
    home = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / name)], check=True)
    (home / "authorized_keys").write_text((home / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory
    port = free_port()
    daemons = []
    for host in HOSTS:
        config = home / f"sshd-{host}.conf"
        config.write_text("\n".join([
            f"Port {port}", f"ListenAddress {host}", f"HostKey {home / 'host_key'}",
            f"AuthorizedKeysFile {home / 'authorized_keys'}", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
            "StrictModes no", "UsePAM no", f"PidFile {home / f'sshd-{host}.pid'}", "LogLevel VERBOSE", ""]))
        log = (home / f"sshd-{host}.log").open("w")
        daemons.append((subprocess.Popen([daemon, "-D", "-e", "-f", str(config)], stderr=log), log))
    deadline = time.monotonic() + 20
    while not all(_listening(h, port) for h in HOSTS):
        assert time.monotonic() < deadline, "sshd did not start: " + " ".join(
            (home / f"sshd-{h}.log").read_text() for h in HOSTS)
        time.sleep(0.1)
    try:
        yield {"port": port, "username": getpass.getuser(), "client_keys": [str(home / "client_key")],
               "known_hosts": None}, home
    finally:
        for process, log in daemons:
            process.terminate()
            process.wait(10)
            log.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_an_ssh_cluster_serves_and_migrates_between_its_hosts(sshd, tls, tmp_path):
    """With TLS: certificates from `llumdask certs` naming both hosts, every channel encrypted and
    mutually authenticated across them (Dask's comms, the KV stages, the token stream)."""
    from distributed import Client

    from llumdask.api.cli import main
    from llumdask.api.client import connect
    from llumdask.clusters import certs
    from llumdask.clusters.ssh import ssh_cluster

    connect_options, home = sshd
    config = load_config(CLUSTER_OVERRIDES)
    security = None
    if tls:
        assert main(["certs", "--out", str(tmp_path), "--hosts", ",".join(HOSTS)]) == 0
        security = certs.security(tmp_path)
    logins_before = [(home / f"sshd-{h}.log").read_text().count("Accepted publickey") for h in HOSTS]
    with ssh_cluster([HOSTS[0], HOSTS[0], HOSTS[1]], CLUSTER_OVERRIDES, connect_options=connect_options,
                     remote_python=sys.executable, dashboard_address="127.0.0.1:0", security=security,
                     timeout=120) as cluster, \
            Client(cluster, security=security) as client, connect(client) as llum:
        assert cluster.scheduler_address.startswith("tls://" if tls else "tcp://")
        # The first host started the scheduler and a worker, the second a worker, each over its sshd.
        logins = [(home / f"sshd-{h}.log").read_text().count("Accepted publickey") - before
                  for h, before in zip(HOSTS, logins_before)]
        assert logins[0] >= 2 and logins[1] >= 1, logins
        rows = llum.instances().rows
        assert len(rows) == 2 and all(r["total_blocks"] == config.sim_engine.total_blocks for r in rows)
        prompt = prompt_of(3, 80)
        stream = llum.stream(prompt, max_tokens=120)
        tokens = [next(stream) for _ in range(10)]
        destination = next(r["instance"] for r in rows if r["instance"] != stream.instance)
        llum.migrate(stream.request_id, to=destination)
        tokens += list(stream)
        assert tokens == reference_tokens(config, prompt, 120) and stream.instance == destination
        assert llum.requester.token_address.startswith("tls://" if tls else "tcp://")
        assert llum.instances().migrations["committed"] == 1
        assert_workers_clean(client)
