"""The custom metrics path of the e2e cluster, in place of Prometheus and an adapter reading it:

* `MetricsAdapter`: the upstream test adapter of sigs.k8s.io/custom-metrics-apiserver (built by
  hack/autoscaling-tools.sh) on 127.0.0.1, registered as the real `v1beta2.custom.metrics.k8s.io`
  APIService behind a Service of type ExternalName (127.0.0.1), so the HPA controller inside
  kube-controller-manager reads it through the API server's aggregation layer as it would read
  prometheus-adapter;
* `Scraper`: what Prometheus does here, in a thread: every `interval` it reads /metrics of each
  running pod of an InferenceService (a real runtime, or a `MetricsStub` in a simulated pod) and
  writes the load gauges to the adapter, per pod;
* `MetricsStub`: /metrics on a simulated (kwok) pod's IP, with load figures the test sets.
"""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.control_plane import METRICS_ADAPTER_SERVICE, clean_env, free_port
from tests.e2e.harness import NO_PROXY, Kube, Kubectl, wait_for
from tests.e2e.netwatch import WATCH

LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
RUNTIME_PORT = 8080
GROUP_VERSION = ("custom.metrics.k8s.io", "v1beta2")


@dataclass
class MetricsAdapter:
    binary: Path
    workdir: Path
    kubeconfig: Path
    pki: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    write_port: int = 0

    def start(self) -> None:
        self.port, self.write_port = free_port(), free_port()
        log = open(self.workdir / "metrics-adapter.log", "wb")
        kc = str(self.kubeconfig)
        self.proc = subprocess.Popen(
            [str(self.binary), f"--secure-port={self.port}", "--bind-address=127.0.0.1",
             f"--tls-cert-file={self.pki / 'metrics-adapter.crt'}",
             f"--tls-private-key-file={self.pki / 'metrics-adapter.key'}",
             f"--lister-kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
             f"--write-address=127.0.0.1:{self.write_port}", "--v=1"],
            stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=self.workdir, start_new_session=True)
        log.close()
        WATCH.watch(self.proc.pid)

    def register(self, kubectl: Kubectl) -> None:
        """The APIService of custom.metrics.k8s.io, served through the aggregation layer."""
        ns, svc = METRICS_ADAPTER_SERVICE
        group, version = GROUP_VERSION
        import base64

        ca = base64.b64encode((self.pki / "ca.crt").read_bytes()).decode()
        kubectl.apply([
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": svc, "namespace": ns},
             "spec": {"type": "ExternalName", "externalName": "127.0.0.1",
                      "ports": [{"name": "https", "port": self.port}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": f"{version}.{group}"},
             "spec": {"group": group, "version": version, "groupPriorityMinimum": 100, "versionPriority": 200,
                      "caBundle": ca, "service": {"namespace": ns, "name": svc, "port": self.port}}},
        ])

        def available() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the metrics adapter exited with {self.proc.returncode}:\n{self.log()}")
            api = kubectl.json("get", "apiservice", f"{version}.{group}")
            return any(c["type"] == "Available" and c["status"] == "True"
                       for c in (api.get("status") or {}).get("conditions") or [])
        wait_for(available, 90, f"the APIService {version}.{group} to be Available", interval=0.5)

    def write(self, namespace: str, pod: str, metric: str, value: float) -> None:
        """The value of `metric` for `pod`, as the custom metrics API will serve it."""
        milli = round(value * 1000)
        quantity = str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.write_port}/write-metrics/namespaces/{namespace}/pods/{pod}/{metric}",
            data=json.dumps(quantity).encode(), method="POST", headers={"Content-Type": "application/json"})
        with NO_PROXY.open(req, timeout=5) as r:
            r.read()

    def log(self) -> str:
        return (self.workdir / "metrics-adapter.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def load_figures(text: str) -> dict[str, float]:
    """The load gauges of a /metrics page (absent ones, e.g. a pod still warming up, left out)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in LOAD_GAUGES:
                out[s.name] = s.value
    return out


class MetricsStub:
    """/metrics of a simulated pod, on its IP and the runtime's port, showing the figures in `load`."""

    def __init__(self, ip: str, load: dict[str, float]) -> None:
        self.load = load
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                lines = [f'{name}{{model_name="gaudi-serve/tiny-llama"}} {value}' for name, value in stub.load.items()]
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, RUNTIME_PORT), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Scraper:
    """Prometheus's part: each running pod's /metrics -> the adapter, every `interval` seconds.

    Simulated pods get a `MetricsStub` showing `load` (what the test sets), except the pods named
    in `real`, whose container is a real runtime serving its own /metrics."""

    kube: Kube
    adapter: MetricsAdapter
    namespace: str
    name: str
    load: dict[str, float] = field(default_factory=dict)
    real: set[str] = field(default_factory=set)
    interval: float = 0.5
    stubs: dict[str, MetricsStub] = field(default_factory=dict)  # by IP: a new pod may get a gone one's
    written: dict[str, dict[str, float]] = field(default_factory=dict)  # pod -> the figures last written
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Scraper:
        threading.Thread(target=self._run, daemon=True, name=f"scraper-{self.name}").start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                pods = self.kube.live_pods(self.namespace, self.name)
            except Exception:  # noqa: BLE001 - the API server busy for a moment: next round
                continue
            for pod in pods:
                ip = (pod.get("status") or {}).get("podIP")
                if ip and pod["status"].get("phase") == "Running":
                    self._scrape(pod["metadata"]["name"], ip)

    def _scrape(self, pod: str, ip: str) -> None:
        if pod not in self.real and ip not in self.stubs:
            self.stubs[ip] = MetricsStub(ip, self.load)
        try:
            with NO_PROXY.open(f"http://{ip}:{RUNTIME_PORT}/metrics", timeout=2) as r:
                figures = load_figures(r.read().decode())
        except (urllib.error.URLError, OSError):
            return  # not serving yet: no figure, as Prometheus would record none
        try:
            for metric, value in figures.items():
                self.adapter.write(self.namespace, pod, metric, value)
        except (urllib.error.URLError, OSError):
            return  # written at the next round
        self.written[pod] = figures

    def stop(self) -> None:
        self._stop.set()
        for stub in self.stubs.values():
            stub.stop()
