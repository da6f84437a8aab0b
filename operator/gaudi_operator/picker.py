"""The endpoint picker the operator runs for a spec.gateway that names none (pure).

The Gateway API Inference Extension's picker (EPP) serves one InferencePool: it watches the pool
and its pods, scrapes the pods' metrics and answers the gateway's ext-proc calls on port 9002.
Run from the image the operator's chart configures, it is a ServiceAccount, a RoleBinding to the
chart's picker ClusterRole (what the picker reads: pods, inference pools and objectives), a
Deployment and a Service, all named `<name>-epp` and owned by the InferenceService. Its pods do
not carry the service's pod labels: they are neither in the pool nor counted as replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import InferenceServiceSpec

GRPC_PORT = 9002  # ext-proc, what the gateway calls (the InferencePool's endpointPickerRef port)
HEALTH_PORT = 9003  # gRPC health, service "inference-extension"
PICKER_LABEL = "gaudiserve.io/endpoint-picker"
KINDS = ("ServiceAccount", "RoleBinding", "Deployment", "Service")

__all__ = ["KINDS", "PickerConfig", "picker_name", "picker_ref", "render_picker", "wants_own_picker"]


@dataclass(frozen=True)
class PickerConfig:
    """What the operator's chart says about the pickers it runs (image "" : it runs none)."""

    image: str = ""
    args: tuple[str, ...] = ()
    cluster_role: str = ""


def picker_name(name: str) -> str:
    return f"{name}-epp"


def wants_own_picker(spec: InferenceServiceSpec) -> bool:
    """spec.gateway names no picker Service: the operator is to run one."""
    return spec.gateway is not None and spec.gateway.endpoint_picker.service is None


def _meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "name": picker_name(meta["name"])}


def _pod_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "gaudi-serve-epp", PICKER_LABEL: name}


def _container(meta: dict[str, Any], picker: PickerConfig) -> dict[str, Any]:
    probe = {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 10}
    return {
        "name": "epp",
        "image": picker.image,
        "args": ["--pool-name", meta["name"], "--pool-namespace", meta["namespace"],
                 "--grpc-port", str(GRPC_PORT), "--grpc-health-port", str(HEALTH_PORT), *picker.args],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "initialDelaySeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _deployment(meta: dict[str, Any], picker: PickerConfig) -> dict[str, Any]:
    labels = _pod_labels(meta["name"])
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(meta),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": picker_name(meta["name"]),
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [_container(meta, picker)]}},
        },
    }


def render_picker(meta: dict[str, Any], spec: InferenceServiceSpec, picker: PickerConfig) -> list[dict[str, Any]]:
    """The picker's objects when the spec wants the operator's own and the chart gives an image; else none.
    `meta` is the children's metadata (named like the service)."""
    if not wants_own_picker(spec) or not picker.image:
        return []
    name = picker_name(meta["name"])
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": picker.cluster_role},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}]},
        _deployment(meta, picker),
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(meta),
         "spec": {"selector": _pod_labels(meta["name"]),
                  "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT, "protocol": "TCP",
                             "appProtocol": "http2"}]}},
    ]


def picker_ref(spec: InferenceServiceSpec, name: str, picker: PickerConfig) -> tuple[str, int] | None:
    """The picker Service the InferencePool refers to: the one the spec names, else the operator's own
    when the chart gives it an image; None when there is none to refer to (or no spec.gateway)."""
    if spec.gateway is None:
        return None
    service = spec.gateway.endpoint_picker.service
    if service is not None:
        return service.name, service.port
    return (picker_name(name), GRPC_PORT) if picker.image else None
