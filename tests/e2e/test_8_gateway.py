"""Scenario 8a: a fleet behind a gateway (spec.gateway). Without the Gateway API's CRDs the status
names the missing APIs and the service still serves; with them, the operator's InferencePool and
HTTPRoute are admitted as rendered by the real CRD schemas (the Gateway API's from its Go module,
the InferencePool's stand-in, docs/e2e.md), owned by the InferenceService, selecting its pods on the
runtime's port; the route's status, written here as a Gateway's controller would, reaches the
InferenceService's status; dropping spec.gateway deletes both.

(No gateway controller runs: what one does with the route is its business; here it is checked that
the objects it reads are right, and that what it writes back is reported.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from gaudi_operator import kube as operator_kube
from gaudi_operator.components import render
from gaudi_operator.spec import RUNTIME_PORT
from tests.e2e.conftest import Cluster
from tests.e2e.harness import OperatorProcess, condition, is_ready, isvc_manifest, wait_for

pytestmark = pytest.mark.simulated  # kwok pods, the local operator, CRDs removed and installed mid-session

NAME = "routed"
GATEWAY = {"endpointPicker": {"service": {"name": "routed-epp"}},
           "route": {"gateway": {"name": "inference-gateway", "namespace": "gateway-system"}, "path": "/v1"}}
CONTROLLER = "example.net/gateway-controller"


def _get(cluster: Cluster, kind: str, ns: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", kind, NAME, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _routed(cluster: Cluster, ns: str) -> dict[str, Any]:
    return condition(cluster.kube.status(ns, NAME), "Routed")


def _route_status(ns: str, accepted: str, resolved: tuple[str, str, str]) -> dict[str, Any]:
    """status.parents as a Gateway's controller writes it (GEP-1364)."""
    def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return {"type": ctype, "status": status, "reason": reason, "message": message, "observedGeneration": 1,
                "lastTransitionTime": "2026-01-01T00:00:00Z"}
    return {"status": {"parents": [{
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
                      "namespace": "gateway-system"},
        "controllerName": CONTROLLER,
        "conditions": [cond("Accepted", accepted, "Accepted", "accepted by listener http"), cond(*resolved)]}]}}


def _restart_without_the_apis(cluster: Cluster, operator: OperatorProcess) -> None:
    """A cluster without the CRDs. The operator is stopped while they go: Kopf ends the process when a
    CRD it watches is deleted under a watch request (404), as it would in a cluster whose Gateway API
    is uninstalled (the chart's Deployment then restarts it)."""
    operator.stop()
    cluster.remove_gateway_crds()
    operator.start()


def _without_the_apis(cluster: Cluster, ns: str) -> None:
    """(a) The CRDs absent: the status names both, the pods serve, nothing is retried as an error."""
    cluster.kubectl.apply(isvc_manifest(NAME, ns, shards=1, gateway=GATEWAY))
    routed = wait_for(lambda: (c := _routed(cluster, ns)).get("reason") == "GatewayAPINotInstalled" and c, 60,
                      "Routed: GatewayAPINotInstalled")
    assert routed["status"] == "False"
    for crd in ("inferencepools.inference.networking.k8s.io", "httproutes.gateway.networking.k8s.io"):
        assert crd in routed["message"], routed
    status = wait_for(lambda: (s := cluster.kube.status(ns, NAME)).get("readyReplicas") == 1 and s, 60,
                      "the pod ready without the gateway")
    # Serving through its Service, but not through the gateway it asked for: not Ready (Routed gates it).
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "GatewayAPINotInstalled")
    assert status["phase"] == "Degraded" and condition(status, "Degraded")["reason"] == "GatewayAPINotInstalled"


def _admitted_as_rendered(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    """(b) The CRDs installed: both objects appear, as rendered, owned, selecting the pods."""
    cluster.install_gateway_crds()
    live = wait_for(lambda: (p := _get(cluster, "inferencepool", ns)) and (r := _get(cluster, "httproute", ns))
                    and {"InferencePool": p, "HTTPRoute": r}, 60, "the InferencePool and the HTTPRoute")
    isvc = cluster.kube.isvc(ns, NAME)
    assert isvc is not None
    rendered = {c["kind"]: c for c in render(isvc).children if c["kind"] in live}
    for kind, obj in live.items():
        # Admitted by the CRD exactly as rendered: nothing pruned as unknown, nothing defaulted otherwise.
        assert obj["spec"] == rendered[kind]["spec"], kind
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceService", NAME, isvc["metadata"]["uid"], True)
        out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                              input=yaml.safe_dump(rendered[kind]), check=False)
        assert out.returncode == 0, out.stderr
        prefix = operator_kube._KINDS[kind][0]  # the operator's path for the kind is the one the API serves
        assert prefix.endswith(obj["apiVersion"]), (prefix, obj["apiVersion"])
    pool = live["InferencePool"]["spec"]
    selector = ",".join(f"{k}={v}" for k, v in pool["selector"]["matchLabels"].items())
    pods = cluster.kubectl.json("get", "pods", "-n", ns, "-l", selector)["items"]
    assert [p["metadata"]["name"] for p in pods] == [p["metadata"]["name"] for p in cluster.kube.pods(ns, NAME)]
    assert pods and all(is_ready(p) for p in pods)
    assert pool["targetPorts"] == [{"number": RUNTIME_PORT}]
    assert pool["endpointPickerRef"]["name"] == "routed-epp" and pool["endpointPickerRef"]["port"] == {"number": 9002}
    route = live["HTTPRoute"]["spec"]
    assert route["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    return live


def test_a_fleet_behind_a_gateway(cluster: Cluster, operator: OperatorProcess, ns: str, cleanup: list[str]) -> None:
    cleanup.append(NAME)
    try:
        _restart_without_the_apis(cluster, operator)
        _without_the_apis(cluster, ns)
        _admitted_as_rendered(cluster, ns)
        wait_for(lambda: _routed(cluster, ns).get("reason") == "RoutePending", 30, "Routed: RoutePending")

        # (c) A Gateway's controller accepts the route but cannot resolve the pool.
        status = _route_status(ns, "True", ("ResolvedRefs", "False", "InvalidKind",
                                            "InferencePool is not a supported backend kind"))
        cluster.kubectl("patch", "httproute", NAME, "-n", ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps(status))
        routed = wait_for(lambda: (c := _routed(cluster, ns)).get("reason") == "RouteRefsNotResolved" and c, 30,
                          "Routed: RouteRefsNotResolved")
        assert routed["status"] == "False"
        assert "ResolvedRefs=False (InvalidKind: InferencePool is not a supported backend kind)" in routed["message"]
        (parent,) = cluster.kube.status(ns, NAME)["gateway"]["parents"]
        assert parent["gateway"] == "gateway-system/inference-gateway" and parent["controllerName"] == CONTROLLER
        assert [(c["type"], c["status"], c["reason"]) for c in parent["conditions"]] == [
            ("Accepted", "True", "Accepted"), ("ResolvedRefs", "False", "InvalidKind")]
        status = _route_status(ns, "True", ("ResolvedRefs", "True", "ResolvedRefs", "resolved"))
        cluster.kubectl("patch", "httproute", NAME, "-n", ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps(status))
        wait_for(lambda: _routed(cluster, ns).get("status") == "True", 30, "Routed: True")
        assert cluster.kube.status(ns, NAME)["phase"] == "Ready"

        # (d) Without spec.gateway: both deleted, the condition and status.gateway gone.
        cluster.kubectl.apply(isvc_manifest(NAME, ns, shards=1))
        wait_for(lambda: _get(cluster, "inferencepool", ns) is None and _get(cluster, "httproute", ns) is None, 30,
                 "the InferencePool and the HTTPRoute deleted")
        wait_for(lambda: not _routed(cluster, ns) and "gateway" not in cluster.kube.status(ns, NAME), 30,
                 "the Routed condition and status.gateway gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- operator log ---\n{operator.log()[-6000:]}") from None
    finally:
        # As the session had them (scenario 2's drawn specs, scenario 8's RBAC), watched from the start:
        # CRDs installed while Kopf runs may be discovered before the API serves them, and then not watched.
        cluster.install_gateway_crds()
        operator.stop()
        operator.start()


def test_without_a_named_picker_the_operator_runs_one(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                      cleanup: list[str]) -> None:
    """The chart's picker image set (the session's release): a spec.gateway naming no picker Service gets
    the operator's own, <name>-epp, whose RoleBinding the API server admits from the operator's token
    (it may bind the chart's picker ClusterRole without holding that role's rights)."""
    kube, kubectl, name = cluster.kube, cluster.kubectl, "own-picker"
    cleanup.append(name)
    kubectl.apply(isvc_manifest(name, ns, shards=1, gateway={}))
    objects = ("serviceaccount", "rolebinding", "deployment", "service")

    def picker() -> dict[str, Any] | None:
        out = {k: kubectl("get", k, f"{name}-epp", "-n", ns, "-o", "json", check=False) for k in objects}
        return {k: json.loads(o.stdout) for k, o in out.items()} if all(o.returncode == 0 for o in out.values()) \
            else None
    live = wait_for(picker, 60, "the picker's ServiceAccount, RoleBinding, Deployment and Service")
    isvc = kube.isvc(ns, name)
    assert isvc is not None
    for obj in live.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert live["rolebinding"]["roleRef"]["name"].endswith("-endpoint-picker")
    pod = live["deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{name}-epp"
    assert pod["containers"][0]["args"][:4] == ["--pool-name", name, "--pool-namespace", ns]
    pool = wait_for(lambda: (p := kubectl("get", "inferencepool", name, "-n", ns, "-o", "json", check=False))
                    .returncode == 0 and json.loads(p.stdout), 30, "the InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
    # The picker's pod runs (kwok), outside the pool and outside the service's replicas.
    wait_for(lambda: kubectl.json("get", "pods", "-n", ns, "-l", f"gaudiserve.io/endpoint-picker={name}")["items"],
             60, "the picker's pod")
    status = wait_for(lambda: (s := kube.status(ns, name)).get("readyReplicas") == 1 and s, 60, "one ready replica")
    assert status["replicas"] == 1 and status["gateway"]["endpointPickerManaged"] is True
    assert condition(status, "Routed")["reason"] == "InferencePoolApplied"

    kubectl.apply(isvc_manifest(name, ns, shards=1, gateway={"endpointPicker": {"service": {"name": "mine"}}}))
    wait_for(lambda: all(kubectl("get", k, f"{name}-epp", "-n", ns, check=False).returncode != 0 for k in objects),
             30, "the operator's picker deleted once the spec names one")
    assert kubectl.json("get", "inferencepool", name, "-n", ns)["spec"]["endpointPickerRef"]["name"] == "mine"
