"""Scenario 6c: the probes follow the start's progress. The pod's container is a real `gaudi-serve launch`
(tiny model, CPU) on the pod's IP, with the command line the operator rendered, and the kubelet's
prober and restarts are played from the rendered pod's probes (tests/e2e/kubelet_prober.py: kwok runs
none).

* A slow warmup: the shard is throttled (stopped 2.5 s, then run 10 ms, over and over, as a CPU-starved
  process is) for longer than anything the rendered pod allows without progress: the startupProbe's budget, the
  livenessProbe's failures, the stall window. It still makes a step every few seconds, so it reaches
  Ready without a restart.
* A stuck warmup: the shard stops for good mid-warmup (SIGSTOP, as a hung collective leaves it). After
  spec.probes.warmupStallSeconds the runtime gives up with exit code 75 and says why; the pod restarts,
  the InferenceService shows `StartupStalled` with the runtime's reason while the new container warms
  up, and the restarted container reaches Ready.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.control_plane import clean_env
from tests.e2e.harness import OperatorProcess, condition, http_json, isvc_manifest, wait_for
from tests.e2e.kubelet_prober import ProbingKubelet
from tests.e2e.test_6_real_runtime import container_command
from tests.runtime.launched import hold_mid_warmup, shard_pids, signal_all

pytestmark = pytest.mark.simulated  # kwok nodes and pods, the local operator

STALL_S = 20  # spec.probes.warmupStallSeconds: above a loaded machine's torch import, a single step here
PROBES = {"warmupStallSeconds": STALL_S, "startup": {"periodSeconds": 1, "budgetSeconds": 30},
          "liveness": {"periodSeconds": 1, "failureThreshold": 3}, "readiness": {"periodSeconds": 1}}
# Hundreds of warmup shapes on CPU, as in scenario 6.
SERVING = {"maxInputTokens": 256, "maxTotalTokens": 512, "maxBatchSize": 32}
BATCHING = {"padSequenceToMultipleOf": 16, "batchBucketSize": 2, "prefillBatchBucketSize": 2, "hpuGraphs": False}


def start_pod(cluster: Cluster, ns: str, name: str, tmp_path: Path, cleanup: list[str]) -> ProbingKubelet:
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny-llama", "llama")
    cleanup.append(name)
    cluster.kubectl.apply(isvc_manifest(name, ns, shards=1, manual=True, probes=PROBES, serving=SERVING,
                                        batching=BATCHING))
    (pod,) = wait_for(lambda: (p := cluster.kube.live_pods(ns, name)) and p[0]["status"].get("podIP") and p, 60,
                      "the pod to run with an IP")

    def command(workdir: Path) -> tuple[list[str], dict[str, str]]:
        cmd, env = container_command(pod, model_dir, workdir)
        return cmd, clean_env(**env)
    return ProbingKubelet(cluster.kube, pod, command, tmp_path).start()


def warming(kubelet: ProbingKubelet, url: str) -> dict | None:
    """The warmup's progress once it has one, from the process (the runtime's own /health)."""
    if kubelet.proc.poll() is not None and not kubelet.restarts:
        raise AssertionError(f"the runtime exited with {kubelet.proc.returncode}")
    try:
        code, body = http_json("GET", url + "/health", timeout=2)
    except OSError:
        return None
    warming_up = code == 503 and body.get("status") == "warming_up"
    return body["warmup"] if (warming_up or code == 200) and body["warmup"]["done"] else None


def allowances(pod: dict) -> dict[str, float]:
    """Every length of time without success or progress that the rendered pod tolerates."""
    c = pod["spec"]["containers"][0]
    probe = {k: c[k]["periodSeconds"] * c[k]["failureThreshold"] for k in ("startupProbe", "livenessProbe")}
    args = c["args"]
    return {**probe, "warmupStallSeconds": float(args[args.index("--warmup-stall-seconds") + 1])}


def test_a_warmup_longer_than_any_allowance_reaches_ready_without_a_restart(
        cluster: Cluster, operator: OperatorProcess, ns: str, cleanup: list[str], processes: list,
        tmp_path: Path) -> None:
    kube = cluster.kube
    kubelet = start_pod(cluster, ns, "slow", tmp_path, cleanup)
    url = f"http://{kubelet.pod['status']['podIP']}:8080"
    limits = allowances(kubelet.pod)
    assert limits == {"startupProbe": 30, "livenessProbe": 3, "warmupStallSeconds": STALL_S}
    try:
        _, first = hold_mid_warmup(kubelet.proc, url)
        began = time.monotonic()
        throttle_until = began + 1.5 * max(limits.values())
        done = threading.Event()

        def throttle() -> None:
            """A starved shard, as slow on a fast machine as on a loaded one: stopped 2.5 s, then run for
            10 ms, over and over. Its whole warmup takes about a second of CPU here: it moves a few shapes
            a period, and is far from done when the stretch ends."""
            while not done.wait(2.5) and time.monotonic() < throttle_until:
                pids = shard_pids(kubelet.proc.pid)
                signal_all(pids, signal.SIGCONT)
                done.wait(0.01)  # the shard's run
                signal_all(pids, signal.SIGSTOP)
        throttler = threading.Thread(target=throttle, daemon=True)
        throttler.start()
        try:
            st = wait_for(lambda: (s := kube.status(ns, "slow")).get("phase") == "WarmingUp" and s, 60,
                          "status WarmingUp")
            assert st["warmup"]["total"] == first["total"]
            wait_for(lambda: time.monotonic() >= throttle_until, 120, "the throttled stretch to pass",
                     interval=0.5)
            mid = warming(kubelet, url)
            assert mid is not None and first["done"] < mid["done"] < mid["total"], (first, mid)  # slow, not stuck
        finally:
            done.set()
            throttler.join(10)
            signal_all(shard_pids(kubelet.proc.pid), signal.SIGCONT)
        status = wait_for(lambda: (s := kube.status(ns, "slow")).get("phase") == "Ready" and s, 240, "slow Ready")
        took = time.monotonic() - began
    finally:
        kubelet.stop()
        processes.extend(kubelet.started)
    assert took > max(limits.values()), (took, limits)
    assert kubelet.restarts == 0 and kubelet.kills == [], kubelet.kills
    (pod,) = kube.live_pods(ns, "slow")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert condition(status, "Degraded")["status"] == "False"


def test_a_stalled_warmup_is_restarted_with_the_reason_in_status(
        cluster: Cluster, operator: OperatorProcess, ns: str, cleanup: list[str], processes: list,
        tmp_path: Path) -> None:
    kube = cluster.kube
    kubelet = start_pod(cluster, ns, "stuck", tmp_path, cleanup)
    url = f"http://{kubelet.pod['status']['podIP']}:8080"
    try:
        _, first = hold_mid_warmup(kubelet.proc, url)  # the shard hangs there: no shape finishes any more
        stuck_at = time.monotonic()
        wait_for(lambda: kubelet.restarts == 1, STALL_S + 90, "the stalled container to be restarted")
        assert time.monotonic() - stuck_at >= STALL_S
        (pod,) = kube.live_pods(ns, "stuck")
        last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
        assert last["exitCode"] == 75, last
        assert last["message"].startswith("start stalled: no progress for ") and "while warming up" in last["message"]

        def stalled_in_status() -> dict | None:
            st = kube.status(ns, "stuck")
            return st if condition(st, "Degraded").get("reason") == "StartupStalled" else None
        status = wait_for(stalled_in_status, 60, "status StartupStalled")
        assert status["phase"] == "Degraded"
        message = condition(status, "Degraded")["message"]
        assert message.startswith(f"pod {pod['metadata']['name']}: restarted because its start stalled (restarts: 1): "
                                  "start stalled: no progress for "), message
        assert f"--warmup-stall-seconds {STALL_S}" in message and condition(status, "Ready")["reason"] == "StartupStalled"
        assert first["total"] > 0
        # The second attempt is not held: it warms up and serves, and the stall is history.
        status = wait_for(lambda: (s := kube.status(ns, "stuck")).get("phase") == "Ready" and s, 300, "stuck Ready")
        assert condition(status, "Degraded")["status"] == "False"
    finally:
        kubelet.stop()
        processes.extend(kubelet.started)
