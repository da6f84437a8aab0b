"""Scenario 3: an 8-card InferenceService gets Deployment -> ReplicaSet -> Pods on the Gaudi nodes,
shows its printer columns, becomes Ready, and scales through the scale subresource."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.harness import OperatorProcess, condition, isvc_manifest, table, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator

def _owner(obj: dict) -> tuple[str, str]:
    (ref,) = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
    return ref["kind"], ref["name"]


def test_eight_shards_schedule_onto_gaudi_nodes_and_scale(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                          cleanup: list[str]) -> None:
    kube, kubectl = cluster.kube, cluster.kubectl
    cleanup.append("llama")
    kubectl.apply(isvc_manifest("llama", ns, shards=8, replicas=1))

    status = wait_for(lambda: (s := kube.status(ns, "llama")).get("phase") == "Ready" and s, 60,
                      "llama Ready", )
    assert status["readyReplicas"] == 1 and status["readySummary"] == "1/1"
    assert condition(status, "Ready")["status"] == "True"

    # The ownership chain the garbage collector and `kubectl describe` follow.
    (dep,) = kube.deployments(ns, "llama")
    assert _owner(dep) == ("InferenceService", "llama")
    (rs,) = kube.replicasets(ns, "llama")
    assert _owner(rs) == ("Deployment", dep["metadata"]["name"])
    (pod,) = kube.live_pods(ns, "llama")
    assert _owner(pod) == ("ReplicaSet", rs["metadata"]["name"])
    assert pod["spec"]["nodeName"].startswith("gaudi-")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["habana.ai/gaudi"] == "8"

    out = kubectl("get", "gisvc", "llama", "-n", ns).stdout
    assert out.split("\n")[0].split() == ["NAME", "PHASE", "READY", "WARMUP", "SHARDS", "URL", "AGE"], out
    (row,) = table(out)
    assert {k: v for k, v in row.items() if k != "AGE"} == {
        "NAME": "llama", "PHASE": "Ready", "READY": "1/1", "WARMUP": "", "SHARDS": "8",
        "URL": f"http://llama.{ns}.svc.cluster.local"}, out

    kubectl("scale", "gisvc/llama", "--replicas=3", "-n", ns)
    assert kube.isvc(ns, "llama")["spec"]["replicas"] == 3
    status = wait_for(lambda: (s := kube.status(ns, "llama")).get("readyReplicas") == 3
                      and s.get("phase") == "Ready" and s, 60, "3 ready replicas")
    pods = kube.live_pods(ns, "llama")
    assert len(pods) == 3
    # 8 cards each: one replica per Gaudi node, never the node without cards.
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gaudi-0", "gaudi-1", "gaudi-2"]
    scale = json.loads(kubectl("get", "--raw",
                               f"/apis/gaudiserve.io/v1alpha1/namespaces/{ns}/inferenceservices/llama/scale").stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == status["selector"]
    # More than one replica: a PodDisruptionBudget keeps one card set serving during node drains.
    assert kube.children(ns, "llama")["poddisruptionbudgets"] == ["llama"]
