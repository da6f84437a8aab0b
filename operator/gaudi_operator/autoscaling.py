"""spec.autoscaling -> the autoscaler's manifest, and its live status -> status.autoscaling (pure).

Both engines scale the InferenceService itself through its scale subresource
(they write spec.replicas); the operator only follows spec.replicas, so it
never fights them. `hpa` renders an autoscaling/v2 HorizontalPodAutoscaler on
Pods metrics named as the runtime exports them (a custom-metrics adapter
serves them); `keda` renders a KEDA ScaledObject whose Prometheus triggers sum
the same gauges over the service's pods.
"""

from __future__ import annotations

from typing import Any

from .spec import GROUP, VERSION, Autoscaling, InferenceServiceSpec

# Target -> the runtime's gauge (runtime/gaudi_runtime/router/metrics.py; a test checks they agree).
METRICS = {
    "queue_size": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "running_requests": "vllm:num_requests_running",
}
KEDA_API = "keda.sh/v1alpha1"
KINDS = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}

__all__ = ["KINDS", "METRICS", "render_autoscaler", "autoscaling_status"]


def quantity(x: float) -> str:
    """A Kubernetes quantity for a target: whole numbers as is, fractions in milli-units (0.6 -> 600m)."""
    milli = round(x * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _targets(a: Autoscaling) -> list[tuple[str, str, float]]:
    """(field, metric, per-pod target) of each target set."""
    return [(f, METRICS[f], getattr(a.targets, f)) for f in METRICS if getattr(a.targets, f) is not None]


def _behavior(a: Autoscaling) -> dict[str, Any]:
    """autoscaling/v2 HorizontalPodAutoscalerBehavior."""
    def direction(d: Any) -> dict[str, Any]:
        return {"stabilizationWindowSeconds": d.stabilization_window_seconds, "selectPolicy": "Max",
                "policies": [{"type": "Pods", "value": d.pods, "periodSeconds": d.period_seconds}]}
    return {"scaleUp": direction(a.behavior.scale_up), "scaleDown": direction(a.behavior.scale_down)}


def _target_ref(name: str) -> dict[str, str]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "name": name}


def render_hpa(meta: dict[str, Any], a: Autoscaling) -> dict[str, Any]:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": metric},
                                         "target": {"type": "AverageValue", "averageValue": quantity(target)}}}
               for _, metric, target in _targets(a)]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {"scaleTargetRef": _target_ref(meta["name"]), "minReplicas": a.min_replicas,
                 "maxReplicas": a.max_replicas, "metrics": metrics, "behavior": _behavior(a)},
    }


def keda_query(metric: str, namespace: str, name: str) -> str:
    """The sum of a gauge over the service's pods (a Deployment's pods are named <name>-<hash>-<id>)."""
    return f'sum({metric}{{namespace="{namespace}",pod=~"{name}-[a-z0-9]+-[a-z0-9]+"}})'


def render_scaled_object(meta: dict[str, Any], a: Autoscaling) -> dict[str, Any]:
    assert a.prometheus is not None  # spec.py requires it with engine keda
    triggers = []
    for field, metric, target in _targets(a):
        trigger: dict[str, Any] = {
            "type": "prometheus", "name": field.replace("_", "-"),
            # AverageValue: the sum over the pods, divided by the target, is the count wanted.
            "metricType": "AverageValue",
            "metadata": {"serverAddress": a.prometheus.server_address,
                         "query": keda_query(metric, meta["namespace"], meta["name"]),
                         "threshold": f"{target:g}"},
        }
        if a.prometheus.authentication_ref:
            trigger["authenticationRef"] = {"name": a.prometheus.authentication_ref.name}
        triggers.append(trigger)
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {"scaleTargetRef": _target_ref(meta["name"]), "minReplicaCount": a.min_replicas,
                 "maxReplicaCount": a.max_replicas, "pollingInterval": 15,
                 "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}},
                 "triggers": triggers},
    }


def render_autoscaler(meta: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The autoscaler of `spec.autoscaling` (none without it); `meta` is the children's metadata."""
    a = spec.autoscaling
    if a is None:
        return []
    return [render_hpa(meta, a) if a.engine == "hpa" else render_scaled_object(meta, a)]


def _hpa_status(live: dict[str, Any]) -> dict[str, Any]:
    st = live.get("status") or {}
    out: dict[str, Any] = {}
    if st.get("desiredReplicas") is not None:
        out["desiredReplicas"] = st["desiredReplicas"]
    if st.get("lastScaleTime"):
        out["lastScaleTime"] = st["lastScaleTime"]
    current = {m["pods"]["metric"]["name"]: m["pods"]["current"]["averageValue"]
               for m in st.get("currentMetrics") or [] if m.get("type") == "Pods" and m.get("pods")}
    if current:
        out["current"] = current
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    for ctype, bad in (("AbleToScale", "False"), ("ScalingActive", "False"), ("ScalingLimited", "True")):
        if conds.get(ctype, {}).get("status") == bad and conds[ctype].get("message"):
            out["message"] = conds[ctype]["message"]
            break
    return out


def _keda_status(live: dict[str, Any]) -> dict[str, Any]:
    conds = {c.get("type"): c for c in (live.get("status") or {}).get("conditions") or []}
    ready = conds.get("Ready") or {}
    return {"message": ready["message"]} if ready.get("status") == "False" and ready.get("message") else {}


def autoscaling_status(spec: InferenceServiceSpec, live: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.autoscaling from the live autoscaler (None: autoscaling is off)."""
    a = spec.autoscaling
    if a is None:
        return None
    kind = KINDS[a.engine]
    out: dict[str, Any] = {"engine": a.engine, "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas}
    if live is not None:
        out["autoscaler"] = f"{kind}/{live['metadata']['name']}"
        out.update(_hpa_status(live) if a.engine == "hpa" else _keda_status(live))
    return out
