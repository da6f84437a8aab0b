"""Session fixtures of the end-to-end suite: a real control plane with simulated Gaudi nodes,
the chart installed with real Helm, and the operator running as the chart's ServiceAccount.

The binaries are built on first use by hack/control-plane.sh (cached per machine). If they
cannot be built the suite fails; it is never skipped.

GAUDI_SERVE_E2E_KUBECONFIG=<path> runs the suite against that cluster instead (kind, a Gaudi
cluster): the chart is installed as its own release, the scenarios that need the simulated
cluster (its nodes, its pods' loopback IPs, its audit log, a local operator) are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ROOT, ControlPlane, build_binaries, clean_env, kubeconfig
from tests.e2e.harness import Kube, Kubectl, OperatorProcess, stop_runtime, wait_for
from tests.e2e.kubelet_logs import KubeletLogs
from tests.e2e.metrics_path import MetricsAdapter
from tests.e2e.netwatch import WATCH

EXTERNAL = os.environ.get("GAUDI_SERVE_E2E_KUBECONFIG")
RELEASE, RELEASE_NS = ("gso-e2e", "gaudi-serve-e2e") if EXTERNAL else ("gso", "gaudi-serve-system")
CHART = ROOT / "charts" / "gaudi-serve-operator"
GAUDI_NODES = 3  # 8 cards each
NODE_READY_TIMEOUT = 60
# The endpoint picker the operator runs (scenario 8a): kwok never pulls it.
PICKER_IMAGE = "registry.example/gateway-api-inference-extension/epp:v1"
GATEWAY_CRDS = ROOT / "tests" / "e2e" / "crds"
GATEWAY_CRD_NAMES = ("gatewayclasses.gateway.networking.k8s.io", "gateways.gateway.networking.k8s.io",
                     "httproutes.gateway.networking.k8s.io", "inferencepools.inference.networking.k8s.io")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "simulated: needs the simulated cluster (kwok nodes, loopback pod IPs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the e2e tests last, so that the control plane (a session fixture) stops when the whole
    session does, right after them, not while the other suites run. Against a real cluster, skip
    what only the simulated one can do (never in the default run)."""
    e2e = [item for item in items if "tests/e2e/" in item.nodeid]
    if e2e and len(e2e) < len(items):
        ids = {id(item) for item in e2e}
        items[:] = [item for item in items if id(item) not in ids] + e2e
    if not EXTERNAL:
        return
    skip = pytest.mark.skip(reason="needs the simulated cluster (GAUDI_SERVE_E2E_KUBECONFIG is set)")
    for item in items:
        if "tests/e2e/" in item.nodeid and item.get_closest_marker("simulated"):
            item.add_marker(skip)


_BUILD: dict[str, Any] = {}


def _build_in_background() -> None:
    try:
        _BUILD["binaries"] = build_binaries()
    except Exception as exc:  # reported by the `cluster` fixture, as a failure
        _BUILD["error"] = str(exc)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the control plane (once per machine) when e2e tests were selected, in the
    background: the e2e tests run last, so a cold build (tens of minutes, at nice 19) overlaps the
    other suites instead of delaying the first test."""
    if EXTERNAL or session.config.option.collectonly or _BUILD:
        return
    if any("tests/e2e/" in item.nodeid for item in session.items):
        _BUILD["thread"] = threading.Thread(target=_build_in_background, name="e2e-binaries", daemon=True)
        _BUILD["thread"].start()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Wait for the control plane's build before the first e2e test, outside every test's timeout
    (this wrapper runs outside pytest-timeout's)."""
    thread = _BUILD.get("thread")
    if thread is not None and "tests/e2e/" in item.nodeid:
        thread.join()
    yield


@dataclass
class Cluster:
    cp: ControlPlane | None  # None: an external cluster
    kubectl: Kubectl
    kube: Kube
    helm: Path
    workdir: Path
    kubeconfig: Path
    namespaces: list[str] = field(default_factory=list)
    kubelet_logs: KubeletLogs | None = None  # the nodes' log endpoint, which kwok leaves to the tests
    autoscaling: Path | None = None  # hack/autoscaling-tools.sh's directory (simulated cluster only)
    gateway_api: Path | None = None  # hack/gateway-crds.sh's directory (simulated cluster only)

    def add_node(self, name: str, gaudi: int) -> None:
        assert self.cp is not None
        index = len(self.kube.core.list_node().items)
        if self.kubelet_logs is not None:
            self.kubelet_logs.serve(self.cp.node_ip(index))
        self.kube.core.create_node(self.cp.node_manifest(name, index, gaudi))
        wait_for(lambda: self.node_ready(name), NODE_READY_TIMEOUT, f"node {name} Ready")

    def install_keda_crds(self) -> None:
        """KEDA's CRDs (generated from KEDA's sources by hack/autoscaling-tools.sh), as in a cluster with KEDA."""
        assert self.autoscaling is not None
        crds = sorted((self.autoscaling / "keda-crds").glob("*.yaml"))
        self.kubectl("apply", "--server-side", *(f"--filename={c}" for c in crds))
        self.wait_established([f"{c.stem.split('_', 1)[1]}.{c.stem.split('_', 1)[0]}" for c in crds])

    def gateway_crds(self) -> list[Path]:
        """The Gateway API's CRDs (from its Go module, hack/gateway-crds.sh) and the InferencePool's
        (tests/e2e/crds: its module is not served here, docs/e2e.md)."""
        assert self.gateway_api is not None
        return [*sorted((self.gateway_api / "crds").glob("*.yaml")), GATEWAY_CRDS / "inferencepool-v1.yaml"]

    def install_gateway_crds(self) -> None:
        """As in a cluster with the Gateway API and its inference extension installed."""
        crds = self.gateway_crds()
        self.kubectl("apply", "--server-side", *(f"--filename={c}" for c in crds))
        self.wait_established(list(GATEWAY_CRD_NAMES))

    def wait_established(self, names: list[str], timeout: float = 60) -> None:
        """Until every CRD is Established (`kubectl wait` fails on a CRD whose conditions are not written yet)."""
        def established(name: str) -> bool:
            out = self.kubectl("get", "crd", name, "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                               check=False)
            return out.stdout.strip() == "True"
        wait_for(lambda: all(established(n) for n in names), timeout, f"CRDs established: {names}")

    def remove_gateway_crds(self) -> None:
        """As in a cluster without them: deleted with every object of their kinds."""
        self.kubectl("delete", "crd", "--ignore-not-found", "--wait=true", *GATEWAY_CRD_NAMES)

    def node_ready(self, name: str) -> bool:
        node = self.kube.core.read_node(name)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def run_helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = clean_env(KUBECONFIG=str(self.kubeconfig),
                        HELM_CACHE_HOME=str(self.workdir / "helm" / "cache"),
                        HELM_CONFIG_HOME=str(self.workdir / "helm" / "config"),
                        HELM_DATA_HOME=str(self.workdir / "helm" / "data"))
        return subprocess.run([str(self.helm), *args], capture_output=True, text=True, env=env, timeout=300)


@dataclass
class Release:
    namespace: str
    service_account: str
    manifest: list[dict[str, Any]]


def _external_cluster(workdir: Path) -> Iterator[Cluster]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.fail("GAUDI_SERVE_E2E_KUBECONFIG is set but there is no kubectl on PATH")
    helm = subprocess.run([str(ROOT / "hack" / "helm.sh")], capture_output=True, text=True, timeout=3600)
    if helm.returncode != 0:
        pytest.fail(f"hack/helm.sh could not build helm:\n{helm.stderr[-4000:]}")
    path = Path(EXTERNAL or "")
    c = Cluster(None, Kubectl(kubectl, path), Kube(path), Path(helm.stdout.strip()), workdir, path)
    try:
        yield c
    finally:
        c.run_helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait")
        for ns in [*c.namespaces, RELEASE_NS]:
            c.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("control-plane")
    if EXTERNAL:
        yield from _external_cluster(workdir)
        return
    if "error" in _BUILD:  # no skip: CI must see a missing control plane as a failure
        pytest.fail(f"the e2e control plane is not available: {_BUILD['error']}")
    try:
        binaries = _BUILD.get("binaries") or build_binaries()
    except Exception as exc:
        pytest.fail(f"the e2e control plane is not available: {exc}")
    cp = ControlPlane(binaries.control_plane, workdir)
    WATCH.start()
    logs: KubeletLogs | None = None
    try:
        cp.start()
        kube = Kube(cp.admin_kubeconfig)
        logs = KubeletLogs(cp.kubelet_port, cp.pki / "kubelet.crt", cp.pki / "kubelet.key")
        c = Cluster(cp, Kubectl(cp.bin("kubectl"), cp.admin_kubeconfig), kube, binaries.helm, workdir,
                    cp.admin_kubeconfig, autoscaling=binaries.autoscaling, kubelet_logs=logs,
                    gateway_api=binaries.gateway_api)
        for i in range(GAUDI_NODES):
            c.add_node(f"gaudi-{i}", 8)
        c.add_node("cpu-0", 0)
        c.install_keda_crds()
        c.install_gateway_crds()
        yield c
    finally:
        if logs is not None:
            logs.stop()
        stuck = cp.stop()
        assert not stuck, f"control-plane processes would not stop: {stuck}"
        for comp in cp.components:
            try:
                os.killpg(comp.proc.pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"process group of {comp.name} still alive after teardown")
        leaks = WATCH.stop()
        assert not leaks, f"sockets outside 127.0.0.0/8: {leaks}"


@pytest.fixture(scope="session")
def release(cluster: Cluster) -> Release:
    """`helm install` of our chart (CRDs, RBAC, the operator's Deployment), waiting for it to be ready."""
    out = cluster.run_helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
                           "--set", f"gateway.endpointPicker.image={PICKER_IMAGE}", "--wait", "--timeout", "3m")
    assert out.returncode == 0, f"helm install failed:\n{out.stderr}\n{out.stdout}"
    manifest = cluster.run_helm("get", "manifest", RELEASE, "--namespace", RELEASE_NS)
    assert manifest.returncode == 0, manifest.stderr
    docs = [d for d in yaml.safe_load_all(manifest.stdout) if d]
    sa = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    return Release(RELEASE_NS, sa, docs)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, release: Release) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount: the operator's only rights are the chart's."""
    token = cluster.kubectl("create", "token", release.service_account, "--namespace", release.namespace,
                            "--duration", "4h").stdout.strip()
    path = cluster.workdir / "operator.kubeconfig"
    assert cluster.cp is not None
    path.write_text(yaml.safe_dump(kubeconfig(cluster.cp.server, cluster.cp.pki / "ca.crt", token=token,
                                              user=release.service_account)))
    return path


def chart_operator_env(release: Release) -> dict[str, str]:
    """Who the operator is, as the chart's Deployment tells it (its namespace, its pods' labels, the
    endpoint picker it runs)."""
    (dep,) = [d for d in release.manifest if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["GAUDI_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    picker = {k: env[k]["value"] for k in ("GAUDI_OPERATOR_EPP_IMAGE", "GAUDI_OPERATOR_EPP_ARGS",
                                           "GAUDI_OPERATOR_EPP_CLUSTER_ROLE") if k in env}
    return {"GAUDI_OPERATOR_NAMESPACE": release.namespace,
            "GAUDI_OPERATOR_POD_LABELS": env["GAUDI_OPERATOR_POD_LABELS"]["value"], **picker}


@pytest.fixture(scope="session")
def operator(operator_kubeconfig: Path, cluster: Cluster, release: Release) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, cluster.workdir, env=chart_operator_env(release))
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture(scope="session")
def metrics_adapter(cluster: Cluster) -> Iterator[MetricsAdapter]:
    """The custom metrics API (custom.metrics.k8s.io) the HPA controller reads: the upstream test
    adapter, registered as an APIService, fed by the tests (tests/e2e/metrics_path.py)."""
    assert cluster.cp is not None and cluster.autoscaling is not None
    adapter = MetricsAdapter(cluster.autoscaling / "bin" / "metrics-adapter", cluster.workdir,
                             cluster.cp.admin_kubeconfig, cluster.cp.pki)
    adapter.start()
    try:
        adapter.register(cluster.kubectl)
        yield adapter
    finally:
        adapter.stop()


@pytest.fixture(scope="module")
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> str:
    name = "e2e-" + request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    cluster.kubectl("create", "namespace", name)
    cluster.namespaces.append(name)
    # The API server creates no default ServiceAccount: the controller-manager does; pods need it.
    def default_sa() -> bool:
        sas = cluster.kube.core.list_namespaced_service_account(name, field_selector="metadata.name=default")
        return bool(sas.items)
    wait_for(default_sa, 30, f"the default ServiceAccount of {name}")
    return name


@pytest.fixture
def cleanup(cluster: Cluster, ns: str) -> Iterator[list[str]]:
    """Names appended here are deleted after the test, waiting until their pods are gone (cards free again)."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.kubectl("delete", "inferenceservice", name, "-n", ns, "--ignore-not-found", "--wait=true")
    for name in names:
        wait_for(lambda n=name: not cluster.kube.pods(ns, n), 60, f"the pods of {name} to be gone")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Real processes playing pods' containers, each in a session of its own: stopped afterwards."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        stop_runtime(p)
