"""spec.gateway -> an InferencePool and an HTTPRoute; the route's status -> the Routed condition (pure).

The Gateway API Inference Extension puts an endpoint picker between a gateway and the pods: the
gateway asks it which pod of an InferencePool serves each request, and it answers from the pods'
queue, KV-cache and LoRA metrics instead of round-robin. The operator renders the pool (this
service's pods, the runtime's port, the picker the user runs or its own, picker.py) and,
optionally, an HTTPRoute from a named Gateway to it. Both APIs are CRDs a cluster may not have: a kind the API server does not serve
is reported (as a ScaledObject without KEDA is), and the pods keep serving through their Service.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .spec import RUNTIME_PORT, InferenceServiceSpec

POOL_GROUP = "inference.networking.k8s.io"
ROUTE_GROUP = "gateway.networking.k8s.io"
POOL_API = f"{POOL_GROUP}/v1"
ROUTE_API = f"{ROUTE_GROUP}/v1"
KINDS = ("InferencePool", "HTTPRoute")
# What to install when the API server does not serve a kind, by the CRD's name.
CRDS = {"InferencePool": (f"inferencepools.{POOL_GROUP}", "the Gateway API Inference Extension's CRDs"),
        "HTTPRoute": (f"httproutes.{ROUTE_GROUP}", "the Gateway API's standard CRDs")}
# The route conditions a Gateway's controller writes per parent (GEP-1364), in the order reported.
ROUTE_CONDITIONS = ("Accepted", "ResolvedRefs")

__all__ = ["CRDS", "KINDS", "NO_PICKER_MESSAGE", "Routed", "gateway_status", "render_gateway",
           "routed"]


class Routed(NamedTuple):
    """The Routed condition before it is stamped (status.py)."""

    status: bool
    reason: str
    message: str


def render_pool(meta: dict[str, Any], spec: InferenceServiceSpec, selector: dict[str, str],
                picker: tuple[str, int]) -> dict[str, Any]:
    """Every pod of the service, on the runtime's port; the picker (its Service's name and port)
    tells the gateway which one."""
    assert spec.gateway is not None
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": RUNTIME_PORT}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker[0], "port": {"number": picker[1]},
                                  "failureMode": spec.gateway.endpoint_picker.failure_mode},
        },
    }


def _parent_ref(meta: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    assert spec.gateway is not None and spec.gateway.route is not None
    gw = spec.gateway.route.gateway
    ref = {"group": ROUTE_GROUP, "kind": "Gateway", "name": gw.name}
    if gw.namespace and gw.namespace != meta["namespace"]:
        ref["namespace"] = gw.namespace
    return ref


def render_route(meta: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    """From the named Gateway to the pool, under the path prefix. Every field the HTTPRoute CRD would
    default is written out, so the live spec is the rendered one."""
    assert spec.gateway is not None and spec.gateway.route is not None
    return {
        "apiVersion": ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": meta,
        "spec": {
            "parentRefs": [_parent_ref(meta, spec)],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": spec.gateway.route.path}}],
                "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": meta["name"], "weight": 1}],
            }],
        },
    }


def render_gateway(meta: dict[str, Any], spec: InferenceServiceSpec, selector: dict[str, str],
                   picker: tuple[str, int] | None) -> list[dict[str, Any]]:
    """The pool and, with spec.gateway.route, the route (none without spec.gateway, or without a picker
    to refer to: picker.picker_ref); `meta` is the children's metadata, `selector` the pods' labels
    the Deployment selects."""
    if spec.gateway is None or picker is None:
        return []
    out = [render_pool(dict(meta), spec, selector, picker)]
    if spec.gateway.route is not None:
        out.append(render_route(dict(meta), spec))
    return out


def _gateway_name(ref: dict[str, Any], namespace: str) -> str:
    return f"{ref.get('namespace') or namespace}/{ref.get('name', '?')}"


def _ours(parent: dict[str, Any], spec: InferenceServiceSpec, namespace: str) -> bool:
    """A status entry about the Gateway this route names (a controller may list others it tried)."""
    assert spec.gateway is not None and spec.gateway.route is not None
    ref, gw = parent.get("parentRef") or {}, spec.gateway.route.gateway
    return ref.get("name") == gw.name and (ref.get("namespace") or namespace) == (gw.namespace or namespace)


def route_parents(route: dict[str, Any] | None, spec: InferenceServiceSpec, namespace: str) -> list[dict[str, Any]]:
    """The route's Accepted and ResolvedRefs conditions, per Gateway, as its controller wrote them."""
    out = []
    for parent in ((route or {}).get("status") or {}).get("parents") or []:
        if not _ours(parent, spec, namespace):
            continue
        conds = {c.get("type"): c for c in parent.get("conditions") or []}
        entry: dict[str, Any] = {"gateway": _gateway_name(parent.get("parentRef") or {}, namespace), "conditions": [
            {k: str(conds[t].get(k, "")) for k in ("type", "status", "reason", "message")}
            for t in ROUTE_CONDITIONS if t in conds]}
        if parent.get("controllerName"):
            entry["controllerName"] = parent["controllerName"]
        out.append(entry)
    return out


def gateway_status(spec: InferenceServiceSpec, name: str, namespace: str, route: dict[str, Any] | None,
                   picker: str | None = None, managed: bool = False) -> dict[str, Any] | None:
    """status.gateway: the pool, its picker (`managed`: run by the operator), the route and what the
    Gateway's controller says of the route. No pool without a picker (`picker` None)."""
    if spec.gateway is None or picker is None:
        return None
    out: dict[str, Any] = {"inferencePool": name, "endpointPicker": picker}
    if managed:
        out["endpointPickerManaged"] = True
    if spec.gateway.route is not None:
        out["httpRoute"] = name
        parents = route_parents(route, spec, namespace)
        if parents:
            out["parents"] = parents
    return out


def missing_apis(unserved: tuple[str, ...]) -> str | None:
    """What to install, when the API server serves neither or only one of the two kinds."""
    missing = [f"{CRDS[k][0]} (install {CRDS[k][1]})" for k in KINDS if k in unserved]
    if not missing:
        return None
    return f"this cluster does not serve {' or '.join(missing)}"


def _route_verdict(parents: list[dict[str, Any]], gateway: str, name: str) -> Routed:
    if not parents:
        return Routed(False, "RoutePending", f"HTTPRoute {name}: no status from the controller of Gateway {gateway} "
                                             "yet (is a gateway implementation installed and the Gateway there?)")
    said = "; ".join(f"Gateway {p['gateway']}: " + ", ".join(
        f"{c['type']}={c['status']} ({c['reason']}{': ' + c['message'] if c['message'] else ''})"
        for c in p["conditions"]) for p in parents)
    for ctype, reason in (("Accepted", "RouteNotAccepted"), ("ResolvedRefs", "RouteRefsNotResolved")):
        if any(not any(c["type"] == ctype and c["status"] == "True" for c in p["conditions"]) for p in parents):
            return Routed(False, reason, f"HTTPRoute {name}: {said}")
    return Routed(True, "RouteAccepted", f"HTTPRoute {name}: {said}")


NO_PICKER_MESSAGE = ("spec.gateway.endpointPicker.service is unset and this operator has no picker image to run "
                     "one from (its chart's value gateway.endpointPicker.image): set that, or name the Service of "
                     "a picker you run; no InferencePool until then, the pods serve through their Service")


def routed(spec: InferenceServiceSpec, name: str, namespace: str, unserved: tuple[str, ...],
           route: dict[str, Any] | None, picker: str | None = None) -> Routed | None:
    """Whether requests reach the pool through the gateway, as far as the cluster tells (None: no
    spec.gateway); `picker` is the picker Service the pool refers to, None when there is none."""
    g = spec.gateway
    if g is None:
        return None
    if picker is None:
        return Routed(False, "EndpointPickerNotConfigured", NO_PICKER_MESSAGE)
    missing = missing_apis(unserved)
    if missing:
        return Routed(False, "GatewayAPINotInstalled", f"{missing}; the pods still serve through their Service")
    picker = f"picker Service {picker}"
    if g.route is None:
        return Routed(True, "InferencePoolApplied", f"InferencePool {name} ({picker}); no HTTPRoute rendered "
                                                    "(spec.gateway.route unset): route to the pool with one of your own")
    gateway = f"{g.route.gateway.namespace or namespace}/{g.route.gateway.name}"
    return _route_verdict(route_parents(route, spec, namespace), gateway, name)
