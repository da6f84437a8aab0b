"""spec.autoscaling and spec.serving.drainSeconds: the autoscaler the operator renders (a
HorizontalPodAutoscaler or a KEDA ScaledObject scaling the InferenceService itself), the graceful
scale-down of its pods, and status.autoscaling read off the autoscaler's own status (pure)."""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import kubernetes
import kubernetes_validate
import pytest

from gaudi_operator.autoscaling import METRICS, autoscaling_status, keda_query, quantity
from gaudi_operator.components import render
from gaudi_operator.components.base import stale
from gaudi_operator.spec import parse_spec
from gaudi_runtime.config import add_arguments, resolve
from gaudi_runtime.router.metrics import LOAD_GAUGES
from tests.unit.test_operator_crd import admit, manifest
from tests.unit.test_operator_render import body, children

K8S_VERSION = "1.37.0"
PROM = {"serverAddress": "http://prometheus.monitoring:9090"}


def test_the_autoscaler_reads_the_gauges_the_runtime_exports() -> None:
    assert sorted(METRICS.values()) == sorted(LOAD_GAUGES)


def test_hpa_scales_the_inference_service_on_pods_metrics_with_slow_start_defaults() -> None:
    hpa = children(autoscaling={"maxReplicas": 4})["HorizontalPodAutoscaler"]
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
                                      "name": "llama"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    assert spec["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "30"}}},
        {"type": "Pods", "pods": {"metric": {"name": "vllm:kv_cache_usage_perc"},
                                  "target": {"type": "AverageValue", "averageValue": "600m"}}}]
    assert spec["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 60, "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
        "scaleDown": {"stabilizationWindowSeconds": 600, "selectPolicy": "Max",
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert hpa["metadata"]["ownerReferences"][0]["name"] == "llama"


def test_every_target_and_behaviour_setting_reaches_the_hpa() -> None:
    hpa = children(autoscaling={"minReplicas": 2, "maxReplicas": 6, "targets": {
        "queueSize": 8, "kvCacheUsage": 0.75, "runningRequests": 48}, "behavior": {
        "scaleUp": {"stabilizationWindowSeconds": 0, "pods": 4, "periodSeconds": 30},
        "scaleDown": {"stabilizationWindowSeconds": 900, "pods": 2, "periodSeconds": 300}}})["HorizontalPodAutoscaler"]
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {"vllm:num_requests_waiting": "8", "vllm:kv_cache_usage_perc": "750m",
                       "vllm:num_requests_running": "48"}
    b = hpa["spec"]["behavior"]
    assert (b["scaleUp"]["stabilizationWindowSeconds"], b["scaleUp"]["policies"][0]["value"]) == (0, 4)
    assert (b["scaleDown"]["stabilizationWindowSeconds"], b["scaleDown"]["policies"][0]["periodSeconds"]) == \
        (900, 300)


@pytest.mark.parametrize("x,q", [(30, "30"), (0.6, "600m"), (1, "1"), (0.01, "10m"), (0.755, "755m")])
def test_quantity(x: float, q: str) -> None:
    assert quantity(x) == q


def test_keda_scaled_object_sums_the_gauges_over_the_services_pods() -> None:
    so = children(autoscaling={"engine": "keda", "minReplicas": 1, "maxReplicas": 8,
                               "targets": {"queueSize": 10, "kvCacheUsage": 0.5},
                               "prometheus": {**PROM, "authenticationRef": {"name": "prom-auth"}}})["ScaledObject"]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["kind"] == "InferenceService" and spec["scaleTargetRef"]["name"] == "llama"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 8)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] \
        == 600
    assert spec["triggers"] == [
        {"type": "prometheus", "name": "queue-size", "metricType": "AverageValue", "metadata": {
            "serverAddress": PROM["serverAddress"], "threshold": "10",
            "query": 'sum(vllm:num_requests_waiting{namespace="ml",pod=~"llama-[a-z0-9]+-[a-z0-9]+"})'},
         "authenticationRef": {"name": "prom-auth"}},
        {"type": "prometheus", "name": "kv-cache-usage", "metricType": "AverageValue", "metadata": {
            "serverAddress": PROM["serverAddress"], "threshold": "0.5",
            "query": 'sum(vllm:kv_cache_usage_perc{namespace="ml",pod=~"llama-[a-z0-9]+-[a-z0-9]+"})'},
         "authenticationRef": {"name": "prom-auth"}}]


def test_keda_query_matches_this_services_pods_only() -> None:
    import re

    pattern = re.search(r'pod=~"([^"]+)"', keda_query("m", "ml", "llama")).group(1)
    assert re.fullmatch(pattern, "llama-7d9c5b6f8-x2kqz")
    assert not re.fullmatch(pattern, "llama-big-7d9c5b6f8-x2kqz")  # another service named llama-big
    assert not re.fullmatch(pattern, "llama")


@pytest.mark.parametrize("autoscaling,kind", [(None, None), ({"maxReplicas": 2}, "HorizontalPodAutoscaler"),
                                              ({"maxReplicas": 2, "engine": "keda", "prometheus": PROM},
                                               "ScaledObject")])
def test_one_autoscaler_at_most_and_the_other_is_removed(autoscaling: dict | None, kind: str | None) -> None:
    r = render(body(**({"autoscaling": autoscaling} if autoscaling else {})))
    kinds = {c["kind"] for c in r.children}
    autoscalers = {"HorizontalPodAutoscaler", "ScaledObject"}
    assert kinds & autoscalers == ({kind} if kind else set())
    # Owning both kinds (one left from an earlier engine), a pass deletes the one not rendered.
    left = [{"kind": k, "metadata": {"name": "llama"}} for k in sorted(autoscalers)]
    assert {o["kind"] for o in stale(left, r.of("autoscaler"), r.held)} == autoscalers - kinds


def test_autoscaled_services_keep_their_pdb_at_any_count() -> None:
    assert "PodDisruptionBudget" in children(replicas=1, autoscaling={"maxReplicas": 3})
    assert "PodDisruptionBudget" not in children(replicas=1, autoscaling={"minReplicas": 1, "maxReplicas": 1})
    # The Deployment follows spec.replicas, which the autoscaler writes through the scale subresource.
    assert children(replicas=3, autoscaling={"maxReplicas": 4})["Deployment"]["spec"]["replicas"] == 3


def test_hpa_validates_against_kubernetes_openapi_and_client_models() -> None:
    hpa = children(autoscaling={"maxReplicas": 4, "targets": {"runningRequests": 32, "kvCacheUsage": 0.9}})[
        "HorizontalPodAutoscaler"]
    kubernetes_validate.validate(copy.deepcopy(hpa), K8S_VERSION, strict=True)
    api = kubernetes.client.ApiClient()
    model = api.deserialize(json.dumps(hpa), "V2HorizontalPodAutoscaler", "application/json")
    assert api.sanitize_for_serialization(model) == hpa


@pytest.mark.parametrize("drain", [40, 300, 1800])
def test_graceful_scale_down_preStop_grace_period_and_runtime_grace(drain: int) -> None:
    dep = children(serving={"drainSeconds": drain})["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] == drain
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    # The runtime's own parser reads the rendered flag: its drain ends 30 s before the kubelet's SIGKILL.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(c["args"][1:])
    cfg = resolve(args, {}, device_count=lambda _: 1)
    assert cfg.server.shutdown_grace_seconds == drain - 30
    assert 5 + cfg.server.shutdown_grace_seconds + 5 + 10 < drain  # preStop, drain, cut requests, stop the shards
    kubernetes_validate.validate(copy.deepcopy(dep), K8S_VERSION, strict=True)


def test_spec_defaults_equal_crd_defaults_with_autoscaling() -> None:
    defaulted, errors = admit(manifest(autoscaling={"maxReplicas": 3}))
    assert not errors
    assert defaulted["spec"]["autoscaling"]["targets"] == {"queueSize": 30, "kvCacheUsage": 0.6}
    from_crd = parse_spec(defaulted["spec"]).model_dump(by_alias=True)
    from_code = parse_spec(manifest(autoscaling={"maxReplicas": 3})["spec"]).model_dump(by_alias=True)
    assert from_crd == from_code


def _live_hpa(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llama"}, "status": status}


def test_status_reports_what_the_hpa_sees_and_why_it_cannot_scale() -> None:
    spec = parse_spec({"model": {"id": "m"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})
    assert autoscaling_status(spec, None) == {"engine": "hpa", "minReplicas": 1, "maxReplicas": 3}
    live = _live_hpa(desiredReplicas=3, currentReplicas=2, lastScaleTime="2026-01-01T00:00:00Z", currentMetrics=[
        {"type": "Pods", "pods": {"metric": {"name": "vllm:num_requests_waiting"},
                                  "current": {"averageValue": "45"}}}], conditions=[
        {"type": "AbleToScale", "status": "True", "message": "recommended size matches current size"},
        {"type": "ScalingActive", "status": "True", "message": "the HPA was able to compute the replica count"},
        {"type": "ScalingLimited", "status": "True", "message": "the desired replica count is more than the maximum"}])
    assert autoscaling_status(spec, live) == {
        "engine": "hpa", "autoscaler": "HorizontalPodAutoscaler/llama", "minReplicas": 1, "maxReplicas": 3,
        "desiredReplicas": 3, "lastScaleTime": "2026-01-01T00:00:00Z",
        "current": {"vllm:num_requests_waiting": "45"},
        "message": "the desired replica count is more than the maximum"}
    broken = _live_hpa(desiredReplicas=1, conditions=[{"type": "ScalingActive", "status": "False", "message":
                       "unable to get metric vllm:num_requests_waiting: no custom metrics API registered"}])
    assert "no custom metrics API" in autoscaling_status(spec, broken)["message"]


def test_status_reports_a_scaled_object_that_is_not_ready() -> None:
    spec = parse_spec({"model": {"id": "m"}, "autoscaling": {"engine": "keda", "maxReplicas": 3,
                                                             "prometheus": PROM}})
    live = {"metadata": {"name": "llama"}, "status": {"conditions": [
        {"type": "Ready", "status": "False", "message": "Triggers defined in ScaledObject are not working correctly"}]}}
    assert autoscaling_status(spec, live) == {
        "engine": "keda", "autoscaler": "ScaledObject/llama", "minReplicas": 1, "maxReplicas": 3,
        "message": "Triggers defined in ScaledObject are not working correctly"}
