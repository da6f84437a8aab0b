"""Scenario 7: the operator process is killed in the middle of a rollout; the spec changes again
while no operator runs; a new operator process resumes and converges, with no duplicate children
and no lost status."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.harness import OperatorProcess, condition, isvc_manifest, ready_pods_until, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator
HASH = "gaudiserve.io/template-hash"
NAME = "resume"


def _total_tokens(cluster: Cluster, ns: str) -> str:
    (dep,) = cluster.kube.deployments(ns, NAME)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--max-total-tokens") + 1]


def _patch_total(cluster: Cluster, ns: str, total: int) -> int:
    cluster.kubectl("patch", "gisvc", NAME, "-n", ns, "--type=merge",
                    "-p", f'{{"spec": {{"serving": {{"maxInputTokens": 100, "maxTotalTokens": {total}}}}}}}')
    return cluster.kube.isvc(ns, NAME)["metadata"]["generation"]


def test_a_restarted_operator_resumes_a_rollout(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                 cleanup: list[str]) -> None:
    kube = cluster.kube
    cleanup.append(NAME)
    cluster.kubectl.apply(isvc_manifest(NAME, ns, shards=1, replicas=3, manual=True))
    ready_pods_until(cluster.kube, ns, NAME, lambda: kube.status(ns, NAME).get("phase") == "Ready", 90, "3 ready replicas")
    first_hash = kube.live_pods(ns, NAME)[0]["metadata"]["labels"][HASH]

    gen2 = _patch_total(cluster, ns, 1111)
    wait_for(lambda: kube.status(ns, NAME).get("observedGeneration") == gen2, 60, "generation 2 reconciled")
    wait_for(lambda: any(p["metadata"]["labels"][HASH] != first_hash for p in kube.live_pods(ns, NAME)), 60,
             "the first new pod")

    # Mid-rollout: two old pods serve, one new pod starts. The operator dies without warning.
    assert operator.stop(signal.SIGKILL) == -signal.SIGKILL
    try:
        gen3 = _patch_total(cluster, ns, 2222)
        status = kube.status(ns, NAME)
        assert status["observedGeneration"] == gen2  # nobody has reconciled generation 3
        assert _total_tokens(cluster, ns) == "1111"
    finally:
        operator.start()  # (also for the scenarios after this one, whatever happened here)
    status = wait_for(lambda: (s := kube.status(ns, NAME)).get("observedGeneration") == gen3 and s, 60,
                      "the new operator to reconcile generation 3")
    assert _total_tokens(cluster, ns) == "2222"
    final_hash = kube.deployments(ns, NAME)[0]["spec"]["template"]["metadata"]["labels"][HASH]

    def converged() -> bool:
        s = kube.status(ns, NAME)
        pods = kube.live_pods(ns, NAME)
        return (s.get("phase") == "Ready" and s.get("updatedReplicas") == 3 and len(pods) == 3
                and all(p["metadata"]["labels"][HASH] == final_hash for p in pods))
    ready_pods_until(cluster.kube, ns, NAME, converged, 120, "the rollout of generation 3 to converge")

    children = kube.children(ns, NAME)
    assert children["deployments"] == [NAME] and children["services"] == [NAME]
    assert children["poddisruptionbudgets"] == [NAME] and len(children["pods"]) == 3
    status = kube.status(ns, NAME)
    assert status["readyReplicas"] == 3 and status["replicas"] == 3 and status["readySummary"] == "3/3"
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}
    assert condition(status, "Progressing")["reason"] == "RolloutComplete"
    assert status["url"] == f"http://{NAME}.{ns}.svc.cluster.local"
