"""Scenario 7a: the API server goes away for 30 s in the middle of a rollout (kube-apiserver
stopped; etcd, the controllers and the operator keep running) and comes back: the same operator
process resumes and converges, with no duplicate children and no lost status, and its watches
work again (an object created afterwards is reconciled).

Timings (the outage, and the time from the API server's return to a converged service) are
printed; run with `-s` to see them.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.harness import OperatorProcess, condition, isvc_manifest, ready_pods_until, wait_for

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator, a restartable API server
HASH = "gaudiserve.io/template-hash"
NAME = "outage"
# GAUDI_SERVE_E2E_OUTAGE_S lengthens it, e.g. past the minute after which Kopf's retries of a
# watch request run out (Kopf then starts the watch afresh).
OUTAGE_S = float(os.environ.get("GAUDI_SERVE_E2E_OUTAGE_S", "30"))


def _outage(cluster: Cluster, operator: OperatorProcess) -> float:
    """Stop the API server for OUTAGE_S seconds, checking all along that the operator lives on."""
    assert cluster.cp is not None and operator.proc is not None
    start = time.monotonic()
    cluster.cp.stop_apiserver()
    try:
        while time.monotonic() - start < OUTAGE_S:
            assert operator.proc.poll() is None, f"the operator exited during the outage:\n{operator.log()[-3000:]}"
            time.sleep(0.5)  # the outage lasts OUTAGE_S whatever happens; the operator is checked meanwhile
    finally:
        cluster.cp.start_apiserver()
    return time.monotonic() - start


def test_the_operator_rides_out_an_api_server_outage(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                      cleanup: list[str]) -> None:
    kube = cluster.kube
    cleanup.append(NAME)
    cluster.kubectl.apply(isvc_manifest(NAME, ns, shards=1, replicas=2, manual=True))
    ready_pods_until(cluster.kube, ns, NAME, lambda: kube.status(ns, NAME).get("phase") == "Ready", 90, "2 ready replicas")
    first_hash = kube.live_pods(ns, NAME)[0]["metadata"]["labels"][HASH]

    # A rollout is under way (one new pod, not ready) when the API server goes.
    cluster.kubectl("patch", "gisvc", NAME, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"serving": {"maxInputTokens": 100, "maxTotalTokens": 1234}}}')
    gen = kube.isvc(ns, NAME)["metadata"]["generation"]
    wait_for(lambda: kube.status(ns, NAME).get("observedGeneration") == gen, 60, "the new generation reconciled")
    wait_for(lambda: any(p["metadata"]["labels"][HASH] != first_hash for p in kube.live_pods(ns, NAME)), 60,
             "the first new pod")
    before = kube.status(ns, NAME)
    starts, log_size = operator.starts, len(operator.log())

    down = _outage(cluster, operator)
    back = time.monotonic()
    after = kube.status(ns, NAME)  # nothing was lost while nobody could write
    for key in ("observedGeneration", "url", "selector"):
        assert after[key] == before[key], key
    assert {c["type"] for c in after["conditions"]} == {"Ready", "Progressing", "Degraded"}

    final_hash = kube.deployments(ns, NAME)[0]["spec"]["template"]["metadata"]["labels"][HASH]

    def converged() -> bool:
        s = kube.status(ns, NAME)
        pods = kube.live_pods(ns, NAME)
        return (s.get("phase") == "Ready" and s.get("updatedReplicas") == 2 and len(pods) == 2
                and all(p["metadata"]["labels"][HASH] == final_hash for p in pods))
    ready_pods_until(cluster.kube, ns, NAME, converged, 180, "the rollout to converge after the outage")
    converge_s = time.monotonic() - back

    # A change after the outage is picked up as before, and so is a new object, which only the
    # watches (not the periodic pass over the objects already known) can bring to the operator.
    cluster.kubectl("scale", "gisvc", NAME, "--replicas=3", "-n", ns)
    ready_pods_until(cluster.kube, ns, NAME, lambda: kube.status(ns, NAME).get("readySummary") == "3/3", 90, "3/3 after a scale")
    cleanup.append("newcomer")
    cluster.kubectl.apply(isvc_manifest("newcomer", ns, shards=1))
    wait_for(lambda: kube.status(ns, "newcomer").get("phase") == "Ready", 60, "an object created after the outage")
    print(f"\nAPI server outage: down {down:.1f} s; converged {converge_s:.1f} s after it came back")

    assert operator.starts == starts and operator.proc is not None and operator.proc.poll() is None
    assert len(operator.log()) > log_size  # it did notice (and log) the outage
    children = kube.children(ns, NAME)
    assert children["deployments"] == [NAME] and children["services"] == [NAME]
    assert children["poddisruptionbudgets"] == [NAME] and len(children["pods"]) == 3
    assert len(children["replicasets"]) == 2  # the first template and the rolled-out one
    status = kube.status(ns, NAME)
    assert status["observedGeneration"] == kube.isvc(ns, NAME)["metadata"]["generation"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 3, 3)
    assert condition(status, "Progressing")["reason"] == "RolloutComplete"
    assert condition(status, "Degraded")["status"] == "False"
