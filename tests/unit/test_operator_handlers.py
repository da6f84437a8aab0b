"""handlers.reconcile with a fake kube (patch only on change, events only on phase change),
kube.fetch_warmup against real HTTP servers on 127.0.0.1, and the CLI's options."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from typing import Any

import pytest
from aiohttp import web

from gaudi_operator import cli, handlers, kube
from gaudi_operator.components import COMPONENT_LABEL
from gaudi_operator.config import OperatorConfig
from gaudi_operator.render import TEMPLATE_HASH_LABEL

ISVC = {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 1},
        "spec": {"model": {"id": "m"}, "replicas": 1}}
CONFIG = OperatorConfig()


class FakeKube:
    """In-memory stand-in for gaudi_operator.kube (the only I/O module)."""

    def __init__(self, body: dict[str, Any] | None) -> None:
        self.body = copy.deepcopy(body)
        self.applied: list[dict[str, Any]] = []
        self.children: dict[tuple[str, str], dict[str, Any]] = {}  # (kind, name) -> the live child
        self.deleted: list[tuple[str, str, str]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []
        self.pods: list[dict[str, Any]] = []
        self.warmup: dict[str, dict[str, Any]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}  # pod -> its log
        self.log_reads: list[str] = []
        self.health: dict[str, dict[str, Any]] = {}  # pod -> its /health answer
        self.health_reads: list[str] = []
        self.lists: list[tuple[str, str]] = []
        self.conflicts = 0  # the next writes of a Job that fail as if it changed meanwhile

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "Job":
            return copy.deepcopy(self.jobs.get(name))
        return copy.deepcopy(self.body)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        if name in self.jobs:
            raise kube.Conflict(f"jobs {name!r} already exists")
        self.jobs[name] = {**copy.deepcopy(obj), "status": {}}
        self.jobs[name]["metadata"].update(uid=f"job-{name}", resourceVersion="1")
        return copy.deepcopy(self.jobs[name])

    async def patch_if_unchanged(self, obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        live = self.jobs[obj["metadata"]["name"]]
        if self.conflicts or live["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            self.conflicts = max(0, self.conflicts - 1)
            live["metadata"]["resourceVersion"] = str(int(live["metadata"]["resourceVersion"]) + 1)
            raise kube.Conflict("the object has been modified")
        live["metadata"].update(patch["metadata"])
        live["metadata"]["resourceVersion"] = str(int(live["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(live)

    async def pod_log(self, namespace: str, pod: str, container: str, **_: Any) -> str | None:
        self.log_reads.append(pod)
        return self.logs.get(pod)

    async def fetch_health(self, pod: dict[str, Any], port: int, **_: Any) -> dict[str, Any] | None:
        self.health_reads.append(pod["metadata"]["name"])
        return self.health.get(pod["metadata"]["name"])

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(obj)
        live = {**obj, "metadata": {**obj["metadata"], "generation": 1}, "status": {"observedGeneration": 1}}
        self.children[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(live)
        return live

    async def delete(self, kind: str, namespace: str, name: str, resource_version: str | None = None) -> bool:
        self.deleted.append((kind, namespace, name))
        if kind == "Job":
            return self.jobs.pop(name, None) is not None
        return self.children.pop((kind, name), None) is not None

    async def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.lists.append((kind, selector))
        objects = self.jobs.values() if kind == "Job" else [o for (k, _), o in self.children.items() if k == kind]
        terms = [t.partition("=") for t in selector.split(",")]
        return [{**copy.deepcopy(o), "kind": kind} for o in objects
                if all((o["metadata"].get("labels") or {}).get(k) == v for k, _, v in terms)]

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        key, _, value = selector.partition("=")
        return [copy.deepcopy(p) for p in self.pods if (p["metadata"].get("labels") or {}).get(key) == value]

    async def fetch_warmup(self, pods: list[dict[str, Any]], port: int, **_: Any) -> dict[str, dict[str, Any]]:
        return dict(self.warmup)

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        assert self.body is not None
        self.status_patches.append(patch)
        status = self.body.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        return self.body

    async def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeKube:
    f = FakeKube(ISVC)
    for name in ("get", "apply", "delete", "list_pods", "fetch_warmup", "patch_status", "post_event", "create",
                 "patch_if_unchanged", "pod_log", "fetch_health", "list_objects"):
        monkeypatch.setattr(kube, name, getattr(f, name))
    return f


def _pod(f: FakeKube, ready: bool, name: str = "llama-0") -> dict[str, Any]:
    tmpl = next(c for c in f.applied if c["kind"] == "Deployment")["spec"]["template"]
    return {"metadata": {"name": name, "labels": dict(tmpl["metadata"]["labels"]),
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "10.1.1.1",
                       "conditions": [{"type": "Ready", "status": str(ready)}],
                       "containerStatuses": [{"name": "runtime", "state": {"running": {}}, "restartCount": 0}]}}


async def test_status_patched_only_on_change_and_events_only_on_phase_change(fake: FakeKube) -> None:
    await handlers.reconcile("ml", "llama", CONFIG)
    assert [c["kind"] for c in fake.applied] == ["Deployment", "Service"]
    assert fake.deleted == []  # nothing owned that is not rendered: no DELETE
    assert len(fake.status_patches) == 1 and fake.body["status"]["phase"] == "Pending"
    assert [e[1] for e in fake.events] == ["Pending"]

    await handlers.reconcile("ml", "llama", CONFIG)  # nothing changed
    assert len(fake.status_patches) == 1 and len(fake.events) == 1

    fake.pods = [_pod(fake, ready=False)]
    fake.warmup = {"llama-0": {"done": 1, "total": 4}}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.body["status"]["phase"] == "WarmingUp" and [e[1] for e in fake.events][-1] == "WarmingUp"

    fake.warmup = {"llama-0": {"done": 3, "total": 4}}  # progress: a patch, but no event
    await handlers.reconcile("ml", "llama", CONFIG)
    assert len(fake.status_patches) == 3 and len(fake.events) == 2
    assert fake.body["status"]["warmupSummary"] == "3/4"

    fake.pods = [_pod(fake, ready=True)]
    fake.warmup = {}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.body["status"]["phase"] == "Ready" and "warmup" not in fake.body["status"]
    assert fake.events[-1][:2] == ("Normal", "Ready")


async def test_network_policy_admits_the_operator_where_it_runs_and_goes_with_the_spec(fake: FakeKube) -> None:
    assert fake.body is not None
    fake.body["spec"]["networkPolicy"] = {"from": [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]}
    config = OperatorConfig.from_env({"GAUDI_OPERATOR_NAMESPACE": "gaudi-system",
                                      "GAUDI_OPERATOR_POD_LABELS": "app.kubernetes.io/name=gaudi-serve-operator,"
                                                                   "app.kubernetes.io/instance=gso"})
    await handlers.reconcile("ml", "llama", config)
    (np,) = [c for c in fake.applied if c["kind"] == "NetworkPolicy"]
    assert np["spec"]["ingress"][0]["from"][-1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gaudi-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gaudi-serve-operator",
                                        "app.kubernetes.io/instance": "gso"}}}
    assert ("NetworkPolicy", "ml", "llama") not in fake.deleted
    del fake.body["spec"]["networkPolicy"]
    await handlers.reconcile("ml", "llama", config)
    assert ("NetworkPolicy", "ml", "llama") in fake.deleted


def _child(kind: str, component: str, uid: str | None = "u", name: str = "llama") -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "gaudi-serve-operator", "gaudiserve.io/inference-service": "llama"}
    if component:
        labels[COMPONENT_LABEL] = component
    refs = [{"kind": "InferenceService", "name": "llama", "uid": uid, "controller": True}] if uid else []
    return {"kind": kind, "metadata": {"name": name, "namespace": "ml", "labels": labels, "ownerReferences": refs}}


async def test_a_child_is_adopted_by_its_owner_reference_and_component_label(fake: FakeKube) -> None:
    """What a pass deletes is what it owns: the component's label and an ownerReference to this object,
    whoever created it; the same kind under another owner, or without the label, is not its own."""
    for kind, component, uid, name in (("NetworkPolicy", "workload", "u", "llama"),
                                       ("HorizontalPodAutoscaler", "autoscaler", "u", "llama-old"),
                                       ("PodDisruptionBudget", "workload", "other", "llama"),
                                       ("ScaledObject", "", "u", "llama")):
        fake.children[(kind, name)] = _child(kind, component, uid, name)
    await handlers.reconcile("ml", "llama", CONFIG)
    assert sorted(fake.deleted) == [("HorizontalPodAutoscaler", "ml", "llama-old"), ("NetworkPolicy", "ml", "llama")]
    assert ("PodDisruptionBudget", "llama") in fake.children and ("ScaledObject", "llama") in fake.children
    assert all(c["metadata"]["labels"][COMPONENT_LABEL] == "workload" for c in fake.applied)
    fake.deleted.clear()
    await handlers.reconcile("ml", "llama", CONFIG)  # none left: a pass sends no DELETE
    assert fake.deleted == []


async def test_a_child_no_longer_rendered_is_deleted(fake: FakeKube) -> None:
    """Autoscaling, then not: the autoscaler goes; a gateway, then not: the pool and route go, found by
    their labels (not by a watch, which a CRD installed after the operator started may never get)."""
    assert fake.body is not None
    fake.body["spec"] = {"model": {"id": "m"}, "autoscaling": {"maxReplicas": 3}, "gateway": GATEWAY}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert {("HorizontalPodAutoscaler", "llama"), ("InferencePool", "llama"), ("HTTPRoute", "llama")} <= set(
        fake.children)
    fake.body["spec"] = {"model": {"id": "m"}}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert sorted(fake.deleted) == [("HTTPRoute", "ml", "llama"), ("HorizontalPodAutoscaler", "ml", "llama"),
                                    ("InferencePool", "ml", "llama"), ("PodDisruptionBudget", "ml", "llama")]
    assert set(fake.children) == {("Deployment", "llama"), ("Service", "llama")}
    assert "gateway" not in fake.body["status"] and "autoscaling" not in fake.body["status"]


async def test_gone_or_deleting_object_is_left_alone(fake: FakeKube) -> None:
    fake.body = None
    assert await handlers.reconcile("ml", "llama", CONFIG) is None
    fake.body = copy.deepcopy(ISVC)
    fake.body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert await handlers.reconcile("ml", "llama", CONFIG) is None
    assert fake.applied == [] and fake.status_patches == []


async def test_invalid_spec_is_reported_not_applied(fake: FakeKube) -> None:
    assert fake.body is not None
    fake.body["spec"]["shards"] = 3
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.applied == []
    assert fake.body["status"]["phase"] == "Failed"
    assert fake.events == [("Warning", "Failed", "spec.shards must be one of 1, 2, 4 or 8 (Gaudi cards per replica)")]


async def test_a_child_the_api_server_refuses_is_reported_in_the_status(fake: FakeKube,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    message = ('Deployment.apps "llama" is invalid: spec.template.spec.priorityClassName: Invalid value: '
               '"Bad Name": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters')

    async def refuse(obj: dict[str, Any]) -> dict[str, Any]:
        raise kube.Invalid(message)
    monkeypatch.setattr(kube, "apply", refuse)
    assert fake.body is not None
    fake.body["spec"]["podTemplate"] = {"spec": {"priorityClassName": "Bad Name"}}
    await handlers.reconcile("ml", "llama", CONFIG)
    status = fake.body["status"]
    assert status["phase"] == "Failed"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == ("InvalidSpec", message)
    assert fake.events == [("Warning", "Failed", message)]
    await handlers.reconcile("ml", "llama", CONFIG)  # the same refusal again: nothing new to say
    assert len(fake.status_patches) == 1 and len(fake.events) == 1


# ---- the model-cache download ------------------------------------------------------------

PREFETCH = {"id": "org/m", "revision": "v1", "cache": {"persistentVolumeClaim": {"claimName": "models"},
                                                        "prefetch": True}}


def _prefetching(fake: FakeKube, uid: str = "u", **model: Any) -> None:
    assert fake.body is not None
    fake.body["metadata"]["uid"] = uid
    fake.body["spec"]["model"] = {**PREFETCH, **model}


def _job_pod(job: dict[str, Any], name: str, phase: str, **state: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": dict(job["spec"]["template"]["metadata"]["labels"]),
                         "ownerReferences": [{"kind": "Job", "name": job["metadata"]["name"],
                                              "uid": job["metadata"]["uid"]}]},
            "status": {"phase": phase, "containerStatuses": [{"name": "download", "state": state or {"running": {}}}]}}


def _cond(fake: FakeKube, ctype: str) -> tuple[str, str]:
    assert fake.body is not None
    c = next(c for c in fake.body["status"]["conditions"] if c["type"] == ctype)
    return c["status"], c["reason"]


async def test_the_deployment_waits_for_the_download_job(fake: FakeKube) -> None:
    _prefetching(fake)
    await handlers.reconcile("ml", "llama", CONFIG)
    (job,) = fake.jobs.values()
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == ["u"]
    assert "Deployment" not in [c["kind"] for c in fake.applied]  # neither created nor changed
    assert fake.body["status"]["phase"] == "Downloading" and _cond(fake, "Downloaded") == ("False", "Downloading")
    assert fake.body["status"]["download"] == {"job": job["metadata"]["name"], "state": "Pending"}

    fake.pods = [_job_pod(job, "dl-a", "Running")]
    fake.logs["dl-a"] = '{"event": "progress", "done": 100, "total": 400, "file": "model.safetensors"}\n'
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.body["status"]["download"] == {"job": job["metadata"]["name"], "state": "Downloading", "done": 100,
                                               "total": 400, "file": "model.safetensors"}
    assert [e[1] for e in fake.events] == ["Downloading"]  # one phase, one event, whatever the progress

    fake.jobs[job["metadata"]["name"]]["status"] = {"conditions": [{"type": "Complete", "status": "True"}],
                                                    "succeeded": 1}
    fake.pods = [_job_pod(job, "dl-a", "Succeeded", terminated={"exitCode": 0})]
    fake.logs["dl-a"] += '{"event": "done", "bytes": 400, "fetched": 400, "seconds": 2.5, "path": "/data/hub/x"}\n'
    fake.applied.clear()
    await handlers.reconcile("ml", "llama", CONFIG)
    assert [c["kind"] for c in fake.applied] == ["Deployment", "Service"]
    assert _cond(fake, "Downloaded") == ("True", "Downloaded") and fake.body["status"]["phase"] == "Pending"
    assert fake.body["status"]["download"]["seconds"] == 2.5
    reads = len(fake.log_reads)
    await handlers.reconcile("ml", "llama", CONFIG)  # the completed download's log is read once
    assert len(fake.log_reads) == reads and fake.body["status"]["download"]["total"] == 400


async def test_a_second_service_joins_the_job_and_the_last_to_leave_deletes_it(fake: FakeKube) -> None:
    _prefetching(fake, uid="u1")
    await handlers.reconcile("ml", "llama", CONFIG)
    _prefetching(fake, uid="u2")
    fake.body["metadata"]["name"] = "llama-b"
    fake.conflicts = 1  # the Job changed between the read and the write: read again, join then
    await handlers.reconcile("ml", "llama-b", CONFIG)
    (job,) = fake.jobs.values()
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == ["u1", "u2"]
    assert all(o["controller"] is False for o in job["metadata"]["ownerReferences"])
    old = job["metadata"]["name"]

    # llama-b moves to another revision: it leaves the Job to llama, and gets one of its own.
    fake.body["spec"]["model"]["revision"] = "v2"
    await handlers.reconcile("ml", "llama-b", CONFIG)
    assert [o["uid"] for o in fake.jobs[old]["metadata"]["ownerReferences"]] == ["u1"]
    assert len(fake.jobs) == 2 and fake.body["status"]["download"]["job"] != old
    # llama (u1) drops prefetch: the last owner gone, the Job is deleted (garbage collection never
    # deletes an object with no owner left).
    _prefetching(fake, uid="u1")
    fake.body["metadata"]["name"] = "llama"
    fake.body["status"] = {"download": {"job": old, "state": "Complete"}}
    fake.body["spec"]["model"] = {"id": "org/m", "cache": {"persistentVolumeClaim": {"claimName": "models"}}}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert old not in fake.jobs and ("Job", "ml", old) in fake.deleted
    assert "download" not in fake.body["status"]


async def test_a_failed_download_is_a_warning_naming_its_cause(fake: FakeKube) -> None:
    _prefetching(fake, hubTokenSecretRef={"name": "hf-token"})
    await handlers.reconcile("ml", "llama", CONFIG)
    (job,) = fake.jobs.values()
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}], "failed": 1}
    tail = '{"event": "error", "reason": "unauthorized", "message": "the hub refused the request for org/m (401)"}'
    fake.pods = [_job_pod(job, "dl-a", "Failed", terminated={"exitCode": 3, "message": tail})]
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.body["status"]["phase"] == "Failed" and _cond(fake, "Downloaded") == ("False", "Unauthorized")
    kind, reason, message = fake.events[-1]
    assert (kind, reason) == ("Warning", "Failed")
    assert "unauthorized: the hub refused the token: check the HF token Secret 'hf-token'" in message
    assert "(401)" in message and "delete the Job to try again" in message


async def test_the_start_up_of_the_newest_ready_pod_is_read_once(fake: FakeKube) -> None:
    await handlers.reconcile("ml", "llama", CONFIG)
    fake.pods = [_pod(fake, ready=True)]
    fake.health["llama-0"] = {"status": "ok", "startup_seconds": {"download": 1.5, "load": 3.0, "warmup": 20.0},
                              "warmup_from_cache": False}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.body["status"]["startup"] == {"pod": "llama-0", "downloadSeconds": 1.5, "loadSeconds": 3.0,
                                              "warmupSeconds": 20.0, "warmupFromCache": False}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.health_reads == ["llama-0"]
    newer = _pod(fake, ready=True, name="llama-1")
    newer["metadata"]["creationTimestamp"] = "2026-01-02T00:00:00Z"
    fake.pods.append(newer)
    fake.health["llama-1"] = {"status": "ok", "startup_seconds": {"download": 0.1, "load": 3.0, "warmup": 2.0},
                              "warmup_from_cache": True}
    await handlers.reconcile("ml", "llama", CONFIG)
    assert fake.health_reads == ["llama-0", "llama-1"] and fake.body["status"]["startup"]["warmupFromCache"] is True
    assert fake.pods[0]["metadata"]["labels"][TEMPLATE_HASH_LABEL]


async def test_an_event_of_a_download_job_triggers_its_owners() -> None:
    triggered = []

    class Memo:
        class reconciler:  # noqa: N801
            @staticmethod
            def trigger(namespace: str, name: str) -> None:
                triggered.append((namespace, name))
    job = {"metadata": {"name": "gaudi-serve-download-x", "ownerReferences": [
        {"kind": "InferenceService", "name": "a", "uid": "1"}, {"kind": "InferenceService", "name": "b", "uid": "2"},
        {"kind": "Something", "name": "c", "uid": "3"}]}}
    await handlers.on_shared_child(body=job, namespace="ml", memo=Memo)
    assert triggered == [("ml", "a"), ("ml", "b")]


async def test_autoscaler_applied_after_the_old_one_is_deleted_and_its_status_reported(
        fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake.body is not None
    fake.body["spec"] = {"model": {"id": "m"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}
    live_hpa_status = {"desiredReplicas": 2, "lastScaleTime": "2026-01-01T00:00:00Z", "conditions": [
        {"type": "ScalingLimited", "status": "False", "message": "the desired count is within the range"}]}
    apply = fake.apply

    async def with_status(obj: dict[str, Any]) -> dict[str, Any]:
        live = await apply(obj)
        return {**live, "status": live_hpa_status} if obj["kind"] == "HorizontalPodAutoscaler" else live
    monkeypatch.setattr(kube, "apply", with_status)
    await handlers.reconcile("ml", "llama", CONFIG)
    assert [c["kind"] for c in fake.applied] == ["Deployment", "Service", "PodDisruptionBudget",
                                                 "HorizontalPodAutoscaler"]
    assert fake.deleted == []
    assert fake.body["status"]["autoscaling"] == {
        "engine": "hpa", "autoscaler": "HorizontalPodAutoscaler/llama", "minReplicas": 1, "maxReplicas": 3,
        "desiredReplicas": 2, "lastScaleTime": "2026-01-01T00:00:00Z"}


def not_installed(fake: FakeKube, monkeypatch: pytest.MonkeyPatch, *kinds: str) -> None:
    """Applying any of `kinds` answers 404, as an API server without their CRD does."""
    apply = fake.apply

    async def without(obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] in kinds:
            raise kube.NotFound(f"/apis/.../{obj['kind'].lower()}s/{obj['metadata']['name']}")
        return await apply(obj)
    monkeypatch.setattr(kube, "apply", without)


async def test_keda_engine_without_keda_installed_is_reported_not_retried_forever(
        fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake.body is not None
    fake.body["spec"] = {"model": {"id": "m"}, "autoscaling": {
        "engine": "keda", "maxReplicas": 2, "prometheus": {"serverAddress": "http://prometheus:9090"}}}
    not_installed(fake, monkeypatch, "ScaledObject")
    status = await handlers.reconcile("ml", "llama", CONFIG)
    assert status is not None and status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "AutoscalerNotInstalled" and "ScaledObject" in degraded["message"]
    assert status["autoscaling"] == {"engine": "keda", "minReplicas": 1, "maxReplicas": 2}
    assert ("HorizontalPodAutoscaler", "ml", "llama") not in fake.deleted  # none was owned


GATEWAY = {"endpointPicker": {"service": {"name": "epp"}}, "route": {"gateway": {"name": "gw", "namespace": "edge"}}}


async def test_gateway_without_its_apis_is_reported_and_the_service_still_applied(
        fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake.body is not None
    fake.body["spec"] = {"model": {"id": "m"}, "gateway": GATEWAY}
    not_installed(fake, monkeypatch, "InferencePool", "HTTPRoute")
    status = await handlers.reconcile("ml", "llama", CONFIG)
    assert status is not None and status["phase"] == "Degraded"
    assert [c["kind"] for c in fake.applied] == ["Deployment", "Service"]
    routed = next(c for c in status["conditions"] if c["type"] == "Routed")
    assert (routed["status"], routed["reason"]) == ("False", "GatewayAPINotInstalled")
    assert "inferencepools.inference.networking.k8s.io" in routed["message"]
    assert "httproutes.gateway.networking.k8s.io" in routed["message"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "GatewayAPINotInstalled"


async def test_the_routes_status_from_the_apply_reaches_the_status(fake: FakeKube,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake.body is not None
    fake.body["spec"] = {"model": {"id": "m"}, "gateway": GATEWAY}
    parents = [{"parentRef": {"name": "gw", "namespace": "edge"}, "controllerName": "example.net/gw",
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""},
                               {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "message": ""}]}]
    apply = fake.apply

    async def with_route_status(obj: dict[str, Any]) -> dict[str, Any]:
        live = await apply(obj)
        return {**live, "status": {"parents": parents}} if obj["kind"] == "HTTPRoute" else live
    monkeypatch.setattr(kube, "apply", with_route_status)
    status = await handlers.reconcile("ml", "llama", CONFIG)
    assert status is not None
    assert [c["kind"] for c in fake.applied][-2:] == ["InferencePool", "HTTPRoute"]
    routed = next(c for c in status["conditions"] if c["type"] == "Routed")
    assert (routed["status"], routed["reason"]) == ("True", "RouteAccepted")
    assert status["gateway"]["parents"][0]["gateway"] == "edge/gw"


async def test_the_operators_own_picker_is_applied_then_deleted_with_the_need_for_it(fake: FakeKube) -> None:
    assert fake.body is not None
    config = OperatorConfig(picker_image="registry.example/epp:v1", picker_cluster_role="gso-endpoint-picker")
    fake.body["spec"] = {"model": {"id": "m"}, "replicas": 1, "gateway": {}}
    status = await handlers.reconcile("ml", "llama", config)
    assert status is not None
    assert [(c["kind"], c["metadata"]["name"]) for c in fake.applied] == [
        ("Deployment", "llama"), ("Service", "llama"), ("InferencePool", "llama"), ("ServiceAccount", "llama-epp"),
        ("RoleBinding", "llama-epp"), ("Deployment", "llama-epp"), ("Service", "llama-epp")]
    assert status["gateway"] == {"inferencePool": "llama", "endpointPicker": "llama-epp:9002",
                                 "endpointPickerManaged": True}
    fake.deleted.clear()
    fake.body["spec"]["gateway"] = {"endpointPicker": {"service": {"name": "mine"}}}
    await handlers.reconcile("ml", "llama", config)
    assert [d for d in fake.deleted if d[2] == "llama-epp"] == [
        (k, "ml", "llama-epp") for k in ("ServiceAccount", "RoleBinding", "Deployment", "Service")]
    assert fake.body["status"]["gateway"]["endpointPicker"] == "mine:9002"


async def test_no_picker_is_run_for_a_pool_the_cluster_does_not_serve(fake: FakeKube,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert fake.body is not None
    config = OperatorConfig(picker_image="registry.example/epp:v1", picker_cluster_role="gso-endpoint-picker")
    fake.body["spec"] = {"model": {"id": "m"}, "replicas": 1, "gateway": {}}
    not_installed(fake, monkeypatch, "InferencePool")
    status = await handlers.reconcile("ml", "llama", config)
    assert status is not None
    assert [c["metadata"]["name"] for c in fake.applied] == ["llama", "llama"]  # the Deployment and the Service
    assert next(c for c in status["conditions"] if c["type"] == "Routed")["reason"] == "GatewayAPINotInstalled"


async def test_reconciler_coalesces_triggers(fake: FakeKube) -> None:
    calls = 0
    gate = asyncio.Event()

    async def slow(namespace: str, name: str) -> None:
        nonlocal calls
        calls += 1
        await gate.wait()

    r = handlers.Reconciler(slow)
    for _ in range(5):
        r.trigger("ml", "llama")
    await asyncio.sleep(0)  # let the first run start
    for _ in range(5):
        r.trigger("ml", "llama")  # while running: one more run queued, not five
    gate.set()
    while r._tasks:
        await asyncio.gather(*list(r._tasks))
    assert calls == 2


# ---- kube.fetch_warmup against servers on 127.0.0.1 ---------------------------------------


async def _serve(handler: Any) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/health", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _running(name: str, ready: bool = False, ip: str = "127.0.0.1") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Running", "podIP": ip,
                                                  "conditions": [{"type": "Ready", "status": str(ready)}]}}


async def test_fetch_warmup_reads_health_json() -> None:
    seen = []

    async def health(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"status": "warming_up", "warmup": {"done": 3, "total": 8, "phase": "decode"}},
                                 status=503)
    runner, port = await _serve(health)
    try:
        out = await kube.fetch_warmup([_running("a"), _running("b", ready=True),
                                       {"metadata": {"name": "c"}, "status": {"phase": "Pending"}}], port)
    finally:
        await runner.cleanup()
    assert out == {"a": {"done": 3, "total": 8, "phase": "decode"}}
    assert seen == ["/health"]  # ready and pending pods are not asked


@pytest.mark.parametrize("answer", ["not json", json.dumps({"status": "ok"}), json.dumps({"warmup": {"done": "x"}})])
async def test_fetch_warmup_ignores_answers_without_progress(answer: str) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text=answer, status=503)
    runner, port = await _serve(health)
    try:
        assert await kube.fetch_warmup([_running("a")], port) == {}
    finally:
        await runner.cleanup()


async def test_fetch_warmup_tolerates_unreachable_and_slow_pods() -> None:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})
    runner, port = await _serve(hang)
    try:
        assert await kube.fetch_warmup([_running("slow")], port, timeout=0.2) == {}
    finally:
        release.set()
        await runner.cleanup()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert await kube.fetch_warmup([_running("gone")], closed, timeout=0.5) == {}


async def test_fetch_health_reads_a_ready_pods_start_up() -> None:
    answer = {"status": "ok", "warmup": {"done": 6, "total": 6, "phase": "decode"},
              "startup_seconds": {"download": 0.2, "load": 1.5, "warmup": 9.0}, "warmup_from_cache": None}

    async def health(request: web.Request) -> web.Response:
        return web.json_response(answer)
    runner, port = await _serve(health)
    try:
        assert await kube.fetch_health(_running("a", ready=True), port) == answer
        assert await kube.fetch_health({"metadata": {"name": "p"}, "status": {"phase": "Pending"}}, port) is None
    finally:
        await runner.cleanup()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert await kube.fetch_health(_running("gone", ready=True), closed, timeout=0.5) is None


async def test_fetch_warmup_bounds_concurrency() -> None:
    active = peak = 0

    async def health(request: web.Request) -> web.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return web.json_response({"warmup": {"done": 1, "total": 2}}, status=503)
    runner, port = await _serve(health)
    try:
        out = await kube.fetch_warmup([_running(f"p{i}") for i in range(10)], port, concurrency=3)
    finally:
        await runner.cleanup()
    assert len(out) == 10 and peak <= 3


# ---- CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,want", [
    ([], {"standalone": True, "clusterwide": True, "namespaces": (), "peering_name": None,
          "liveness_endpoint": None}),
    (["-n", "ml", "-n", "prod-*", "--liveness", "http://0.0.0.0:8080/healthz"],
     {"clusterwide": False, "namespaces": ["ml", "prod-*"], "liveness_endpoint": "http://0.0.0.0:8080/healthz"}),
    (["--peering", "gaudi", "--priority", "10"], {"standalone": False, "peering_name": "gaudi", "priority": 10}),
])
def test_cli_options(monkeypatch: pytest.MonkeyPatch, argv: list[str], want: dict[str, Any]) -> None:
    import logging

    import kopf
    monkeypatch.setattr(logging.root, "level", logging.root.level)  # main() sets it
    got: dict[str, Any] = {}
    configured: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: got.update(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: configured.update(kw))
    monkeypatch.delenv("WATCH_NAMESPACES", raising=False)
    assert cli.main(argv + ["--log-format", "json", "--log-level", "warning"]) == 0
    assert want.items() <= got.items()
    assert configured["log_format"] == kopf.LogFormat.JSON


def test_cli_namespaces_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import kopf
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    got: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: got.update(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    monkeypatch.setenv("WATCH_NAMESPACES", "a, b")
    cli.main([])
    assert got["namespaces"] == ["a", "b"] and got["clusterwide"] is False


def test_cli_hands_its_config_to_the_handlers_and_leaves_the_environment_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import logging
    import os

    import kopf
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    got: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: got.update(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    monkeypatch.delenv("GAUDI_OPERATOR_RESYNC_SECONDS", raising=False)
    monkeypatch.setenv("GAUDI_OPERATOR_CLUSTER_DOMAIN", "k.local")
    cli.main(["--resync-seconds", "3"])
    assert got["memo"].config == OperatorConfig(resync_seconds=3.0, cluster_domain="k.local")
    assert "GAUDI_OPERATOR_RESYNC_SECONDS" not in os.environ


def test_config_from_the_environment_names_a_bad_variable() -> None:
    assert OperatorConfig.from_env({"GAUDI_OPERATOR_WARMUP_CONCURRENCY": "3"}).warmup_concurrency == 3
    with pytest.raises(ValueError, match="GAUDI_OPERATOR_WARMUP_TIMEOUT='soon' is not a float"):
        OperatorConfig.from_env({"GAUDI_OPERATOR_WARMUP_TIMEOUT": "soon"})
