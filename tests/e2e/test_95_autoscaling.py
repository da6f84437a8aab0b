"""Autoscaling with the real HPA controller (inside kube-controller-manager), reading the runtime's
gauges through the custom metrics API (the upstream test adapter, registered as an APIService and
fed from the pods' /metrics: tests/e2e/metrics_path.py), and KEDA's ScaledObject admitted by KEDA's
own CRD:

* a rising queue scales the InferenceService up to maxReplicas through its scale subresource and
  `kubectl get gisvc` shows it; `kubectl apply` of the unchanged manifest (client-side and
  server-side) leaves the count alone, the autoscaler owning spec.replicas; the queue falls and
  the count comes down after the (shortened) stabilization window;
* a stream through a real runtime pod survives the scale-down that removes that pod: the test
  plays the kubelet (preStop, SIGTERM to the container's process, the grace period);
* engine keda: the operator swaps the HPA for a ScaledObject the API server admits as rendered.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gaudi_operator.components import render
from tests.e2e.conftest import Cluster
from tests.e2e.control_plane import clean_env
from tests.e2e.harness import (
    MANUAL_TERMINATION,
    NO_PROXY,
    KubeletTermination,
    OperatorProcess,
    http_json,
    is_ready,
    isvc_manifest,
    stop_runtime,
    table,
    wait_for,
)
from tests.e2e.metrics_path import MetricsAdapter, Scraper
from tests.e2e.netwatch import WATCH
from tests.e2e.test_6_real_runtime import container_command
from tests.runtime.launched import alive, children

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator, the test adapter

WAITING = "vllm:num_requests_waiting"
FAST = {"scaleUp": {"stabilizationWindowSeconds": 0, "pods": 4, "periodSeconds": 1},
        "scaleDown": {"stabilizationWindowSeconds": 4, "pods": 4, "periodSeconds": 1}}  # test-shortened


def autoscaled(name: str, ns: str, autoscaling: dict, **spec) -> dict:
    """An autoscaled InferenceService as its owner writes it: without spec.replicas (the autoscaler's)."""
    body = isvc_manifest(name, ns, **spec)
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = autoscaling
    return body


def replicas_owner(kubectl, ns: str, name: str) -> list[tuple[str, str, str]]:
    """(manager, operation, subresource) of each managedFields entry that owns spec.replicas."""
    obj = kubectl.json("get", "gisvc", name, "-n", ns, "--show-managed-fields")
    return [(m["manager"], m["operation"], m.get("subresource", "")) for m in obj["metadata"]["managedFields"]
            if "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})]


@pytest.fixture
def scrapers() -> Iterator[list[Scraper]]:
    made: list[Scraper] = []
    yield made
    for s in made:
        s.stop()


def test_queue_scales_up_to_max_apply_leaves_the_count_alone_then_it_scales_down(
        cluster: Cluster, operator: OperatorProcess, metrics_adapter: MetricsAdapter, ns: str,
        cleanup: list[str], scrapers: list[Scraper]) -> None:
    kube, kubectl = cluster.kube, cluster.kubectl
    cleanup.append("fleet")
    manifest = autoscaled("fleet", ns, {"minReplicas": 1, "maxReplicas": 3, "targets": {"queueSize": 10},
                                        "behavior": FAST}, shards=8)
    kubectl.apply(manifest)
    hpa = wait_for(lambda: kubectl("get", "hpa", "fleet", "-n", ns, "-o", "json", check=False).stdout, 30,
                   "the HorizontalPodAutoscaler")
    assert json.loads(hpa)["spec"]["scaleTargetRef"] == {"apiVersion": "gaudiserve.io/v1alpha1",
                                                         "kind": "InferenceService", "name": "fleet"}
    wait_for(lambda: kube.status(ns, "fleet").get("readyReplicas") == 1, 60, "one ready replica")
    scraper = Scraper(kube, metrics_adapter, ns, "fleet", load={WAITING: 0}).start()
    scrapers.append(scraper)

    # A queue of 30 per pod against a target of 10: up to maxReplicas, through the scale subresource.
    scraper.load[WAITING] = 30
    wait_for(lambda: kube.status(ns, "fleet").get("readyReplicas") == 3, 90,
             "3 ready replicas", interval=0.5)
    assert kube.isvc(ns, "fleet")["spec"]["replicas"] == 3
    (row,) = table(kubectl("get", "gisvc", "fleet", "-n", ns).stdout)
    assert (row["PHASE"], row["READY"]) == ("Ready", "3/3"), row
    auto = wait_for(lambda: (a := kube.status(ns, "fleet").get("autoscaling", {})).get("desiredReplicas") == 3
                    and a.get("current") == {WAITING: "30"} and a, 30, "status.autoscaling to show the HPA's view")
    assert auto["autoscaler"] == "HorizontalPodAutoscaler/fleet"
    ((manager, operation, sub),) = replicas_owner(kubectl, ns, "fleet")
    assert (operation, sub) == ("Update", "scale") and not manager.startswith("kubectl"), manager

    # GitOps: the unchanged manifest, applied client-side and server-side, leaves the count alone.
    kubectl.apply(manifest)
    kubectl.apply(manifest, "--server-side")
    assert kube.isvc(ns, "fleet")["spec"]["replicas"] == 3
    assert [o[2] for o in replicas_owner(kubectl, ns, "fleet")] == ["scale"]
    # A manifest that sets spec.replicas is refused by server-side apply, naming the autoscaler's field.
    with_replicas = copy.deepcopy(manifest)
    with_replicas["spec"]["replicas"] = 1
    out = kubectl.apply(with_replicas, "--server-side", check=False)
    assert out.returncode != 0 and ".spec.replicas" in out.stderr and 'subresource "scale"' in out.stderr, out.stderr
    assert kube.isvc(ns, "fleet")["spec"]["replicas"] == 3
    # ... and client-side apply puts its value back, until the HPA's next sync scales up again.
    kubectl.apply(with_replicas)
    assert kube.isvc(ns, "fleet")["spec"]["replicas"] == 1
    wait_for(lambda: kube.isvc(ns, "fleet")["spec"]["replicas"] == 3, 30, "the HPA to take the count back")

    # The queue drains: down to minReplicas after the stabilization window.
    scraper.load[WAITING] = 0
    wait_for(lambda: kube.isvc(ns, "fleet")["spec"]["replicas"] == 1 and len(kube.live_pods(ns, "fleet")) == 1,
             90, "the scale-down to one replica", interval=0.5)
    wait_for(lambda: kube.status(ns, "fleet").get("readySummary") == "1/1", 60, "1/1 ready")


def _stream(url: str, events: list[dict], started: threading.Event, hold: list[int]) -> None:
    """Read a stream; on its second event stop (SIGSTOP) the `hold` processes: a tiny model is fast."""
    body = json.dumps({"inputs": "Stay with me", "parameters": {"max_new_tokens": 60}}).encode()
    req = urllib.request.Request(url + "/generate_stream", data=body, headers={"Content-Type": "application/json"})
    try:
        with NO_PROXY.open(req, timeout=180) as r:
            for line in r:
                if line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 2:
                        for pid in hold:
                            os.kill(pid, signal.SIGSTOP)
                        started.set()
    finally:
        started.set()


@pytest.fixture
def runtime_procs(cluster: Cluster, ns: str) -> Iterator[list[subprocess.Popen]]:
    """Real runtimes playing pods; afterwards (a failed test included) none is left, nor a pod whose
    termination only the test would have done."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        stop_runtime(p, grace_s=0)
    key, value = next(iter(MANUAL_TERMINATION.items()))
    for pod in cluster.kube.core.list_namespaced_pod(ns).items:
        if (pod.metadata.annotations or {}).get(key) == value:
            cluster.kube.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)


def _get(url: str) -> tuple[int, dict] | None:
    try:
        return http_json("GET", url, timeout=5)
    except OSError:
        return None


def test_a_stream_through_the_real_runtime_survives_the_scale_down_that_removes_its_pod(
        cluster: Cluster, operator: OperatorProcess, metrics_adapter: MetricsAdapter, ns: str, cleanup: list[str],
        scrapers: list[Scraper], runtime_procs: list[subprocess.Popen], tmp_path: Path) -> None:
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    kube, kubectl = cluster.kube, cluster.kubectl
    cleanup.append("stream")
    spec = {"shards": 1, "manual": True, "serving": {"maxInputTokens": 64, "maxTotalTokens": 128, "drainSeconds": 60},
            "batching": {"warmup": False, "hpuGraphs": False},
            "env": [{"name": "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN", "value": "true"}],
            # The preStop sleep, test-shortened (lists of named items merge by name).
            "podTemplate": {"spec": {"containers": [{"name": "runtime",
                                                     "lifecycle": {"preStop": {"sleep": {"seconds": 1}}}}]}}}
    manifest = autoscaled("stream", ns, {"minReplicas": 2, "maxReplicas": 2, "targets": {"queueSize": 10},
                                         "behavior": FAST}, **spec)
    kubectl.apply(manifest)
    pods = wait_for(lambda: len(p := [q for q in kube.live_pods(ns, "stream") if q["status"].get("podIP")]) == 2
                    and sorted(p, key=lambda q: q["metadata"]["name"]), 60, "two running pods (minReplicas)")
    real, fake = pods
    name = real["metadata"]["name"]
    # The pod whose container is a real runtime: its termination is the test's (as the kubelet's),
    # and it is the one a scale-down removes (lowest deletion cost).
    kubectl("annotate", "pod", name, "-n", ns, *(f"{k}={v}" for k, v in MANUAL_TERMINATION.items()),
            "controller.kubernetes.io/pod-deletion-cost=-100")
    model_dir = make_tiny_model(tmp_path / "tiny-llama", "llama")
    cmd, env = container_command(real, model_dir, tmp_path)
    with open(tmp_path / "runtime.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(**env),
                                start_new_session=True)
    runtime_procs.append(proc)
    WATCH.watch(proc.pid)
    url = f"http://{real['status']['podIP']}:8080"
    scrapers.append(Scraper(kube, metrics_adapter, ns, "stream", load={WAITING: 0}, real={name}).start())

    def serving() -> bool:
        assert proc.poll() is None, (tmp_path / "runtime.log").read_text()[-3000:]
        return (_get(url + "/health") or (0,))[0] == 200
    wait_for(serving, 180, "the real runtime to be ready", interval=0.2)
    for pod in kube.live_pods(ns, "stream"):  # the kubelet's readiness probes
        kube.mark_ready(pod)
    wait_for(lambda: kube.status(ns, "stream").get("readyReplicas") == 2, 60, "2 ready replicas")

    events: list[dict] = []
    started = threading.Event()
    # The stream stands still (its shards stopped) until the pod is being drained.
    shards = [c for c in children(proc.pid) if b"shard" in open(f"/proc/{c}/cmdline", "rb").read()]
    reader = threading.Thread(target=_stream, args=(url, events, started, shards), daemon=True)
    reader.start()
    assert started.wait(60) and len(events) >= 2, events
    try:
        # The owner lowers minReplicas; the queue is empty: the HPA scales down, removing the real pod.
        manifest["spec"]["autoscaling"]["minReplicas"] = 1
        kubectl.apply(manifest)
        kubelet = KubeletTermination(kube, ns, name, proc)
        kubelet.wait_deleted(90)
        assert kubelet.grace_s == 60 and kubelet.pre_stop_s == 1
        kubelet.run_pre_stop_and_signal()
        code, body = wait_for(lambda: (h := _get(url + "/health")) and h[0] == 503 and h, 30,
                              "/health 503 while draining")
        assert body["status"] == "draining", body
        code, body = http_json("POST", url + "/generate", {"inputs": "late", "parameters": {"max_new_tokens": 2}})
        assert (code, body["error_type"]) == (503, "unhealthy"), body
    finally:
        for s in shards:
            if alive(s):
                os.kill(s, signal.SIGCONT)
    reader.join(60)
    assert events[-1].get("details") and events[-1]["details"]["finish_reason"] == "length", events[-1]
    assert len(events) == 60 and not any("error" in e for e in events)
    assert kubelet.wait_exit() == 0, (tmp_path / "runtime.log").read_text()[-3000:]
    assert not any(alive(c) for c in shards)
    status = wait_for(lambda: (s := kube.status(ns, "stream")).get("readySummary") == "1/1" and s, 60,
                      "one replica left, ready")
    assert [p["metadata"]["name"] for p in kube.live_pods(ns, "stream")] == [fake["metadata"]["name"]]
    assert is_ready(kube.live_pods(ns, "stream")[0]) and status["phase"] == "Ready"


def test_keda_scaled_object_replaces_the_hpa_and_is_admitted_as_rendered(
        cluster: Cluster, operator: OperatorProcess, ns: str, cleanup: list[str]) -> None:
    kube, kubectl = cluster.kube, cluster.kubectl
    cleanup.append("keda")
    manifest = autoscaled("keda", ns, {"maxReplicas": 2}, shards=1)
    kubectl.apply(manifest)
    wait_for(lambda: kubectl("get", "hpa", "keda", "-n", ns, check=False).returncode == 0, 30, "the HPA")

    manifest["spec"]["autoscaling"] = {"engine": "keda", "maxReplicas": 2, "targets": {"queueSize": 8,
                                       "kvCacheUsage": 0.7}, "prometheus": {"serverAddress": "http://prom:9090"}}
    kubectl.apply(manifest)
    live = wait_for(lambda: (o := kubectl("get", "scaledobject", "keda", "-n", ns, "-o", "json", check=False))
                    .returncode == 0 and json.loads(o.stdout), 30, "the ScaledObject")
    wait_for(lambda: kubectl("get", "hpa", "keda", "-n", ns, check=False).returncode != 0, 30, "the HPA removed")
    # Admitted by KEDA's CRD exactly as rendered: no field pruned as unknown, none defaulted differently.
    rendered = next(c for c in render(kube.isvc(ns, "keda")).children if c["kind"] == "ScaledObject")
    assert live["spec"] == rendered["spec"]
    out = kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump(rendered),
                  check=False)
    assert out.returncode == 0, out.stderr
    status = wait_for(lambda: (s := kube.status(ns, "keda")).get("autoscaling", {}).get("engine") == "keda" and s,
                      30, "status.autoscaling of engine keda")
    assert status["autoscaling"]["autoscaler"] == "ScaledObject/keda"
    assert status["phase"] == "Ready"  # no KEDA operator runs here: nothing to report, nothing wrong

    del manifest["spec"]["autoscaling"]
    kubectl.apply(manifest)
    wait_for(lambda: kubectl("get", "scaledobject", "keda", "-n", ns, check=False).returncode != 0, 30,
             "the ScaledObject removed")
    wait_for(lambda: "autoscaling" not in kube.status(ns, "keda"), 30, "status.autoscaling gone")
