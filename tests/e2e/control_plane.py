"""A real Kubernetes control plane on 127.0.0.1 for the e2e tests.

etcd, kube-apiserver (TLS, RBAC, service-account tokens, an audit log of
service-account requests, the aggregation layer's front-proxy certificates),
kube-controller-manager, kube-scheduler and kwok (simulated nodes and pod
lifecycle), each a child process in its own process group, with its log in the
session's directory. The binaries come from hack/control-plane.sh (built once
per machine from Go modules); the custom-metrics adapter and KEDA's CRDs of the
autoscaling scenarios from hack/autoscaling-tools.sh.

Network hygiene: every component listens on 127.0.0.1, node and pod IPs are
in 127.<net>.0.0/16 (a per-session /16 inside 127.0.0.0/8), no proxy is used.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.netwatch import WATCH

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
SERVICE_CIDR = "10.96.0.0/16"  # virtual only: no kube-proxy, nothing ever routes to it
BUILD_TIMEOUT_S = 85 * 60
# The HPA controller's sync period here (15 s by default): the autoscaling scenarios wait for it.
HPA_SYNC_PERIOD = "2s"
# The custom-metrics adapter's Service (ExternalName to 127.0.0.1) and the name its certificate carries.
METRICS_ADAPTER_SERVICE = ("kube-system", "custom-metrics-apiserver")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: ours, minus any proxy (nothing may leave 127.0.0.0/8)."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Binaries:
    control_plane: Path  # kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, kwok
    helm: Path
    autoscaling: Path  # bin/metrics-adapter, keda-crds/
    gateway_api: Path  # crds/: the Gateway API's HTTPRoute, Gateway and GatewayClass


def build_binaries() -> Binaries:
    """The e2e binaries from hack/*.sh, building them on first use (tens of minutes cold)."""
    def run(script: str) -> Path:
        out = subprocess.run([str(ROOT / "hack" / script)], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S, env={**os.environ, "GOFLAGS": os.environ.get("GOFLAGS", "-p=2")})
        if out.returncode != 0:
            raise RuntimeError(f"hack/{script} could not build the e2e binaries (exit {out.returncode}):\n"
                               f"{out.stderr[-4000:]}")
        return Path(out.stdout.strip().splitlines()[-1])
    return Binaries(run("control-plane.sh"), run("helm.sh"), run("autoscaling-tools.sh"), run("gateway-crds.sh"))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> None:
    """A CA, the API server's serving cert, an admin client cert (system:masters), the SA key pair."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=gaudi-serve-e2e-ca", cwd=d)

    def leaf(name: str, subject: str, ext: str) -> None:
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)

    leaf("apiserver", "/CN=kube-apiserver",
         "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
         "DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n")
    leaf("admin", "/O=system:masters/CN=e2e-admin", "extendedKeyUsage=clientAuth\n")
    leaf("kubelet", "/CN=e2e-kubelet", "extendedKeyUsage=serverAuth\n")  # the nodes' log endpoint (kubelet_logs.py)
    ns, svc = METRICS_ADAPTER_SERVICE
    leaf("metrics-adapter", f"/CN={svc}",
         f"subjectAltName=IP:127.0.0.1,DNS:{svc}.{ns}.svc\nextendedKeyUsage=serverAuth\n")
    # The aggregation layer: the API server proxies to extension API servers (the custom-metrics
    # adapter) as front-proxy-client, signed by a CA of its own, as kubeadm sets it up.
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt", "-days", "2",
             "-subj", "/CN=gaudi-serve-e2e-front-proxy-ca", cwd=d)
    (d / "front-proxy-client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "front-proxy-client.key", "-out", "front-proxy-client.csr",
             "-subj", "/CN=front-proxy-client", cwd=d)
    _openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
             "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-out", "front-proxy-client.crt", "-days", "2",
             "-extfile", "front-proxy-client.ext", cwd=d)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=d)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig(server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
               token: str | None = None, user: str = "admin") -> dict[str, Any]:
    creds: dict[str, Any] = {"token": token} if token else {"client-certificate": str(cert), "client-key": str(key)}
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
    }


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    # Only what service accounts do (the operator runs as one): the RBAC test reads it.
    "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}],
}


@dataclass
class Component:
    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@dataclass
class ControlPlane:
    bin_dir: Path
    workdir: Path
    net: int = field(default_factory=lambda: random.randint(100, 250))  # 127.<net>.x.y for nodes and pods
    components: list[Component] = field(default_factory=list)
    api_port: int = 0
    kubelet_port: int = field(default_factory=free_port)  # the simulated nodes' log endpoint (kubelet_logs.py)
    api_args: list[str] = field(default_factory=list)
    # (from, to) of each API server start, UTC: until its caches sync it refuses what it cannot
    # authorize yet (403), which is no statement about anyone's RBAC.
    api_starts: list[tuple[datetime.datetime, datetime.datetime]] = field(default_factory=list)

    # ---- paths ---------------------------------------------------------
    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    # ---- life cycle ----------------------------------------------------
    def _spawn(self, name: str, *args: str, append: bool = False) -> Component:
        log = self.workdir / f"{name}.log"
        out = open(log, "ab" if append else "wb")
        proc = subprocess.Popen([self.bin(name), *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=clean_env(), cwd=self.workdir)
        out.close()
        WATCH.watch(proc.pid)
        comp = Component(name, proc, log)
        self.components.append(comp)
        return comp

    def _wait_healthy(self, comp: Component, url: str, timeout: float = 120.0, **kw: Any) -> None:
        ctx = ssl.create_default_context(cafile=str(kw["ca"])) if "ca" in kw else ssl._create_unverified_context()
        if "cert" in kw:
            ctx.load_cert_chain(str(kw["cert"]), str(kw["key"]))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if comp.proc.poll() is not None:
                raise RuntimeError(f"{comp.name} exited with {comp.proc.returncode}:\n{comp.tail()}")
            try:
                with opener.open(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)  # poll interval of a deadline-bounded wait
        raise TimeoutError(f"{comp.name} not healthy at {url} in {timeout}s ({last}):\n{comp.tail()}")

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_pki(self.pki)
        p = self.pki
        etcd_port, peer_port = free_port(), free_port()
        self.api_port = free_port()
        etcd = self._spawn(
            "etcd", "--name=e2e", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=e2e=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level=warn")
        self._wait_healthy(etcd, f"http://127.0.0.1:{etcd_port}/health")

        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.api_args = [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
            # The endpoint reconciler refuses a loopback address for the `kubernetes` Service.
            "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            # A node's kubelet (its log endpoint) at its InternalIP: its name would be a DNS lookup.
            "--kubelet-preferred-address-types=InternalIP",
            f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
            f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={p / 'front-proxy-client.key'}"]
        self.start_apiserver()
        self.admin_kubeconfig.write_text(yaml.safe_dump(
            kubeconfig(self.server, p / "ca.crt", cert=p / "admin.crt", key=p / "admin.key")))

        kc = str(self.admin_kubeconfig)
        delegated = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                     "--bind-address=127.0.0.1", "--leader-elect=false"]
        kcm_port = free_port()
        kcm = self._spawn(
            "kube-controller-manager", *delegated, f"--secure-port={kcm_port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}")
        sched_port = free_port()
        sched = self._spawn("kube-scheduler", *delegated, f"--secure-port={sched_port}",
                            f"--cert-dir={self.workdir / 'scheduler-certs'}")
        kwok_port = free_port()
        kwok = self._spawn(
            "kwok", f"--kubeconfig={kc}", f"--config={HERE / 'kwok-stages.yaml'}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--node-ip=127.{self.net}.0.1", f"--cidr=127.{self.net}.255.0/24",
            f"--server-address=127.0.0.1:{kwok_port}", "--node-lease-duration-seconds=40")
        self._wait_healthy(kcm, f"https://127.0.0.1:{kcm_port}/healthz")
        self._wait_healthy(sched, f"https://127.0.0.1:{sched_port}/healthz")
        self._wait_healthy(kwok, f"http://127.0.0.1:{kwok_port}/healthz")

    def _component(self, name: str) -> Component:
        return next(c for c in reversed(self.components) if c.name == name)

    def start_apiserver(self) -> None:
        """(Re)start kube-apiserver with the same flags, port and etcd: the cluster's state is kept."""
        restart = any(c.name == "kube-apiserver" for c in self.components)
        if restart:
            self.components.remove(self._component("kube-apiserver"))
        began = datetime.datetime.now(datetime.timezone.utc)
        api = self._spawn("kube-apiserver", *self.api_args, append=restart)
        p = self.pki
        self._wait_healthy(api, f"{self.server}/readyz", ca=p / "ca.crt", cert=p / "admin.crt", key=p / "admin.key")
        self.api_starts.append((began, datetime.datetime.now(datetime.timezone.utc)))

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver alone (etcd and the controllers keep running): a control-plane outage."""
        api = self._component("kube-apiserver")
        os.killpg(api.proc.pid, signal.SIGTERM)
        try:
            api.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(api.proc.pid, signal.SIGKILL)
            api.proc.wait(timeout=10)

    def stop(self) -> list[str]:
        """Stop every component, newest first, each before the ones it needs (the API server
        before etcd: without etcd it hangs in its shutdown); the names of any that would not die."""
        stuck = []
        for comp in reversed(self.components):
            if comp.proc.poll() is None:
                os.killpg(comp.proc.pid, signal.SIGTERM)
            try:
                comp.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(comp.proc.pid, signal.SIGKILL)
                try:
                    comp.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    stuck.append(comp.name)
        return stuck

    # ---- nodes ---------------------------------------------------------
    def node_ip(self, index: int) -> str:
        return f"127.{self.net}.0.{index + 2}"

    def node_manifest(self, name: str, index: int, gaudi: int) -> dict[str, Any]:
        """A simulated node (kwok), with `gaudi` habana.ai/gaudi cards, node and pod IPs in 127.<net>/16."""
        resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "ephemeral-storage": "1Ti"}
        if gaudi:
            resources["habana.ai/gaudi"] = str(gaudi)
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "type": "kwok", "gaudiserve.io/e2e-node": "true"}},
            "spec": {"podCIDR": f"127.{self.net}.{index + 1}.0/24"},
            "status": {"addresses": [{"type": "InternalIP", "address": self.node_ip(index)},
                                     {"type": "Hostname", "address": name}],
                       "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                       "allocatable": resources, "capacity": dict(resources)},
        }


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
