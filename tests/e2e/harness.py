"""What the e2e scenarios share: polling, kubectl, the API as an admin, the operator process,
and the kubelet duties kwok leaves to the tests (readiness of manually-probed pods)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from tests.e2e.control_plane import ROOT, clean_env, free_port
from tests.e2e.netwatch import WATCH

GROUP, VERSION, PLURAL = "gaudiserve.io", "v1alpha1", "inferenceservices"
ISVC_LABEL = "gaudiserve.io/inference-service"
MANUAL_READINESS = {"e2e.gaudiserve.io/readiness": "manual"}  # see kwok-stages.yaml
MANUAL_TERMINATION = {"e2e.gaudiserve.io/termination": "manual"}  # see kwok-stages.yaml
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_for(fn: Callable[[], Any], timeout: float = 60.0, what: str = "condition", interval: float = 0.25) -> Any:
    """Poll `fn` until it returns something truthy; fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (KeyError, TypeError, IndexError, StopIteration, AttributeError):
            last = None
        if last:
            return last
        time.sleep(interval)  # polling interval of a deadline-bounded wait
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http_json(method: str, url: str, body: Any = None, timeout: float = 10.0,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A request without any proxy (pod IPs are loopback addresses)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with NO_PROXY.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@dataclass
class Kubectl:
    binary: str
    kubeconfig: Path

    def __call__(self, *args: str, input: str | None = None, check: bool = True,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}", *args], input=input,
                             capture_output=True, text=True, env=clean_env(), timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
        return out

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], *args: str, check: bool = True):
        docs = obj if isinstance(obj, list) else [obj]
        return self("apply", "-f", "-", *args, input=yaml.safe_dump_all(docs), check=check)


class Kube:
    """Typed API clients as the cluster admin."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.policy = kubernetes.client.PolicyV1Api(self.client)

    def isvc(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return (self.isvc(ns, name) or {}).get("status") or {}

    def pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(ns, label_selector=f"{ISVC_LABEL}={name}").items
        return [self.client.sanitize_for_serialization(p) for p in items]

    def live_pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(ns, name) if not p["metadata"].get("deletionTimestamp")]

    def deployments(self, ns: str, name: str) -> list[dict[str, Any]]:
        items = self.apps.list_namespaced_deployment(ns, label_selector=f"{ISVC_LABEL}={name}").items
        return [self.client.sanitize_for_serialization(d) for d in items]

    def replicasets(self, ns: str, name: str) -> list[dict[str, Any]]:
        items = self.apps.list_namespaced_replica_set(ns, label_selector=f"{ISVC_LABEL}={name}").items
        return [self.client.sanitize_for_serialization(r) for r in items]

    def children(self, ns: str, name: str) -> dict[str, list[str]]:
        """Every object (of the kinds the operator makes, and theirs) labelled for `name`."""
        sel = f"{ISVC_LABEL}={name}"
        return {
            "deployments": [d.metadata.name for d in self.apps.list_namespaced_deployment(ns, label_selector=sel).items],
            "replicasets": [r.metadata.name for r in self.apps.list_namespaced_replica_set(ns, label_selector=sel).items],
            "pods": [p.metadata.name for p in self.core.list_namespaced_pod(ns, label_selector=sel).items],
            "services": [s.metadata.name for s in self.core.list_namespaced_service(ns, label_selector=sel).items],
            "poddisruptionbudgets": [p.metadata.name for p in
                                     self.policy.list_namespaced_pod_disruption_budget(ns, label_selector=sel).items],
        }

    def mark_ready(self, pod: dict[str, Any]) -> None:
        """Play the kubelet's readiness probe succeeding: Ready and ContainersReady True."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        st = pod.get("status") or {}
        conds = [c for c in st.get("conditions") or [] if c["type"] not in ("Ready", "ContainersReady")]
        conds += [{"type": t, "status": "True", "lastTransitionTime": now} for t in ("Ready", "ContainersReady")]
        statuses = [{**cs, "ready": True} for cs in st.get("containerStatuses") or []]
        self.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"],
            {"status": {"conditions": conds, "containerStatuses": statuses}},
            _content_type="application/merge-patch+json")


def rwx_claim(kube: Kube, ns: str, name: str, size: str = "10Gi") -> None:
    """A ReadWriteMany claim, bound to a volume made for it (kwok runs no container, so nothing mounts
    it: a test maps the claim to a directory of its own)."""
    volume = f"{ns}-{name}"
    kube.core.create_persistent_volume({
        "metadata": {"name": volume},
        "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/srv/{volume}"},
                 "claimRef": {"namespace": ns, "name": name}}})
    kube.core.create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                 "resources": {"requests": {"storage": size}}}})
    wait_for(lambda: kube.core.read_namespaced_persistent_volume_claim(name, ns).status.phase == "Bound", 60,
             f"claim {name} bound")


@dataclass
class KubeletTermination:
    """The kubelet's part when a pod whose container a test plays with a real process is deleted
    (the pod is annotated MANUAL_TERMINATION, so kwok leaves it be): the preStop hook, SIGTERM to
    the container's main process (the launcher alone, not its process group), the grace period
    counted from the deletion (then SIGKILL), and the pod's removal once the container is gone."""

    kube: Kube
    namespace: str
    pod: str
    proc: subprocess.Popen
    grace_s: float = 0.0
    pre_stop_s: float = 0.0
    started: float = 0.0

    def wait_deleted(self, timeout: float) -> None:
        def deleting() -> Any:
            pod = self.kube.core.read_namespaced_pod(self.pod, self.namespace)
            return pod if pod.metadata.deletion_timestamp else None
        pod = wait_for(deleting, timeout, f"pod {self.pod} to be deleted")
        self.started = time.monotonic()
        self.grace_s = float(pod.metadata.deletion_grace_period_seconds)
        hook = pod.spec.containers[0].lifecycle.pre_stop if pod.spec.containers[0].lifecycle else None
        self.pre_stop_s = float(hook.sleep.seconds) if hook and hook.sleep else 0.0

    def run_pre_stop_and_signal(self) -> None:
        time.sleep(self.pre_stop_s)  # the preStop hook is a sleep: the kubelet runs it, then signals
        os.kill(self.proc.pid, signal.SIGTERM)

    def wait_exit(self) -> int:
        """The container's exit code, SIGKILLed (-9) if it outlives the grace period."""
        left = self.grace_s - (time.monotonic() - self.started)
        try:
            code = self.proc.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        self.kube.core.delete_namespaced_pod(self.pod, self.namespace, grace_period_seconds=0)
        return code


def ready_pods_until(kube: Kube, ns: str, name: str, done: Callable[[], Any], timeout: float, what: str) -> None:
    """Play the readiness probes of an InferenceService's pods as they start, until `done()`."""
    def step() -> Any:
        for p in kube.live_pods(ns, name):
            if p["status"].get("podIP") and not is_ready(p):
                kube.mark_ready(p)
        return done()
    wait_for(step, timeout, what)


def stop_runtime(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a runtime started in a session of its own: continued if it was held, SIGTERM and up to
    `grace_s` to exit (none: at once), then SIGKILL."""
    if p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGCONT)
    if grace_s > 0:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def table(text: str) -> list[dict[str, str]]:
    """Rows of a `kubectl get` table by column name (columns are cut at the header's offsets:
    an empty cell stays empty)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)} for line in lines[1:]]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == ctype), {})


def isvc_manifest(name: str, ns: str, *, shards: int = 8, replicas: int = 1, manual: bool = False,
                  **spec: Any) -> dict[str, Any]:
    """An InferenceService; `manual`: its pods become Ready only when a test says so."""
    body: dict[str, Any] = {"model": {"id": "gaudi-serve/tiny-llama"}, "shards": shards, "replicas": replicas, **spec}
    if manual:
        body.setdefault("podTemplate", {}).setdefault("metadata", {})["annotations"] = dict(MANUAL_READINESS)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": ns}, "spec": body}


class OperatorProcess:
    """`gaudi-operator` (the CLI the chart's Deployment runs) as a child process, with a given kubeconfig."""

    def __init__(self, kubeconfig: Path, workdir: Path, resync_seconds: float = 1.0,
                 env: dict[str, str] | None = None) -> None:
        self.kubeconfig, self.workdir, self.resync = kubeconfig, workdir, resync_seconds
        self.env = dict(env or {})  # what the chart's Deployment would set beside the kubeconfig
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path = workdir / "operator.log"

    def start(self, timeout: float = 60.0) -> None:
        port = free_port()
        self.starts += 1
        env = clean_env(KUBECONFIG=str(self.kubeconfig), GAUDI_OPERATOR_WATCH_TIMEOUT="60",
                        GAUDI_OPERATOR_WARMUP_TIMEOUT="2", PYTHONUNBUFFERED="1", **self.env)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== operator start #{self.starts} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gaudi_operator.cli", "--all-namespaces", "--standalone",
                 "--resync-seconds", str(self.resync), "--log-format", "plain",
                 "--liveness", f"http://127.0.0.1:{port}/healthz"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        WATCH.watch(self.proc.pid)
        wait_for(lambda: self._alive_and(f"http://127.0.0.1:{port}/healthz"), timeout, "the operator to start")

    def _alive_and(self, url: str) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            with NO_PROXY.open(url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
