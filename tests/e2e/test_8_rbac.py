"""The chart's RBAC against what the operator really did, from the API server's audit log:
every request of the operator's ServiceAccount was allowed (enough), and every right the chart
grants was used (no more).

The audit log covers the whole session (all scenarios); this test adds a workload that goes
through every code path of the operator's API use on its own, so it also holds when run alone.
"""

from __future__ import annotations

import datetime

import pytest

from tests.e2e.conftest import Cluster, Release
from tests.e2e.control_plane import json_lines
from tests.e2e.harness import OperatorProcess, isvc_manifest, rwx_claim, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator

def _granted(release: Release) -> set[tuple[str, str, str]]:
    # The operator's roles, not the one of the endpoint pickers it runs (which it binds, never holds).
    roles = [d for d in release.manifest if d["kind"] == "ClusterRole"
             and not d["metadata"]["name"].endswith("-endpoint-picker")]
    return {(g, r, v) for role in roles for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def _while_starting(cluster: Cluster, timestamp: str) -> bool:
    at = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return any(began <= at <= ready for began, ready in cluster.cp.api_starts)


def _used(cluster: Cluster, user: str) -> tuple[set[tuple[str, str, str]], list[str]]:
    used, denied = set(), []
    for ev in json_lines(cluster.cp.audit_log):
        if ev.get("user", {}).get("username") != user or ev.get("stage") != "ResponseComplete":
            continue
        if ev.get("userAgent", "").startswith("kubectl") or not ev.get("objectRef"):
            continue  # the tests' own `kubectl auth` checks with this account; discovery
        ref = ev["objectRef"]
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        code = (ev.get("responseStatus") or {}).get("code", 0)
        if code == 403 and _while_starting(cluster, ev["requestReceivedTimestamp"]):
            continue  # an API server (re)starting refuses what it cannot authorize yet (test_7_apiserver_outage)
        if code == 403:
            denied.append(f"{ev['verb']} {ev['requestURI']}")
            continue
        used.add((ref.get("apiGroup", ""), resource, ev["verb"]))
        if ev["verb"] == "patch" and code == 201:  # a server-side apply that created the object
            used.add((ref.get("apiGroup", ""), resource, "create"))
        if resource == "rolebindings" and ev["verb"] in ("patch", "create") and code in (200, 201):
            # Binding a role one does not hold is authorized by `bind` on it: no request of its own.
            used.add(("rbac.authorization.k8s.io", "clusterroles", "bind"))
    return used, denied


def _jobs(cluster: Cluster, ns: str) -> list[dict]:
    return cluster.kubectl.json("get", "jobs", "-n", ns, "-l", "gaudiserve.io/model-download")["items"]


def _download_paths(cluster: Cluster, ns: str) -> None:
    """The download Job's paths: created by one service, joined by a second (patch), its pod's log
    read (pods/log), left by the second (patch) and deleted by the last owner (delete)."""
    kubectl, logs = cluster.kubectl, cluster.kubelet_logs
    rwx_claim(cluster.kube, ns, "rbac-models")
    model = {"id": "org/m", "cache": {"persistentVolumeClaim": {"claimName": "rbac-models"}, "prefetch": True}}
    for name in ("rbac-dl-a", "rbac-dl-b"):
        kubectl.apply(isvc_manifest(name, ns, shards=1, model=model))
    (job,) = wait_for(lambda: (j := _jobs(cluster, ns)) and len(j[0]["metadata"]["ownerReferences"]) == 2 and j, 60,
                      "one download Job, joined by the second service")
    assert logs is not None
    wait_for(lambda: any(f"/{ns}/{job['metadata']['name']}-" in r for r in logs.requests), 60,
             "the operator to read the download's log")
    kubectl("patch", "gisvc", "rbac-dl-b", "-n", ns, "--type=merge", "-p", '{"spec": {"model": {"revision": "v2"}}}')
    wait_for(lambda: [len(j["metadata"]["ownerReferences"]) for j in _jobs(cluster, ns)] in ([1, 1],), 60,
             "the second service left the Job for one of its own")
    kubectl("patch", "gisvc", "rbac-dl-a", "-n", ns, "--type=merge",
            "-p", '{"spec": {"model": {"cache": {"prefetch": false}}}}')
    wait_for(lambda: job["metadata"]["name"] not in [j["metadata"]["name"] for j in _jobs(cluster, ns)], 60,
             "the Job deleted by its last owner")
    for name in ("rbac-dl-a", "rbac-dl-b"):
        kubectl("delete", "gisvc", name, "-n", ns, "--wait=true")
    wait_for(lambda: not _jobs(cluster, ns), 60, "the download Jobs gone with their owners")


def _gateway_paths(cluster: Cluster, ns: str) -> None:
    """spec.gateway (the Gateway API's CRDs are installed with the cluster, the release has a picker
    image): the operator's own picker, an InferencePool and an HTTPRoute applied; the picker deleted
    when the spec names one; the pool and the route deleted with the field."""
    kubectl = cluster.kubectl

    def present(kind: str, name: str) -> bool:
        return kubectl("get", kind, name, "-n", ns, check=False).returncode == 0
    picker = [(k, "rbac-epp") for k in ("serviceaccount", "rolebinding", "deployment", "service")]
    gateway: dict = {"route": {"gateway": {"name": "gw"}}}
    for spec, wanted, gone in (
            (gateway, [*picker, ("inferencepool", "rbac"), ("httproute", "rbac")], []),
            ({**gateway, "endpointPicker": {"service": {"name": "mine"}}}, [("inferencepool", "rbac")], picker),
            (None, [], [("inferencepool", "rbac"), ("httproute", "rbac")])):
        kubectl.apply(isvc_manifest("rbac", ns, shards=1, replicas=1, **({"gateway": spec} if spec else {})))
        for kind, name in wanted:
            wait_for(lambda k=kind, n=name: present(k, n), 30, f"the {kind} {name} applied")
        for kind, name in gone:
            wait_for(lambda k=kind, n=name: not present(k, n), 30, f"the {kind} {name} deleted")


def test_the_chart_grants_what_the_operator_uses_and_no_more(cluster: Cluster, release: Release,
                                                             operator: OperatorProcess, ns: str) -> None:
    kube, kubectl = cluster.kube, cluster.kubectl
    # Every path: create (children applied), 2 replicas (PDB) with a NetworkPolicy, scale to 1 and
    # drop the NetworkPolicy (both deleted), an HPA, a KEDA ScaledObject in its place (HPA deleted),
    # no autoscaling (ScaledObject deleted), spec.gateway's InferencePool, HTTPRoute and the operator's
    # own picker applied and deleted, delete; a shared download Job's life (_download_paths).
    kubectl.apply(isvc_manifest("rbac", ns, shards=1, replicas=2, networkPolicy={}))
    wait_for(lambda: kube.status(ns, "rbac").get("phase") == "Ready", 60, "rbac Ready")
    assert kube.children(ns, "rbac")["poddisruptionbudgets"] == ["rbac"]
    assert kubectl("get", "networkpolicy", "rbac", "-n", ns, check=False).returncode == 0
    kubectl("patch", "gisvc", "rbac", "-n", ns, "--type=json",
            "-p", '[{"op": "replace", "path": "/spec/replicas", "value": 1}, {"op": "remove", "path": "/spec/networkPolicy"}]')
    wait_for(lambda: not kube.children(ns, "rbac")["poddisruptionbudgets"]
             and kube.status(ns, "rbac").get("readyReplicas") == 1, 60, "the PDB removed at one replica")
    wait_for(lambda: kubectl("get", "networkpolicy", "rbac", "-n", ns, check=False).returncode != 0, 60,
             "the NetworkPolicy removed with the spec's")
    for autoscaling, kind in (({"maxReplicas": 1}, "hpa"), ({"maxReplicas": 1, "engine": "keda", "prometheus": {
            "serverAddress": "http://prometheus:9090"}}, "scaledobject"), (None, None)):
        kubectl.apply(isvc_manifest("rbac", ns, shards=1, replicas=1,
                                    **({"autoscaling": autoscaling} if autoscaling else {})))
        for other in ("hpa", "scaledobject"):
            wanted = other == kind
            wait_for(lambda o=other, w=wanted: (kubectl("get", o, "rbac", "-n", ns, check=False).returncode == 0) == w,
                     30, f"{kind or 'no autoscaler'} in place")
    _gateway_paths(cluster, ns)
    kubectl("delete", "gisvc", "rbac", "-n", ns, "--wait=true")
    wait_for(lambda: not kube.pods(ns, "rbac"), 60, "the pods gone")
    _download_paths(cluster, ns)

    user = f"system:serviceaccount:{release.namespace}:{release.service_account}"
    used, denied = _used(cluster, user)
    assert used, "no request of the operator's ServiceAccount in the audit log"
    assert not denied, f"the chart's RBAC refused the operator: {denied}"
    granted = _granted(release)
    unused = sorted(granted - used)
    assert not unused, f"granted by the chart but never used by the operator: {unused}"
    assert not sorted(used - granted)  # (an allowed request needs a grant; this guards the bookkeeping)
