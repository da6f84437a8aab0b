"""Scenario 7b: the operator image (Dockerfile.operator, built by hack/build-images.sh) in place of
the operator process, run the way the chart's Deployment runs it: the container's command,
arguments, environment and security context from the installed chart (its user, a read-only
root filesystem with its /tmp emptyDir, no capabilities), and the chart's ServiceAccount token,
CA and namespace mounted where a pod has them, with KUBERNETES_SERVICE_HOST/PORT naming the API
server: it logs in in-cluster, with only the chart's rights. An InferenceService reaches Ready
and, deleted, is gone. The image's user, port and entry point are the chart's.

The container shares the host's network (everything stays inside 127.0.0.0/8), where there is
no cluster DNS and no kube-proxy, so: `kubernetes.default.svc` (where Kopf's in-cluster login
connects, port 443) names a loopback address where a TCP relay plays the `kubernetes` Service;
KUBERNETES_SERVICE_HOST/PORT (where the `kubernetes` client's in-cluster configuration connects)
name the API server itself, 127.0.0.1 and its port, an address its certificate holds; the
liveness endpoint listens on 127.0.0.1 and a free port rather than 0.0.0.0:8080; and the resync
period is 1 s, as the operator process of the other scenarios has it.
"""

from __future__ import annotations

import os
import random
import select
import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Cluster, Release
from tests.e2e.control_plane import free_port
from tests.e2e.harness import NO_PROXY, OperatorProcess, isvc_manifest, wait_for
from tests.e2e.netwatch import WATCH, listening
from tests.images.engine import Container, Images, pod_flags

pytestmark = pytest.mark.simulated  # the local control plane, its CA and loopback API server
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
NAME = "imaged"


class ServiceRelay(socketserver.ThreadingTCPServer):
    """The `kubernetes` Service (port 443) on a free loopback address, relaying each connection to
    the API server."""

    daemon_threads = True

    def __init__(self, api_port: int) -> None:
        self.api_port = api_port
        for _ in range(20):
            self.ip = f"127.0.96.{random.randint(1, 254)}"  # outside the session's node and pod /16
            try:
                super().__init__((self.ip, 443), _Relay)
                return
            except OSError:
                continue
        raise AssertionError("no free loopback address for the kubernetes Service relay")


class _Relay(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with socket.create_connection(("127.0.0.1", self.server.api_port)) as upstream:
            peer = {self.request: upstream, upstream: self.request}
            while True:
                for s in select.select(list(peer), [], [])[0]:
                    data = s.recv(65536)
                    if not data:
                        return
                    peer[s].sendall(data)


@pytest.fixture
def kubernetes_service(cluster: Cluster) -> Iterator[ServiceRelay]:
    assert cluster.cp is not None
    relay = ServiceRelay(cluster.cp.api_port)
    threading.Thread(target=relay.serve_forever, name="kubernetes-service", daemon=True).start()
    yield relay
    relay.shutdown()
    relay.server_close()


def chart_operator(release: Release) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and container of the chart's operator Deployment, as installed."""
    dep = next(d for d in release.manifest if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def service_account_files(cluster: Cluster, release: Release, path: Path) -> Path:
    """What the kubelet mounts at SA_DIR: a token of the pod's ServiceAccount, the cluster's CA,
    the namespace; readable by the container's user."""
    token = cluster.kubectl("create", "token", release.service_account, "--namespace", release.namespace,
                            "--duration", "1h").stdout.strip()
    assert cluster.cp is not None
    path.mkdir()
    (path / "token").write_text(token)
    (path / "ca.crt").write_bytes((cluster.cp.pki / "ca.crt").read_bytes())
    (path / "namespace").write_text(release.namespace)
    for f in [path, *path.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    return path


def test_the_operator_image_is_what_the_chart_runs(images: Images, release: Release) -> None:
    pod, c = chart_operator(release)
    config = images.config(images.operator)
    assert config["User"] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert config["Entrypoint"] == c["command"]
    assert set(config["ExposedPorts"]) == {f"{p['containerPort']}/{p['protocol'].lower()}" for p in c["ports"]}
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "gaudi-serve-operator"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"


def start_as_the_chart_would(cluster: Cluster, release: Release, images: Images, service: ServiceRelay,
                             workdir: Path) -> tuple[Container, int]:
    assert cluster.cp is not None
    pod, c = chart_operator(release)
    port = free_port()
    args = [f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a for a in c["args"]]
    env = [{**e, "value": "1"} if e["name"] == "GAUDI_OPERATOR_RESYNC_SECONDS" else e for e in c["env"]]
    env += [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(cluster.cp.api_port)}]
    sa = service_account_files(cluster, release, workdir / "serviceaccount")
    flags = pod_flags(pod, {**c, "env": env}, {SA_DIR: f"{sa}:ro"})
    flags += ["--add-host", f"kubernetes.default.svc:{service.ip}"]
    return images.podman.start(images.operator, args, flags), port


def test_the_operator_image_runs_an_inference_service_to_ready(cluster: Cluster, release: Release,
                                                               operator: OperatorProcess, images: Images, ns: str,
                                                               cleanup: list[str], kubernetes_service: ServiceRelay,
                                                               tmp_path: Path) -> None:
    kube = cluster.kube
    operator.stop()  # one operator at a time: the image's, for this scenario
    container = None
    try:
        container, port = start_as_the_chart_would(cluster, release, images, kubernetes_service, tmp_path)
        pgid = os.getpgid(container.pid())
        WATCH.watch(pgid)  # its sockets count for the network hygiene check too

        def healthy() -> bool:
            assert container.running(), f"the operator container exited:\n{container.logs()}"
            try:
                with NO_PROXY.open(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(healthy, 60, "the operator container's liveness endpoint")
        assert ("127.0.0.1", port) in listening({pgid})  # the sampler sees the container's processes

        cleanup.append(NAME)
        cluster.kubectl.apply(isvc_manifest(NAME, ns, shards=1))
        wait_for(lambda: kube.status(ns, NAME).get("phase") == "Ready", 90, f"{NAME} Ready, reconciled by the image")
        assert len(kube.deployments(ns, NAME)) == 1

        cluster.kubectl("delete", "gisvc", NAME, "-n", ns, "--wait=true", timeout=90)
        assert kube.isvc(ns, NAME) is None
        assert container.stop() == 0, container.logs()  # SIGTERM, as the kubelet stops it
    except BaseException:
        if container is not None:
            print(f"the operator container's log:\n{container.logs()}")  # shown with the failure
        raise
    finally:
        if container is not None:
            container.remove()
        operator.start()
