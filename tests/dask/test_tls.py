"""A cluster under Dask security (mutual TLS between scheduler, workers and clients): requests are
served and live-migrated, KV stages and tokens travel over TLS with the cluster's certificates,
Dask's throwaway ones or those `llumdask certs` makes."""

from __future__ import annotations

import pytest
from daskhelpers import assert_workers_clean, hand_a_reservation, prompt_of, reference_tokens, wait_until, worker_statuses
from distributed import Security

from llumdask.api.cli import main
from llumdask.api.client import connect
from llumdask.clusters import certs
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config

pytestmark = pytest.mark.slow

OVERRIDES = {"sim-engine": {"total-blocks": 256}}


def _secrets(security: Security) -> list[str]:
    """The body lines of every certificate and key the cluster runs with (PEM, base64)."""
    texts = [security.tls_ca_file, security.tls_scheduler_cert, security.tls_scheduler_key,
             security.tls_worker_cert, security.tls_worker_key, security.tls_client_cert, security.tls_client_key]
    pems = [t if "-----BEGIN" in t else open(t).read() for t in texts if t]
    return [line for pem in pems for line in pem.splitlines() if line and not line.startswith("-----")]


@pytest.mark.parametrize("certificates", ["temporary", "llumdask certs"])
def test_a_tls_cluster_serves_and_migrates_with_every_channel_under_its_certificates(certificates, tmp_path, capfd):
    config = load_config(OVERRIDES)
    if certificates == "temporary":
        security = Security.temporary()
    else:
        assert main(["certs", "--out", str(tmp_path)]) == 0
        security = certs.security(tmp_path)
    with local_cluster(2, config_overrides=OVERRIDES, security=security, protocol="tls://") as cluster, \
            connect(cluster) as llum:
        assert cluster.scheduler_address.startswith("tls://")
        prompt = prompt_of(7, 60)
        stream = llum.stream(prompt, max_tokens=120)
        tokens = [next(stream)]
        source = stream.instance
        destination = next(row["instance"] for row in llum.instances().rows if row["instance"] != source)
        llum.migrate(stream.request_id, to=destination)
        tokens += list(stream)
        assert tokens == reference_tokens(config, prompt, 120)
        assert stream.instance == destination
        assert llum.requester.token_address.startswith("tls://")
        assert [m["kind"] for m in llum.migrations().rows] == ["committed"]
        assert_workers_clean(llum.dask_client)

        # Migration messages reach a worker only from holders of the cluster's certificates: one
        # signed by another authority is refused at the handshake and reserves nothing there; the
        # same message with the cluster's own is taken (and its reservation expires unanswered).
        client = llum.dask_client
        with pytest.raises(OSError):
            client.sync(hand_a_reservation, destination, source, "outsider", 7, timeout=3,
                        **Security.temporary().get_connection_args("client"))
        assert worker_statuses(client)[destination]["reserved_blocks"] == 0
        client.sync(hand_a_reservation, destination, source, "member", 7, timeout=3,
                    **security.get_connection_args("client"))
        wait_until(lambda: worker_statuses(client)[destination]["reserved_blocks"] == 7, 10, what="reservation")
        assert_workers_clean(client)

        # No certificate or key reaches a log: the processes' output and Dask's kept log records.
        logs = capfd.readouterr()
        kept = [*client.get_scheduler_logs(n=10_000), *(r for rs in client.get_worker_logs(n=10_000).values() for r in rs)]
        text = "\n".join([logs.out, logs.err, *(message for _, message in kept)])
        assert kept, "no log records to search"
        secrets = _secrets(security)
        assert len(secrets) > 10
        leaked = [line for line in secrets if line in text]
        assert not leaked, f"{len(leaked)} lines of certificates or keys in the logs"


def test_certs_refuses_to_overwrite_and_keeps_keys_private(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path), "--hosts", "10.0.0.5,node-1"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == set(certs.FILES)
    assert all((tmp_path / name).stat().st_mode & 0o077 == 0 for name in ("ca.key", "node.key"))
    with pytest.raises(SystemExit):
        main(["certs", "--out", str(tmp_path)])
    assert "already holds" in capsys.readouterr().err
