"""Scenario 5: a spec change rolls out one replica at a time; hand edits of the Deployment are
reverted; deleting the InferenceService garbage-collects every child."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.harness import OperatorProcess, condition, is_ready, isvc_manifest, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator
HASH = "gaudiserve.io/template-hash"


def _args(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_spec_change_rolls_out_one_replica_at_a_time(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                     cleanup: list[str]) -> None:
    kube = cluster.kube
    cleanup.append("roll")
    cluster.kubectl.apply(isvc_manifest("roll", ns, shards=2, replicas=2, manual=True))
    pods = wait_for(lambda: len(p := kube.live_pods(ns, "roll")) == 2 and all(x["status"].get("podIP") for x in p)
                    and p, 60, "2 running pods")
    for pod in pods:
        kube.mark_ready(pod)
    wait_for(lambda: kube.status(ns, "roll").get("phase") == "Ready", 60, "roll Ready")
    old_hash = pods[0]["metadata"]["labels"][HASH]
    gen1 = kube.isvc(ns, "roll")["metadata"]["generation"]

    cluster.kubectl("patch", "gisvc", "roll", "-n", ns, "--type=merge",
                    "-p", '{"spec": {"serving": {"maxInputTokens": 512, "maxTotalTokens": 1024}}}')
    gen2 = kube.isvc(ns, "roll")["metadata"]["generation"]
    assert gen2 == gen1 + 1

    def reconciled() -> dict | None:
        s = kube.status(ns, "roll")
        return s if s.get("observedGeneration") == gen2 else None
    status = wait_for(reconciled, 60, "observedGeneration to reach the new generation")
    # Advanced only once the new spec reached the Deployment.
    (dep,) = kube.deployments(ns, "roll")
    assert "1024" in _args(dep) and "--max-total-tokens" in _args(dep)

    # maxSurge 0, maxUnavailable 1: one old pod keeps serving while the first new one starts.
    def mid_rollout() -> list | None:
        live = kube.live_pods(ns, "roll")
        new = [p for p in live if p["metadata"]["labels"][HASH] != old_hash]
        old = [p for p in live if p["metadata"]["labels"][HASH] == old_hash]
        return [old, new] if len(old) == 1 and len(new) == 1 and new[0]["status"].get("podIP") else None
    old, new = wait_for(mid_rollout, 60, "one old and one new pod")
    assert is_ready(old[0]) and not is_ready(new[0])
    status = wait_for(lambda: (s := kube.status(ns, "roll")).get("updatedReplicas") == 1 and s, 30,
                      "status showing the rollout")
    assert condition(status, "Progressing")["reason"] == "RollingOut"
    assert status["readyReplicas"] == 1

    kube.mark_ready(new[0])
    second = wait_for(lambda: [p for p in kube.live_pods(ns, "roll")
                               if p["metadata"]["labels"][HASH] != old_hash and not is_ready(p)
                               and p["status"].get("podIP")], 60, "the second new pod")
    kube.mark_ready(second[0])
    status = wait_for(lambda: (s := kube.status(ns, "roll")).get("phase") == "Ready"
                      and s.get("updatedReplicas") == 2 and s, 60, "the rollout to complete")
    assert condition(status, "Progressing")["reason"] == "RolloutComplete"
    assert all(p["metadata"]["labels"][HASH] != old_hash for p in kube.live_pods(ns, "roll"))


def test_hand_edits_of_the_deployment_are_reverted(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                   cleanup: list[str]) -> None:
    kube, kubectl = cluster.kube, cluster.kubectl
    cleanup.append("drift")
    kubectl.apply(isvc_manifest("drift", ns, shards=1, replicas=1, image="registry.example/runtime:1.0"))
    wait_for(lambda: kube.status(ns, "drift").get("phase") == "Ready", 60, "drift Ready")

    kubectl("set", "image", "deployment/drift", "runtime=registry.example/someone-else:9", "-n", ns)
    kubectl("scale", "deployment/drift", "--replicas=3", "-n", ns)

    def restored() -> dict | None:
        (dep,) = kube.deployments(ns, "drift")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        return dep if c["image"] == "registry.example/runtime:1.0" and dep["spec"]["replicas"] == 1 else None
    wait_for(restored, 60, "the operator to restore the Deployment")

    def settled() -> bool:
        """The rollback is over: one pod, of the spec's image, and no other ReplicaSet scaled up (a single
        pod seen mid-rollback may have a surge pod coming)."""
        pods = kube.live_pods(ns, "drift")
        scaled = [r for r in kube.replicasets(ns, "drift") if r["spec"].get("replicas")]
        return (len(pods) == 1 and len(scaled) == 1 and kube.status(ns, "drift").get("phase") == "Ready"
                and pods[0]["spec"]["containers"][0]["image"] == "registry.example/runtime:1.0")
    wait_for(settled, 60, "one ready pod of the spec's image")


def test_deleting_the_inference_service_garbage_collects_every_child(cluster: Cluster, operator: OperatorProcess,
                                                                      ns: str) -> None:
    kube = cluster.kube
    cluster.kubectl.apply(isvc_manifest("gone", ns, shards=1, replicas=2))
    wait_for(lambda: kube.status(ns, "gone").get("phase") == "Ready", 60, "gone Ready")
    children = kube.children(ns, "gone")
    assert {k: len(v) for k, v in children.items()} == \
        {"deployments": 1, "replicasets": 1, "pods": 2, "services": 1, "poddisruptionbudgets": 1}

    cluster.kubectl("delete", "gisvc", "gone", "-n", ns)
    wait_for(lambda: not any(kube.children(ns, "gone").values()), 60, "every child to be garbage-collected")
