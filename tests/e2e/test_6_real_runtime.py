"""Scenario 6: the pod's container played by a real `gaudi-serve launch` (tiny model, CPU) on the
pod's own loopback IP: the operator reports WarmingUp with the process's progress, then Ready,
and a request through the pod address returns generated text. The service's API key comes from
a Secret (spec.apiKeySecretRef): the operator's warmup poll works all the same (/health stays
open), requests need the key, and the runtime's log never shows it.

The command line is the one the operator rendered into the pod, with what cannot hold outside a
container replaced: the model (a local tiny one), the address (the pod IP, not 0.0.0.0), the
dtype and device (float32 on CPU) and the scratch paths.
"""

from __future__ import annotations

import base64
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.control_plane import clean_env
from tests.e2e.harness import (
    OperatorProcess,
    http_json,
    is_ready,
    isvc_manifest,
    table,
    wait_for,
)
from tests.e2e.netwatch import WATCH
from tests.runtime.launched import hold_mid_warmup, signal_all

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator

PORT = 8080  # the runtime port the operator renders and polls
REPLACED = {"--model-id", "--hostname", "--dtype"}


def secret_value(cluster: Cluster, namespace: str, ref: dict) -> str:
    """What the kubelet puts in a variable taken from a Secret."""
    secret = cluster.kube.core.read_namespaced_secret(ref["name"], namespace)
    return base64.b64decode(secret.data[ref["key"]]).decode()


def container_command(pod: dict, model_dir: Path, scratch: Path,
                      cluster: Cluster | None = None) -> tuple[list[str], dict[str, str]]:
    c = pod["spec"]["containers"][0]
    args, it = [], iter(c["args"])
    for a in it:
        if a in REPLACED:
            next(it)
            continue
        args.append(a)
    assert args[0] == "launch" and args[args.index("--port") + 1] == str(PORT), c["args"]
    args += ["--model-id", str(model_dir), "--hostname", pod["status"]["podIP"], "--dtype", "float32",
             "--device", "cpu", "--shard-uds-path", str(scratch / "shard")]
    env = {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e}
    for e in c.get("env") or []:
        if cluster is not None and "secretKeyRef" in (e.get("valueFrom") or {}):
            env[e["name"]] = secret_value(cluster, pod["metadata"]["namespace"], e["valueFrom"]["secretKeyRef"])
    env.update(HF_HOME=str(scratch / "hf"), HUGGINGFACE_HUB_CACHE=str(scratch / "hf" / "hub"), LOG_LEVEL="info")
    return [sys.executable, "-m", "gaudi_runtime.cli", *args], env


def test_real_runtime_warms_up_then_serves_through_the_pod_ip(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                              cleanup: list[str], processes: list,
                                                              tmp_path: Path) -> None:
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    kube = cluster.kube
    model_dir = make_tiny_model(tmp_path / "tiny-llama", "llama")
    api_key = secrets.token_urlsafe(24)
    kube.core.create_namespaced_secret(ns, {"metadata": {"name": "tiny-api-key"}, "type": "Opaque",
                                            "data": {"API_KEY": base64.b64encode(api_key.encode()).decode()}})
    cleanup.append("tiny")
    cluster.kubectl.apply(isvc_manifest(
        "tiny", ns, shards=1, replicas=1, manual=True, apiKeySecretRef={"name": "tiny-api-key"},
        serving={"maxInputTokens": 256, "maxTotalTokens": 512, "maxBatchSize": 32},  # seconds of warmup
        batching={"padSequenceToMultipleOf": 16, "batchBucketSize": 2, "prefillBatchBucketSize": 2,
                  "hpuGraphs": False}))
    (pod,) = wait_for(lambda: (p := kube.live_pods(ns, "tiny")) and p[0]["status"].get("podIP") and p, 60,
                      "the pod to run with an IP")
    ip = pod["status"]["podIP"]
    assert ip.startswith("127."), ip  # simulated pod IPs are loopback addresses

    cmd, env = container_command(pod, model_dir, tmp_path, cluster)
    assert env["API_KEY"] == api_key and not any(api_key in a for a in cmd)
    log = open(tmp_path / "runtime.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(**env), start_new_session=True)
    processes.append(proc)
    WATCH.watch(proc.pid)
    url = f"http://{ip}:{PORT}"

    def runtime_log_text() -> str:
        return (tmp_path / "runtime.log").read_text(errors="replace")

    # Hold warmup in its middle (the shard stops; the router keeps answering /health) so that the
    # operator's poll sees a known value, whatever this machine's speed.
    shards, _ = hold_mid_warmup(proc, url)
    try:
        def operator_sees_it() -> tuple[dict, dict] | None:
            # (Progress the shard sent just before it stopped may still reach the router: compare
            # with what the process reports now, which soon stops moving.)
            st = kube.status(ns, "tiny")
            now = http_json("GET", url + "/health")[1]["warmup"]
            return (st, now) if st.get("phase") == "WarmingUp" and st.get("warmup", {}).get("done") == now["done"] \
                else None
        status, frozen = wait_for(operator_sees_it, 60, "status WarmingUp at the process's progress")
        assert status["warmup"] == {"done": frozen["done"], "total": frozen["total"], "pod": pod["metadata"]["name"],
                                    "phase": frozen["phase"]}
        assert status["warmupSummary"] == f"{frozen['done']}/{frozen['total']}"
        (row,) = table(cluster.kubectl("get", "gisvc", "tiny", "-n", ns).stdout)
        assert (row["PHASE"], row["READY"], row["WARMUP"]) == ("WarmingUp", "0/1", status["warmupSummary"]), row
    finally:
        signal_all(shards, signal.SIGCONT)

    # Play the kubelet's readiness probe: /health answers 200 once warmup is done.
    wait_for(lambda: http_json("GET", url + "/health", timeout=2)[0] == 200, 240, "the runtime to be ready",
             interval=0.2)
    kube.mark_ready(kube.live_pods(ns, "tiny")[0])
    status = wait_for(lambda: (s := kube.status(ns, "tiny")).get("phase") == "Ready" and s, 60, "tiny Ready")
    assert "warmup" not in status and is_ready(kube.live_pods(ns, "tiny")[0])

    request = {"inputs": "The cards are warm and", "parameters": {"max_new_tokens": 8, "details": True}}
    code, body = http_json("POST", url + "/generate", request, 60)
    assert code == 401 and body["error_type"] == "authentication", body
    code, body = http_json("POST", url + "/generate", request, 60, headers={"Authorization": f"Bearer {api_key}"})
    assert code == 200, body
    assert isinstance(body["generated_text"], str) and body["details"]["generated_tokens"] == 8
    assert '"api_key": "<redacted>"' in runtime_log_text() and api_key not in runtime_log_text()
