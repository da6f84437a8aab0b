"""Scenario 6b: a cold start through the model cache (spec.model.cache.prefetch), with real processes
playing the containers: the download Job's pod is a real `gaudi-serve download` against the hub
stand-in on loopback, writing into a directory that stands for the ReadWriteMany claim; the
serving pod is a real `gaudi-serve launch`, offline from that directory.

* Two InferenceServices naming the same model, revision and claim share one Job (both own it).
* The status goes Downloading (with the bytes of the download's last JSON line, which the operator
  reads through the API server's pods/log, from the node's log endpoint) -> Loading -> WarmingUp
  -> Ready, and the newest pod's start-up timings reach it; the runtime starts with the hub
  offline and writes nothing into the claim.
* A download the hub refuses (401) fails the Job at once (podFailurePolicy) and the service, with
  a Warning naming the token Secret.

The tests play the kubelet: they run each container's command line (the claim's mounts mapped
to the directory, Secret variables resolved), and set the pod's terminal state with the exit code
and the log's tail as termination message, as FallbackToLogsOnError does.

GAUDI_SERVE_E2E_COLD_START_LAYERS=24 serves a 304 MB model instead of the tiny one and prints
the timings (docs/operations.md, "Cold start", has what it measured).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.control_plane import clean_env
from tests.e2e.harness import (
    OperatorProcess,
    condition,
    http_json,
    isvc_manifest,
    rwx_claim,
    table,
    wait_for,
)
from tests.e2e.netwatch import WATCH
from tests.hub_standin import HubStandIn, StandInRepo
from tests.runtime.launched import hold_mid_warmup, signal_all

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator

PORT = 8080
CLAIM = "models"
MODEL = "org/tiny"
LAYERS = int(os.environ.get("GAUDI_SERVE_E2E_COLD_START_LAYERS", "0"))  # 0: the tiny model
# Enough shapes for the warmup to be seen; when measuring, the settings of the runtime's own
# measurements in docs/operations.md (6 shapes).
SERVING = {"maxInputTokens": 256, "maxTotalTokens": 512, "maxBatchSize": 8 if LAYERS else 32}
BATCHING = {"hpuGraphs": False} if LAYERS else {"padSequenceToMultipleOf": 16, "batchBucketSize": 2,
                                                 "prefillBatchBucketSize": 2, "hpuGraphs": False}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    from gaudi_runtime.tools import tiny_model

    size = "tiny"
    if LAYERS:  # a model of a few hundred MB, for the measurements
        tiny_model.SHAPES["measured"] = {**tiny_model.SHAPES["small"], "num_hidden_layers": LAYERS}
        size = "measured"
    model = tiny_model.make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "llama", size=size)
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    h = HubStandIn({MODEL: StandInRepo(files)}, token=secrets.token_urlsafe(16)).start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def claim(cluster: Cluster, ns: str) -> str:
    rwx_claim(cluster.kube, ns, CLAIM)
    return CLAIM


def _secret(cluster: Cluster, ns: str, name: str, value: str) -> None:
    cluster.kube.core.create_namespaced_secret(ns, {"metadata": {"name": name}, "type": "Opaque",
                                                    "data": {"HF_TOKEN": base64.b64encode(value.encode()).decode()}})


def _secret_value(cluster: Cluster, ns: str, ref: dict[str, str]) -> str:
    secret = cluster.kube.core.read_namespaced_secret(ref["name"], ns)
    return base64.b64decode(secret.data[ref["key"]]).decode()


def container_command(cluster: Cluster, pod: dict[str, Any], claim: Path) -> tuple[list[str], dict[str, str]]:
    """The pod's container as a process here: the claim's mounts (subPath included) mapped into
    `claim`, the variables from Secrets resolved, as the kubelet would."""
    c = pod["spec"]["containers"][0]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: claim / m.get("subPath", "") for m in c.get("volumeMounts") or []
              if "persistentVolumeClaim" in volumes[m["name"]]}
    for target in mounts.values():
        target.mkdir(parents=True, exist_ok=True)  # the kubelet creates a missing subPath

    def local(value: str) -> str:
        for path, target in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == path or value.startswith(path + "/"):
                return str(target) + value[len(path):]
        return value
    env = {k: v for k, v in clean_env().items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    for e in c.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        env[e["name"]] = local(e["value"]) if "value" in e else _secret_value(cluster, pod["metadata"]["namespace"], ref)
    return [sys.executable, "-m", "gaudi_runtime.cli", *[local(a) for a in c["args"]]], env


def run_container(cluster: Cluster, pod: dict[str, Any], claim: Path, out: Path, procs: list,
                  cmd: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the container's process; its output is the container's log (served to the API server)."""
    if cmd is None or env is None:
        cmd, env = container_command(cluster, pod, claim)
    log = open(out, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(proc)
    WATCH.watch(proc.pid)
    assert cluster.kubelet_logs is not None
    meta = pod["metadata"]
    cluster.kubelet_logs.register(meta["namespace"], meta["name"], pod["spec"]["containers"][0]["name"], out)
    return proc


def end_container(cluster: Cluster, pod: dict[str, Any], code: int, log: Path) -> None:
    """Play the kubelet once the process exited: the pod's terminal phase, the exit code and, for a
    failure, the log's tail as termination message (terminationMessagePolicy FallbackToLogsOnError)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    c = pod["spec"]["containers"][0]
    terminated: dict[str, Any] = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                  "startedAt": now, "finishedAt": now}
    if code:
        terminated["message"] = log.read_bytes()[-2048:].decode(errors="replace")
    cluster.kube.core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": {
        "phase": "Succeeded" if code == 0 else "Failed",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": "False", "lastTransitionTime": now}],
        "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                               "restartCount": 0, "started": False, "state": {"terminated": terminated}}]}},
        _content_type="application/merge-patch+json")


def download_jobs(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    api = cluster.kube.client
    items = cluster.kubectl.json("get", "jobs", "-n", ns, "-l", "gaudiserve.io/model-download")["items"]
    return [api.sanitize_for_serialization(j) for j in items]


def job_pod(cluster: Cluster, ns: str, job: dict[str, Any]) -> dict[str, Any] | None:
    pods = cluster.kubectl.json("get", "pods", "-n", ns, "-l", f"batch.kubernetes.io/job-name={job['metadata']['name']}")
    running = [p for p in pods["items"] if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
    return running[0] if running else None


def phases(cluster: Cluster, ns: str, name: str) -> list[str]:
    """The phases of `name` in the order the operator posted them (one Event per phase change)."""
    events = cluster.kube.core.list_namespaced_event(
        ns, field_selector=f"involvedObject.kind=InferenceService,involvedObject.name={name}").items
    return [e.reason for e in sorted(events, key=lambda e: int(e.metadata.resource_version))]


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _downloading_as_the_log_says(cluster: Cluster, ns: str, job: dict[str, Any], hub: HubStandIn,
                                 proc: subprocess.Popen, out: Path, weights: int) -> None:
    """With the transfer held mid-weights: both services are Downloading with the bytes of the
    download's last JSON line, which the operator read through pods/log."""
    kube = cluster.kube

    def stalled() -> dict[str, Any] | None:
        if proc.poll() is not None:
            raise AssertionError(f"the download exited with {proc.returncode}:\n{out.read_text()[-3000:]}")
        sent = hub.bytes_sent("/model.safetensors")
        lines = [ln for ln in out.read_text().splitlines() if '"progress"' in ln]
        return lines and sent >= weights // 2 and json.loads(lines[-1])
    last = wait_for(stalled, 120, "the download to stall mid-weights")

    def downloading() -> dict[str, Any] | None:
        st = kube.status(ns, "cold-a")
        return st if st.get("phase") == "Downloading" and st.get("download", {}).get("done") == last["done"] else None
    status = wait_for(downloading, 60, "status Downloading with the download's bytes")
    assert 0 < last["done"] < last["total"]
    assert status["download"]["total"] == last["total"] and status["download"]["job"] == job["metadata"]["name"]
    assert condition(status, "Downloaded")["reason"] == "Downloading"
    (row,) = table(cluster.kubectl("get", "gisvc", "cold-a", "-n", ns, "-o", "wide").stdout)
    assert row["PHASE"] == "Downloading" and row["DOWNLOAD"] == status["downloadSummary"], row
    wait_for(lambda: kube.status(ns, "cold-b").get("download", {}).get("done") == last["done"], 30,
             "cold-b sees the same download")


def test_a_shared_download_then_an_offline_start(cluster: Cluster, operator: OperatorProcess, ns: str, claim: str,
                                                 cleanup: list[str], processes: list, hub: HubStandIn,
                                                 tmp_path: Path) -> None:
    kube, claim_dir = cluster.kube, tmp_path / "claim"
    _secret(cluster, ns, "hf-token", hub.token or "")
    model = {"id": MODEL, "hubTokenSecretRef": {"name": "hf-token"},
             "cache": {"persistentVolumeClaim": {"claimName": claim}, "prefetch": True, "recipes": True}}
    env = [{"name": "HF_ENDPOINT", "value": hub.url}]
    cleanup += ["cold-a", "cold-b"]
    started = time.monotonic()
    for name in ("cold-a", "cold-b"):
        cluster.kubectl.apply(isvc_manifest(name, ns, shards=1, manual=True, model=model, env=env,
                                            serving=SERVING, batching=BATCHING))

    # One Job for both, owned by both; no replica before the model is in the claim.
    (job,) = wait_for(lambda: (j := download_jobs(cluster, ns)) and len(j[0]["metadata"]["ownerReferences"]) == 2
                      and j, 60, "one download Job owned by both services")
    assert {o["name"] for o in job["metadata"]["ownerReferences"]} == {"cold-a", "cold-b"}
    assert kube.deployments(ns, "cold-a") == [] and kube.deployments(ns, "cold-b") == []

    # The download, held in the middle of the weights by the hub so that the status can be read
    # (not when measuring: the timings are the download's own).
    weights = len(hub.repos[MODEL].files["model.safetensors"])
    if not LAYERS:
        hub.fail_once("model.safetensors", weights // 2, "hang")
    pod = wait_for(lambda: job_pod(cluster, ns, job), 60, "the download Job's pod running")
    out = tmp_path / "download.log"
    proc = run_container(cluster, pod, claim_dir, out, processes)
    if not LAYERS:
        _downloading_as_the_log_says(cluster, ns, job, hub, proc, out, weights)
        hub.release()  # the transfer resumes and completes
    assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    end_container(cluster, pod, 0, out)
    downloaded = time.monotonic()
    for name in ("cold-a", "cold-b"):
        wait_for(lambda n=name: condition(kube.status(ns, n), "Downloaded").get("status") == "True", 60,
                 f"{name} Downloaded")

    # The replicas: the claim read-only, the hub offline, the recipes on a writable subPath.
    (serving,) = wait_for(lambda: (p := kube.live_pods(ns, "cold-a")) and p[0]["status"].get("podIP") and p, 60,
                          "cold-a's pod running")
    c = serving["spec"]["containers"][0]
    assert {"name": "model-cache", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    wait_for(lambda: kube.status(ns, "cold-b").get("phase") == "Loading", 60, "cold-b Loading")
    wait_for(lambda: kube.status(ns, "cold-a").get("phase") == "Loading", 60, "cold-a Loading")

    before, requests = listing(claim_dir / "hub"), len(hub.requests)
    status, url = serve(cluster, ns, "cold-a", serving, claim_dir, tmp_path, processes, hold_warmup=True)
    ready = time.monotonic()

    assert len(hub.requests) == requests, hub.requests[requests:]  # offline: not one request to the hub
    assert listing(claim_dir / "hub") == before  # and nothing written into the model's claim
    startup = status["startup"]
    assert startup["pod"] == serving["metadata"]["name"]
    assert 0 <= startup["downloadSeconds"] < 30 and startup["loadSeconds"] > 0 and startup["warmupSeconds"] > 0
    assert "warmupFromCache" not in startup  # no recipe cache off Gaudi
    seen = phases(cluster, ns, "cold-a")
    assert [p for p in seen if p != "Pending"] == ["Downloading", "Loading", "WarmingUp", "Ready"], seen
    code, body = http_json("POST", url + "/generate", {"inputs": "Cold", "parameters": {"max_new_tokens": 4}}, 60)
    assert code == 200 and body["generated_text"], body
    if LAYERS:  # the measurements, and a second start from the same claim (cold-b's pod)
        (second,) = kube.live_pods(ns, "cold-b")
        again, _ = serve(cluster, ns, "cold-b", second, claim_dir, tmp_path, processes, hold_warmup=False)
        print(f"\ncold start, {status['download']['total'] / 1e6:.1f} MB: download job "
              f"{status['download']['seconds']:.1f}s (apply to Downloaded {downloaded - started:.1f}s), "
              f"first pod {startup}, Downloaded to Ready {ready - downloaded:.1f}s; second pod {again['startup']}")


def serve(cluster: Cluster, ns: str, name: str, pod: dict[str, Any], claim_dir: Path, tmp_path: Path,
          processes: list, hold_warmup: bool) -> tuple[dict[str, Any], str]:
    """Run the serving pod's container (the runtime on the pod's IP, CPU, float32) until Ready; with
    `hold_warmup`, hold its warmup until the operator reported WarmingUp. (status, the pod's URL)."""
    kube, ip = cluster.kube, pod["status"]["podIP"]
    cmd, env = container_command(cluster, pod, claim_dir)
    cmd = [a if a != "0.0.0.0" else ip for a in cmd] + ["--device", "cpu",
                                                        "--shard-uds-path", str(tmp_path / f"shard-{name}")]
    cmd[cmd.index("--dtype") + 1] = "float32"
    log = tmp_path / f"runtime-{name}.log"
    runtime = run_container(cluster, pod, claim_dir, log, processes, cmd, env)
    url = f"http://{ip}:{PORT}"

    if hold_warmup:
        shards, _ = hold_mid_warmup(runtime, url)
        try:  # held in its middle until the operator saw it
            wait_for(lambda: kube.status(ns, name).get("phase") == "WarmingUp", 60, f"{name} WarmingUp")
        finally:
            signal_all(shards, signal.SIGCONT)
    def ready() -> bool:
        try:
            return http_json("GET", url + "/health", timeout=2)[0] == 200
        except OSError:  # not listening yet
            return False
    wait_for(ready, 600, "the runtime ready", interval=0.2)
    kube.mark_ready(kube.live_pods(ns, name)[0])  # the kubelet's readiness probe
    status = wait_for(lambda: (st := kube.status(ns, name)).get("phase") == "Ready" and st.get("startup") and st, 60,
                      f"{name} Ready with its start-up timings")
    return status, url


def test_a_download_the_hub_refuses_fails_naming_the_token_secret(cluster: Cluster, operator: OperatorProcess,
                                                                  ns: str, claim: str, cleanup: list[str],
                                                                  processes: list, hub: HubStandIn,
                                                                  tmp_path: Path) -> None:
    kube = cluster.kube
    _secret(cluster, ns, "stale-token", "hf_not_the_token")
    cleanup.append("refused")
    model = {"id": MODEL, "revision": hub.repos[MODEL].commit, "hubTokenSecretRef": {"name": "stale-token"},
             "cache": {"persistentVolumeClaim": {"claimName": claim}, "prefetch": True}}
    cluster.kubectl.apply(isvc_manifest("refused", ns, shards=1, model=model,
                                        env=[{"name": "HF_ENDPOINT", "value": hub.url}]))
    job = wait_for(lambda: [j for j in download_jobs(cluster, ns)
                            if [o["name"] for o in j["metadata"]["ownerReferences"]] == ["refused"]], 60,
                   "the Job of the refused service")[0]
    pod = wait_for(lambda: job_pod(cluster, ns, job), 60, "its pod running")
    out = tmp_path / "download.log"
    proc = run_container(cluster, pod, tmp_path / "claim", out, processes)
    assert proc.wait(timeout=120) == 3, out.read_text()[-3000:]  # unauthorized
    end_container(cluster, pod, 3, out)

    status = wait_for(lambda: (s := kube.status(ns, "refused")).get("phase") == "Failed" and s, 60, "Failed")
    assert condition(status, "Downloaded")["reason"] == "Unauthorized"
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "ModelDownloadFailed"
    assert "check the HF token Secret 'stale-token' (spec.model.hubTokenSecretRef)" in degraded["message"]
    live = cluster.kubectl.json("get", "job", job["metadata"]["name"], "-n", ns)
    assert any(c["type"] == "Failed" and c["status"] == "True" for c in live["status"]["conditions"])
    assert live["status"].get("failed") == 1  # failed at once: no retry for a refused token
    events = kube.core.list_namespaced_event(
        ns, field_selector="involvedObject.kind=InferenceService,involvedObject.name=refused,type=Warning").items
    assert any("stale-token" in e.message for e in events), [e.message for e in events]


def _hub_adapters(hub: HubStandIn, tmp_path: Path) -> dict[str, str]:
    """Two LoRA adapters of the hub's tiny model (random, so each changes the greedy tokens), served by
    the stand-in as org/tiny-sql and org/tiny-chat: repo id -> its commit."""
    from tests.runtime.lora_adapters import make_adapter

    model_dir = tmp_path / "base"
    model_dir.mkdir()
    for name, data in hub.repos[MODEL].files.items():
        (model_dir / name).write_bytes(data)
    out = {}
    for seed, repo in enumerate(("org/tiny-sql", "org/tiny-chat"), start=1):
        adapter = make_adapter(model_dir, tmp_path / repo.split("/")[1], seed=seed, rank=4)
        hub.repos[repo] = StandInRepo({p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()})
        out[repo] = hub.repos[repo].commit
    return out


def _greedy(url: str, adapter: str | None) -> list[int]:
    params: dict[str, Any] = {"max_new_tokens": 8, "details": True, **({"adapter_id": adapter} if adapter else {})}
    code, body = http_json("POST", url + "/generate", {"inputs": "The adapter says", "parameters": params}, 60)
    assert code == 200, body
    return [t["id"] for t in body["details"]["tokens"]]


def test_two_hub_adapters_are_downloaded_with_the_model_served_and_listed(
        cluster: Cluster, operator: OperatorProcess, ns: str, claim: str, cleanup: list[str], processes: list,
        hub: HubStandIn, tmp_path: Path) -> None:
    """spec.model.adapters with prefetch: the download Job (a real `gaudi-serve download --lora-adapters`)
    fetches both adapters and the model into the claim; the runtime serves them offline; the status lists
    them once Ready, and a request through the pod IP picks each by its name."""
    kube, claim_dir = cluster.kube, tmp_path / "claim"
    commits = _hub_adapters(hub, tmp_path)
    _secret(cluster, ns, "hf-token-lora", hub.token or "")
    adapters = [{"name": "sql", "source": "org/tiny-sql", "revision": commits["org/tiny-sql"]},
                {"name": "chat", "source": "org/tiny-chat"}]
    model = {"id": MODEL, "hubTokenSecretRef": {"name": "hf-token-lora"}, "adapters": adapters,
             "cache": {"persistentVolumeClaim": {"claimName": claim}, "prefetch": True}}
    cleanup.append("lora")
    cluster.kubectl.apply(isvc_manifest("lora", ns, shards=1, manual=True, model=model,
                                        env=[{"name": "HF_ENDPOINT", "value": hub.url}], serving=SERVING,
                                        batching={**BATCHING, "warmup": False}))  # warmup is not the point here

    job = wait_for(lambda: [j for j in download_jobs(cluster, ns)
                            if [o["name"] for o in j["metadata"]["ownerReferences"]] == ["lora"]], 60,
                   "the Job of the service with adapters")[0]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--lora-adapters") + 1] == f"sql=org/tiny-sql@{commits['org/tiny-sql']},chat=org/tiny-chat"
    pod = wait_for(lambda: job_pod(cluster, ns, job), 60, "its pod running")
    out = tmp_path / "download.log"
    proc = run_container(cluster, pod, claim_dir, out, processes)
    assert proc.wait(timeout=300) == 0, out.read_text()[-3000:]
    end_container(cluster, pod, 0, out)
    done = [e["repo"] for line in out.read_text().splitlines() if (e := json.loads(line))["event"] == "done"]
    assert done == ["org/tiny-sql", "org/tiny-chat", MODEL]  # the adapters first, the model's line last

    (serving,) = wait_for(lambda: (p := kube.live_pods(ns, "lora")) and p[0]["status"].get("podIP") and p, 60,
                          "the pod running once Downloaded")
    requests = len(hub.requests)
    status, url = serve(cluster, ns, "lora", serving, claim_dir, tmp_path, processes, hold_warmup=False)
    assert len(hub.requests) == requests, hub.requests[requests:]  # offline: the adapters came from the claim
    status = wait_for(lambda: (s := kube.status(ns, "lora")).get("adapters") and s, 30, "status.adapters")
    assert status["adapters"] == adapters

    code, models = http_json("GET", url + "/v1/models")
    assert code == 200 and {"sql", "chat"} <= {m["id"] for m in models["data"]}, models
    base, sql, chat = _greedy(url, None), _greedy(url, "sql"), _greedy(url, "chat")
    assert len({tuple(base), tuple(sql), tuple(chat)}) == 3, (base, sql, chat)
    code, body = http_json("POST", url + "/v1/completions", {"model": "chat", "prompt": "The adapter says",
                                                            "max_tokens": 8, "temperature": 0}, 60)
    assert code == 200 and body["model"] == "chat", body
