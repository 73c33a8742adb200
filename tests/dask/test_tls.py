"""A cluster under Dask security (mutual TLS between scheduler, workers and clients): requests are
served and live-migrated, KV stages and tokens travel over TLS with the cluster's certificates,
Dask's throwaway ones or those `llumdask certs` makes."""

from __future__ import annotations

import pytest
from daskhelpers import assert_workers_clean, prompt_of, reference_tokens
from distributed import Security

from llumdask.api.cli import main
from llumdask.api.client import connect
from llumdask.clusters import certs
from llumdask.clusters.local import local_cluster
from llumdask.config import load_config

pytestmark = pytest.mark.slow

OVERRIDES = {"sim-engine": {"total-blocks": 256}}


@pytest.mark.parametrize("certificates", ["temporary", "llumdask certs"])
def test_a_tls_cluster_serves_and_migrates_with_every_channel_under_its_certificates(certificates, tmp_path):
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


def test_certs_refuses_to_overwrite_and_keeps_keys_private(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path), "--hosts", "10.0.0.5,node-1"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == set(certs.FILES)
    assert all((tmp_path / name).stat().st_mode & 0o077 == 0 for name in ("ca.key", "node.key"))
    with pytest.raises(SystemExit):
        main(["certs", "--out", str(tmp_path)])
    assert "already holds" in capsys.readouterr().err
