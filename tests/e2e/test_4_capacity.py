"""Scenario 4: more cards requested than the cluster has -> the status names the shortfall of
habana.ai/gaudi; adding a Gaudi node resolves it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import GAUDI_NODES, Cluster
from tests.e2e.harness import OperatorProcess, condition, isvc_manifest, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator


@pytest.fixture
def extra_node(cluster: Cluster) -> Iterator[str]:
    name = "gaudi-extra"
    yield name
    cluster.kubectl("delete", "node", name, "--ignore-not-found")


def test_not_enough_cards_is_reported_and_a_new_node_resolves_it(cluster: Cluster, operator: OperatorProcess,
                                                                   ns: str, extra_node: str,
                                                                   cleanup: list[str]) -> None:
    # (extra_node before cleanup: the node goes after the InferenceService's pods are gone)
    kube = cluster.kube
    replicas = GAUDI_NODES + 1  # one 8-card replica more than there are 8-card nodes
    cleanup.append("big")
    cluster.kubectl.apply(isvc_manifest("big", ns, shards=8, replicas=replicas))

    def unschedulable() -> dict | None:
        s = kube.status(ns, "big")
        ready = condition(s, "Ready")
        return s if ready.get("reason") == "Unschedulable" and s.get("readyReplicas") == GAUDI_NODES else None
    status = wait_for(unschedulable, 90, "the Unschedulable status")
    ready = condition(status, "Ready")
    assert status["phase"] == "Degraded"  # the scheduled replicas serve; one cannot be placed
    assert ready["status"] == "False"
    # The operator's words and the scheduler's: which resource, how much per replica, how many nodes lack it.
    assert "not enough habana.ai/gaudi on any node (8 per replica)" in ready["message"], ready
    assert "Insufficient habana.ai/gaudi" in ready["message"], ready
    assert condition(status, "Degraded") == {**condition(status, "Degraded"), "status": "True",
                                              "reason": "Unschedulable"}

    cluster.add_node(extra_node, 8)
    status = wait_for(lambda: (s := kube.status(ns, "big")).get("phase") == "Ready" and s, 90,
                      "Ready after adding a node")
    assert status["readyReplicas"] == replicas
    assert condition(status, "Degraded")["status"] == "False"
    assert extra_node in {p["spec"]["nodeName"] for p in kube.live_pods(ns, "big")}
