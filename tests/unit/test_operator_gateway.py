"""spec.gateway: the InferencePool and HTTPRoute the operator renders, admitted by the InferencePool v1
schema (tests/e2e/crds/inferencepool-v1.yaml), the Routed condition and status.gateway read off the
route's status, and a draining pod leaving the pool before it stops taking requests (pure)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gaudi_operator.components import render
from gaudi_operator.gateway import gateway_status, routed
from gaudi_operator.picker import PickerConfig
from gaudi_operator.render import ISVC_LABEL
from gaudi_operator.spec import PRESTOP_SECONDS, RUNTIME_PORT, parse_spec
from gaudi_operator.status import Observed, compute_status
from tests.unit.test_operator_crd import _cel, _default, _strict, admit, manifest
from tests.unit.test_operator_render import body, children

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.37.0"
POOL_CRD = yaml.safe_load((ROOT / "tests" / "e2e" / "crds" / "inferencepool-v1.yaml").read_text())
POOL_SCHEMA = POOL_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
PICKER = {"service": {"name": "llama-epp"}}
ROUTE = {"gateway": {"name": "inference-gateway", "namespace": "gateway-system"}, "path": "/v1"}


def _gateway(**gateway: Any) -> dict[str, dict[str, Any]]:
    return children(replicas=2, gateway={"endpointPicker": PICKER, **gateway})


def _admitted_by_pool_crd(pool: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    obj = _default(POOL_SCHEMA, copy.deepcopy(pool))
    errors = [e.message for e in jsonschema.Draft202012Validator(_strict(POOL_SCHEMA)).iter_errors(obj)]
    return obj, errors or _cel(POOL_SCHEMA, obj, "")


def test_the_pool_selects_the_services_pods_on_the_runtimes_port_behind_the_named_picker() -> None:
    kids = _gateway()
    pool, dep = kids["InferencePool"], kids["Deployment"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "llama" and pool["metadata"]["namespace"] == "ml"
    # Exactly the Deployment's pods, whatever their template: a rollout keeps both in the pool.
    assert pool["spec"]["selector"] == {"matchLabels": dep["spec"]["selector"]["matchLabels"]}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    (port,) = dep["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": RUNTIME_PORT}] and port["containerPort"] == RUNTIME_PORT
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "llama-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    ref = pool["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("InferenceService", "llama", True)
    assert "HTTPRoute" not in kids


def test_the_pool_is_admitted_by_the_inferencepool_v1_schema_unchanged() -> None:
    pool = _gateway(endpointPicker={"service": {"name": "epp", "port": 9010}, "failureMode": "FailOpen"})[
        "InferencePool"]
    defaulted, errors = _admitted_by_pool_crd(pool)
    assert errors == []
    assert defaulted == pool  # every field the schema would default is rendered: nothing changes on the way in


@pytest.mark.parametrize("broken,why", [
    ({"targetPorts": []}, "[] should be non-empty"),
    ({"endpointPickerRef": {"name": "epp"}}, "port is required when kind is 'Service'"),
    ({"selector": {"matchLabels": {}}}, "should be non-empty"),
])
def test_the_pool_schema_stand_in_refuses_what_upstreams_refuses(broken: dict[str, Any], why: str) -> None:
    pool = copy.deepcopy(_gateway()["InferencePool"])
    pool["spec"].update(broken)
    _, errors = _admitted_by_pool_crd(pool)
    assert any(why in e for e in errors), errors


def test_the_route_goes_from_the_named_gateway_to_the_pool() -> None:
    route = _gateway(route=ROUTE)["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["metadata"]["name"] == "llama"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateway-system"}]
    assert route["spec"]["rules"] == [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama",
                         "weight": 1}]}]
    assert route["metadata"]["ownerReferences"][0]["name"] == "llama"


def test_a_gateway_in_the_services_namespace_needs_no_namespace_in_the_parent_ref() -> None:
    route = _gateway(route={"gateway": {"name": "gw", "namespace": "ml"}})["HTTPRoute"]
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert route["spec"]["rules"][0]["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


def test_without_spec_gateway_the_pool_and_route_are_unwanted_and_status_says_nothing() -> None:
    r = render(body())
    assert r.of("gateway") == []
    r = render(body(gateway={"endpointPicker": PICKER}))
    assert [c["kind"] for c in r.of("gateway")] == ["InferencePool"]  # no route: an owned one would be stale
    spec = parse_spec(body()["spec"])
    assert routed(spec, "llama", "ml", (), None) is None and gateway_status(spec, "llama", "ml", None) is None


def test_spec_defaults_equal_crd_defaults_with_gateway() -> None:
    defaulted, errors = admit(manifest(gateway={"endpointPicker": PICKER, "route": {"gateway": {"name": "gw"}}}))
    assert not errors
    assert defaulted["spec"]["gateway"] == {"endpointPicker": {"service": {"name": "llama-epp", "port": 9002},
                                                               "failureMode": "FailClose"},
                                            "route": {"gateway": {"name": "gw"}, "path": "/"}}
    from_crd = parse_spec(defaulted["spec"]).model_dump(by_alias=True)
    from_code = parse_spec(manifest(gateway={"endpointPicker": PICKER, "route": {"gateway": {"name": "gw"}}})[
        "spec"]).model_dump(by_alias=True)
    assert from_crd == from_code


def _status(live: dict[str, Any] | None = None, unserved: tuple[str, ...] = (),
            route: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status with spec.gateway (and `route` as spec.gateway.route), `live` the HTTPRoute read back."""
    b = body(gateway={"endpointPicker": PICKER, **({"route": route} if route else {})})
    return compute_status(b, parse_spec(b["spec"]), render(b), Observed(unserved=unserved, route=live), now="t")


def _routed(status: dict[str, Any]) -> tuple[str, str, str]:
    c = next(c for c in status["conditions"] if c["type"] == "Routed")
    return c["status"], c["reason"], c["message"]


def _cond(ctype: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}


def _route(*parents: tuple[str, str | None, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"metadata": {"name": "llama", "generation": 1}, "status": {"parents": [
        {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name,
                       **({"namespace": ns} if ns else {})},
         "controllerName": "example.net/gateway", "conditions": conds} for name, ns, conds in parents]}}


@pytest.mark.parametrize("unserved,named,absent", [
    (("InferencePool", "HTTPRoute"), ["inferencepools.inference.networking.k8s.io",
                                      "httproutes.gateway.networking.k8s.io"], []),
    (("InferencePool",), ["inferencepools.inference.networking.k8s.io"], ["httproutes"]),
    (("HTTPRoute",), ["httproutes.gateway.networking.k8s.io"], ["inferencepools"]),
])
def test_missing_apis_are_named_and_the_service_is_degraded_never_failed(
        unserved: tuple[str, ...], named: list[str], absent: list[str]) -> None:
    status = _status(unserved=unserved, route=ROUTE)
    ok, reason, message = _routed(status)
    assert (ok, reason) == ("False", "GatewayAPINotInstalled")
    assert all(n in message for n in named) and not any(a in message for a in absent), message
    assert "the pods still serve through their Service" in message
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "GatewayAPINotInstalled" and status["phase"] == "Degraded"


def test_a_pool_without_a_route_is_reported_as_applied() -> None:
    ok, reason, message = _routed(_status())
    assert (ok, reason) == ("True", "InferencePoolApplied") and "llama-epp:9002" in message
    assert _status()["gateway"] == {"inferencePool": "llama", "endpointPicker": "llama-epp:9002"}


def test_a_route_no_controller_wrote_about_is_pending() -> None:
    ok, reason, message = _routed(_status({"metadata": {"name": "llama"}}, route=ROUTE))
    assert (ok, reason) == ("False", "RoutePending") and "gateway-system/inference-gateway" in message


def test_the_routes_conditions_are_reported_as_its_controller_wrote_them() -> None:
    route = _route(("inference-gateway", "gateway-system", [
        _cond("Accepted", "True", "Accepted"),
        _cond("ResolvedRefs", "False", "InvalidKind", "InferencePool is not a supported backend kind")]))
    status = _status(route, route=ROUTE)
    ok, reason, message = _routed(status)
    assert (ok, reason) == ("False", "RouteRefsNotResolved")
    assert "Accepted=True (Accepted)" in message
    assert "ResolvedRefs=False (InvalidKind: InferencePool is not a supported backend kind)" in message
    assert status["gateway"] == {"inferencePool": "llama", "endpointPicker": "llama-epp:9002", "httpRoute": "llama",
                                 "parents": [{
        "gateway": "gateway-system/inference-gateway", "controllerName": "example.net/gateway", "conditions": [
            {"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""},
            {"type": "ResolvedRefs", "status": "False", "reason": "InvalidKind",
             "message": "InferencePool is not a supported backend kind"}]}]}


def test_a_route_the_gateway_refused_says_so_first() -> None:
    route = _route(("inference-gateway", "gateway-system", [
        _cond("Accepted", "False", "NotAllowedByListeners", "no listener admits namespace ml"),
        _cond("ResolvedRefs", "False", "BackendNotFound")]))
    ok, reason, message = _routed(_status(route, route=ROUTE))
    assert (ok, reason) == ("False", "RouteNotAccepted") and "NotAllowedByListeners" in message


def test_an_accepted_route_with_resolved_refs_is_routed_and_other_gateways_are_ignored() -> None:
    route = _route(("inference-gateway", "gateway-system", [_cond("Accepted", "True", "Accepted"),
                                                           _cond("ResolvedRefs", "True", "ResolvedRefs")]),
                   ("other", None, [_cond("Accepted", "False", "NoMatchingParent")]))
    status = _status(route, route=ROUTE)
    assert _routed(status)[:2] == ("True", "RouteAccepted")
    assert [p["gateway"] for p in status["gateway"]["parents"]] == ["gateway-system/inference-gateway"]
    assert status["phase"] != "Degraded"


def test_a_draining_pod_leaves_the_pool_before_it_stops_taking_requests() -> None:
    """The picker keeps a pod only while it is Ready and not being deleted (upstream's pod reconciler),
    so the ordering is: the deletion drops the pod from the pool at once; the preStop hook holds SIGTERM
    back for PRESTOP_SECONDS, while the runtime still serves what the gateway routed before it knew;
    then SIGTERM: /health answers 503 (readiness fails, tests/runtime/test_drain.py), new requests get
    503, and the running ones finish within the runtime's grace, inside the pod's."""
    dep = _gateway()["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": PRESTOP_SECONDS}} and PRESTOP_SECONDS > 0
    grace = int(c["args"][c["args"].index("--shutdown-grace-seconds") + 1])
    assert PRESTOP_SECONDS + grace < pod["terminationGracePeriodSeconds"]


OWN = PickerConfig(image="registry.example/epp:v1", args=("--v=3",), cluster_role="gso-endpoint-picker")


def test_without_a_named_picker_the_operator_runs_one_from_the_charts_image() -> None:
    b = body(replicas=2, gateway={"route": ROUTE})
    r = render(b, picker=OWN)
    kids = {(c["kind"], c["metadata"]["name"]): c for c in r.children}
    sa, rb = kids[("ServiceAccount", "llama-epp")], kids[("RoleBinding", "llama-epp")]
    dep, svc, pool = kids[("Deployment", "llama-epp")], kids[("Service", "llama-epp")], kids[("InferencePool", "llama")]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "gso-endpoint-picker"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "llama-epp", "namespace": "ml"}]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and c["image"] == OWN.image
    assert c["args"] == ["--pool-name", "llama", "--pool-namespace", "ml", "--grpc-port", "9002",
                         "--grpc-health-port", "9003", "--v=3"]
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "llama-epp"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": svc["spec"]["ports"][0]["port"]}
    # The picker's pods are neither in the pool nor counted as the service's replicas.
    picker_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert ISVC_LABEL not in picker_labels
    assert not all(picker_labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    for obj in (sa, rb, dep, svc):
        assert obj["metadata"]["ownerReferences"][0]["name"] == "llama"
        assert obj["metadata"]["labels"][ISVC_LABEL] == "llama"  # its events trigger a pass of its owner
        kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSION, strict=True)
    assert (r.picker, r.picker_managed) == ("llama-epp:9002", True)
    status = compute_status(b, parse_spec(b["spec"]), r, Observed(), now="t")
    assert status["gateway"]["endpointPickerManaged"] is True


def test_a_named_picker_is_used_even_when_the_operator_could_run_one() -> None:
    r = render(body(gateway={"endpointPicker": PICKER}), picker=OWN)
    assert [c["kind"] for c in r.children if c["metadata"]["name"] == "llama-epp"] == []
    assert (r.picker, r.picker_managed) == ("llama-epp:9002", False)


def test_without_a_picker_image_there_is_no_pool_and_the_status_says_why() -> None:
    b = body(gateway={"route": ROUTE})
    r = render(b)
    assert r.of("gateway") == [] and r.picker is None
    status = compute_status(b, parse_spec(b["spec"]), r, Observed(), now="t")
    routed_ = next(c for c in status["conditions"] if c["type"] == "Routed")
    assert (routed_["status"], routed_["reason"]) == ("False", "EndpointPickerNotConfigured")
    assert "gateway.endpointPicker.image" in routed_["message"] and "spec.gateway.endpointPicker.service" in \
        routed_["message"]
    assert next(c for c in status["conditions"] if c["type"] == "Degraded")["reason"] == "EndpointPickerNotConfigured"
    assert status["phase"] != "Failed" and "gateway" not in status
