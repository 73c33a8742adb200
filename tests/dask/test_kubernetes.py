"""The Kubernetes recipe (examples/kubernetes/): the manifests fit the Dask operator's own CRD
schemas (from the installed dask-kubernetes), and a real scheduler with the llumdask plugin
answers the calls the operator's autoscaler makes (Dask's HTTP API, as the operator calls it):
its target from the freeness band, and retirement of drained instances only."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).parents[2] / "examples" / "kubernetes"


def crd_schema(kind: str) -> dict:
    dask_kubernetes = pytest.importorskip("dask_kubernetes")
    crds = Path(dask_kubernetes.__file__).parent / "operator" / "deployment" / "helm" / "dask-kubernetes-operator" / "crds"
    crd = yaml.safe_load((crds / f"{kind.lower()}.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for file in sorted(EXAMPLES.glob("*.yaml")) for doc in yaml.safe_load_all(file.read_text())}


def container(doc: dict, role: str) -> dict:
    [only] = doc["spec"][role]["spec"]["containers"]
    return only


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def test_the_manifests_fit_the_operators_crds_and_install_llumdask():
    import jsonschema

    docs = manifests()
    assert set(docs) == {"DaskCluster", "DaskAutoscaler"}
    for kind, doc in docs.items():
        assert doc["apiVersion"] == "kubernetes.dask.org/v1"
        jsonschema.validate(doc, crd_schema(kind))
    cluster, autoscaler = docs["DaskCluster"], docs["DaskAutoscaler"]
    assert autoscaler["spec"]["cluster"] == cluster["metadata"]["name"]
    scheduler, worker = container(cluster, "scheduler"), container(cluster, "worker")
    assert scheduler["args"][-2:] == ["--preload", "llumdask.plugins.scheduler"]
    assert env(scheduler)["DASK_LLUMDASK__SCALING__ENABLED"] == "true"
    assert "distributed.http.scheduler.api" in ast.literal_eval(env(scheduler)["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"])
    args = worker["args"]
    assert args[args.index("--nthreads") + 1] == "1" and args[args.index("--preload") + 1] == "llumdask.plugins.worker"
    assert env(worker)["DASK_LLUMDASK__ENGINE"] == "vllm" and worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The schemas do bite: a replica count that is not an integer is refused.
    cluster["spec"]["worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, crd_schema("DaskCluster"))


@pytest.mark.slow
def test_the_operators_autoscaler_gets_the_band_and_retires_drained_instances_only():
    import dask
    import httpx

    from llumdask.api.client import connect
    from llumdask.clusters.local import local_cluster

    routes = [*dask.config.get("distributed.scheduler.http.routes"), "distributed.http.scheduler.api"]
    # A band no cluster reaches: the scheduler asks for one more instance at once (nothing here
    # starts it: the operator would), and never drains by itself; the test drains by hand.
    scaling = {"enabled": True, "band": [1e9, 2e9], "min-instances": 1, "max-instances": 3,
               "scale-out-period": 0.2, "scale-in-period": 3600.0}
    with dask.config.set({"distributed.scheduler.http.routes": routes}):
        cluster = local_cluster(2, config_overrides={"sim-engine": {"total-blocks": 128}, "scaling": scaling},
                                adaptive=False)
    with cluster, connect(cluster) as llum:
        api = cluster.dashboard_link.rsplit("/", 1)[0] + "/api/v1"

        def target_becomes(workers: int) -> None:
            deadline = time.monotonic() + 30
            while (got := httpx.get(f"{api}/adaptive_target").json()) != {"workers": workers}:
                assert time.monotonic() < deadline, f"the target stayed {got}, not {workers}"
                time.sleep(0.1)

        target_becomes(3)  # the band's, not Dask's task-based target (an idle cluster: 2 at most)
        assert httpx.post(f"{api}/retire_workers", json={"n": 1}).json() == {}  # nothing drained: nothing goes
        victim = llum.instances().rows[0]["instance"]
        llum.drain(victim)
        # The drained one leaves the target and the one asked for waits: counted together they
        # would leave it at the worker count, where the operator neither retires nor starts one.
        target_becomes(1)
        retired = httpx.post(f"{api}/retire_workers", json={"n": 2}).json()
        assert list(retired) == [victim]  # asked for two, given the drained one
        assert [r["instance"] for r in llum.instances().rows] != [victim]
        target_becomes(2)  # the one asked for, now that nothing drained is left
        assert len(llum.generate([1, 2, 3], max_tokens=4).token_ids) == 4  # the rest still serves
