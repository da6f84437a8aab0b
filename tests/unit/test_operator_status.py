"""status.py: children + pods + warmup progress -> status (pure), one row per situation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gaudi_operator.components import render
from gaudi_operator.estimate import expected_warmup_shapes
from gaudi_operator.prefetch_job import Download
from gaudi_operator.render import TEMPLATE_HASH_LABEL, pod_template
from gaudi_operator.spec import InferenceServiceSpec, parse_spec
from gaudi_operator.status import (
    Observed,
    compute_status,
    invalid_spec_status,
    latest_ready_pod,
    status_patch,
)

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def body(replicas: int = 2, shards: int = 2, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    b = {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 3},
         "spec": {"model": {"id": "m"}, "replicas": replicas, "shards": shards, **spec}}
    if status is not None:
        b["status"] = status
    return b


def compute(b: dict[str, Any], spec: InferenceServiceSpec, dep: dict[str, Any] | None, pods: list[dict[str, Any]],
            warmup: dict[str, Any] | None = None, *, now: str, cluster_domain: str = "cluster.local") -> dict[str, Any]:
    """The status of `b` as the reconcile computes it: from the same render it applied."""
    rendered = render(b, spec, cluster_domain=cluster_domain)
    return compute_status(b, spec, rendered, Observed(dep, pods, warmup or {}), now=now)


CURRENT = pod_template(body(), parse_spec(body()["spec"]))["metadata"]["labels"][TEMPLATE_HASH_LABEL]


def pod(name: str, *, phase: str = "Running", ready: bool = False, running: bool = True,
        hash_: str | None = None, waiting: dict[str, Any] | None = None, last: dict[str, Any] | None = None,
        sched: dict[str, Any] | None = None, deleting: bool = False, restarts: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}} if running and not waiting else {"waiting": waiting or {"reason": "ContainerCreating"}}
    cs = {"name": "runtime", "ready": ready, "restartCount": restarts, "state": state}
    if last:
        cs["lastState"] = {"terminated": last}
    conds = [sched or {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}]
    meta: dict[str, Any] = {"name": name, "labels": {TEMPLATE_HASH_LABEL: hash_ or CURRENT}}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "status": {"phase": phase, "podIP": "10.0.0.1", "conditions": conds,
                                         "containerStatuses": [cs]}}


def ready_pod(name: str, **kw: Any) -> dict[str, Any]:
    return pod(name, ready=True, **kw)


UNSCHED = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
           "message": "0/4 nodes are available: 4 Insufficient habana.ai/gaudi. preemption: 0/4 nodes are available"}


def unschedulable(name: str) -> dict[str, Any]:
    return pod(name, phase="Pending", running=False, sched=UNSCHED,
               waiting=None) | {"status": {"phase": "Pending", "conditions": [UNSCHED]}}


def crashing(name: str, message: str = "", reason: str = "Error", code: int = 1) -> dict[str, Any]:
    return pod(name, waiting={"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"},
               last={"exitCode": code, "reason": reason, "message": message}, restarts=6)


def cond(st: dict[str, Any], ctype: str) -> tuple[str, str]:
    c = next(c for c in st["conditions"] if c["type"] == ctype)
    return c["status"], c["reason"]


def msg(st: dict[str, Any], ctype: str) -> str:
    return next(c for c in st["conditions"] if c["type"] == ctype)["message"]


# (id, replicas, pods, warmup, phase, Ready, Progressing, Degraded, message fragment in Degraded/Ready)
CASES = [
    ("no pods yet", 2, [], {}, "Pending", ("False", "Pending"), ("True", "Scaling"), ("False", "AsExpected"), None),
    ("containers creating", 2, [pod("a", running=False), pod("b", running=False)], {},
     "Pending", ("False", "Pending"), ("True", "Pending"), ("False", "AsExpected"), None),
    ("loading weights", 2, [pod("a"), pod("b")], {}, "Loading", ("False", "Loading"), ("True", "Loading"),
     ("False", "AsExpected"), None),
    ("warming up", 2, [pod("a"), pod("b")], {"a": {"done": 12, "total": 40}, "b": {"done": 30, "total": 40}},
     "WarmingUp", ("False", "WarmingUp"), ("True", "WarmingUp"), ("False", "AsExpected"), "warmup 12/40 shapes"),
    ("one ready one warming", 2, [ready_pod("a"), pod("b")], {"b": {"done": 5, "total": 40, "phase": "decode"}},
     "WarmingUp", ("False", "WarmingUp"), ("True", "WarmingUp"), ("False", "AsExpected"), "1/2 replicas ready"),
    ("all ready", 2, [ready_pod("a"), ready_pod("b")], {}, "Ready", ("True", "AllReplicasReady"),
     ("False", "RolloutComplete"), ("False", "AsExpected"), "2/2 replicas ready"),
    ("unschedulable", 2, [unschedulable("a"), unschedulable("b")], {}, "Degraded", ("False", "Unschedulable"),
     ("False", "Unschedulable"), ("True", "Unschedulable"), "not enough habana.ai/gaudi on any node (2 per replica)"),
    ("image pull backoff", 2, [pod("a", waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""})],
     {}, "Failed", ("False", "ImagePullBackOff"), ("True", "Scaling"), ("True", "ImagePullBackOff"), "Back-off pulling image"),
    ("err image pull", 2, [pod("a", waiting={"reason": "ErrImagePull", "message": "manifest unknown"})], {},
     "Failed", ("False", "ErrImagePull"), ("True", "Scaling"), ("True", "ErrImagePull"), "manifest unknown"),
    ("crash loop", 2, [crashing("a", "RuntimeError: shard 1 exited with code -9\nlauncher: shard 1 died")], {},
     "Failed", ("False", "CrashLoopBackOff"), ("True", "Scaling"), ("True", "CrashLoopBackOff"),
     "launcher: shard 1 died"),
    ("crash loop without message", 2, [crashing("a", "", code=137)], {}, "Failed", ("False", "CrashLoopBackOff"),
     ("True", "Scaling"), ("True", "CrashLoopBackOff"), "exit code 137"),
    ("oom killed", 2, [crashing("a", "", reason="OOMKilled", code=137)], {}, "Failed", ("False", "OOMKilled"),
     ("True", "Scaling"), ("True", "OOMKilled"), "memory limit"),
    ("warmup out of device memory", 2,
     [crashing("a", "warmup: prefill bucket bs=8 seq=2048: RuntimeError: [Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM "
                    "Allocation failed: out of memory")], {},
     "Failed", ("False", "WarmupOutOfMemory"), ("True", "Scaling"), ("True", "WarmupOutOfMemory"), "during warmup"),
    ("model download failed", 2,
     [crashing("a", "huggingface_hub.errors.RepositoryNotFoundError: 401 Client Error. Repository Not Found for url")],
     {}, "Failed", ("False", "ModelDownloadFailed"), ("True", "Scaling"), ("True", "ModelDownloadFailed"),
     "hubTokenSecretRef"),
    ("secret missing", 2, [pod("a", waiting={"reason": "CreateContainerConfigError",
                                             "message": 'secret "hf" not found'})], {},
     "Failed", ("False", "CreateContainerConfigError"), ("True", "Scaling"), ("True", "CreateContainerConfigError"),
     'secret "hf" not found'),
    ("one ready one crashing", 2, [ready_pod("a"), crashing("b", "boom")], {}, "Degraded",
     ("False", "CrashLoopBackOff"), ("False", "CrashLoopBackOff"), ("True", "CrashLoopBackOff"), "boom"),
    ("rolling out", 2, [ready_pod("a", hash_="old"), pod("b")], {"b": {"done": 1, "total": 4}}, "WarmingUp",
     ("False", "WarmingUp"), ("True", "RollingOut"), ("False", "AsExpected"), None),
    ("ready but old template", 1, [ready_pod("a", hash_="old")], {}, "Ready", ("True", "AllReplicasReady"),
     ("True", "RollingOut"), ("False", "AsExpected"), None),
    ("terminating pods ignored", 1, [ready_pod("a"), ready_pod("b", deleting=True)], {}, "Ready",
     ("True", "AllReplicasReady"), ("False", "RolloutComplete"), ("False", "AsExpected"), None),
    ("scaled to zero", 0, [], {}, "Pending", ("False", "ScaledToZero"), ("False", "ScaledToZero"),
     ("False", "AsExpected"), None),
    # The phase agrees with the Ready condition: nothing is wanted, so a pod not yet removed is not "WarmingUp".
    ("scaled to zero, a pod not yet removed", 0, [pod("a")], {"a": {"done": 1, "total": 4}}, "Pending",
     ("False", "ScaledToZero"), ("True", "Scaling"), ("False", "AsExpected"), None),
    ("evicted pod", 1, [pod("a", running=False) | {"status": {"phase": "Failed", "reason": "Evicted",
                                                             "message": "low on ephemeral-storage"}}], {},
     "Failed", ("False", "PodFailed"), ("False", "PodFailed"), ("True", "PodFailed"), "Evicted"),
]


@pytest.mark.parametrize("name,replicas,pods,warmup,phase,ready,progressing,degraded,fragment", CASES,
                         ids=[c[0] for c in CASES])
def test_status_table(name: str, replicas: int, pods: list[dict[str, Any]], warmup: dict[str, Any], phase: str,
                      ready: tuple[str, str], progressing: tuple[str, str], degraded: tuple[str, str],
                      fragment: str | None) -> None:
    b = body(replicas=replicas)
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}
    st = compute(b, parse_spec(b["spec"]), dep, pods, warmup, now=NOW)
    assert (st["phase"], cond(st, "Ready"), cond(st, "Progressing"), cond(st, "Degraded")) == \
        (phase, ready, progressing, degraded)
    if fragment:
        assert fragment in msg(st, "Degraded") or fragment in msg(st, "Ready"), st["conditions"]
    assert st["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_counts_url_selector_and_summaries() -> None:
    b = body(replicas=3)
    pods = [ready_pod("a"), ready_pod("b", hash_="old"), pod("c"), ready_pod("d", deleting=True)]
    st = compute(b, parse_spec(b["spec"]), None, pods, {"c": {"done": 7, "total": 9, "phase": "prefill"}},
                 now=NOW)
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (3, 2, 2)
    assert st["readySummary"] == "2/3" and st["warmupSummary"] == "7/9"
    assert st["warmup"] == {"done": 7, "total": 9, "phase": "prefill", "pod": "c"}
    assert st["url"] == "http://llama.ml.svc.cluster.local"
    assert st["selector"] == "app.kubernetes.io/name=gaudi-serve,gaudiserve.io/inference-service=llama"
    b2 = body(service={"port": 8000})
    assert compute(b2, parse_spec(b2["spec"]), None, [], now=NOW, cluster_domain="k.local")["url"] == \
        "http://llama.ml.svc.k.local:8000"


def test_least_advanced_pod_is_reported() -> None:
    b = body(replicas=3)
    warm = {"a": {"done": 30, "total": 40}, "b": {"done": 2, "total": 10}, "c": {"done": 9, "total": 40}}
    st = compute(b, parse_spec(b["spec"]), None, [pod("a"), pod("b"), pod("c")], warm, now=NOW)
    assert st["warmup"]["pod"] == "b" and st["warmupSummary"] == "2/10"


def test_warmup_of_unknown_or_ready_pods_is_ignored() -> None:
    b = body(replicas=1)
    st = compute(b, parse_spec(b["spec"]), None, [ready_pod("a")], {"a": {"done": 1, "total": 2},
                                                                     "ghost": {"done": 0, "total": 5}}, now=NOW)
    assert "warmup" not in st and st["phase"] == "Ready"


def test_unobserved_deployment_generation_is_a_rollout() -> None:
    b = body(replicas=1)
    dep = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3}}
    st = compute(b, parse_spec(b["spec"]), dep, [ready_pod("a")], now=NOW)
    assert cond(st, "Progressing") == ("True", "RollingOut")


def test_progress_deadline_exceeded() -> None:
    b = body(replicas=1)
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "llama-5d9" has timed out progressing.'}]}}
    st = compute(b, parse_spec(b["spec"]), dep, [pod("a", running=False)], now=NOW)
    assert st["phase"] == "Failed"
    assert cond(st, "Progressing") == ("False", "ProgressDeadlineExceeded")
    assert cond(st, "Degraded") == ("True", "ProgressDeadlineExceeded")


def test_a_long_warmup_outlives_the_deployments_deadline() -> None:
    """The Deployment controller gives up on a rollout whose pod takes long to become ready; a pod that
    is still loading or warming up is judged by its own progress (its liveness probe), not by that."""
    b = body(replicas=1)
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "llama-5d9" has timed out progressing.'}]}}
    st = compute(b, parse_spec(b["spec"]), dep, [pod("a")], now=NOW, warmup={"a": {"done": 300, "total": 2000}})
    assert st["phase"] == "WarmingUp" and cond(st, "Degraded") == ("False", "AsExpected")
    assert cond(st, "Progressing") == ("True", "WarmingUp")
    st = compute(b, parse_spec(b["spec"]), dep, [pod("a")], now=NOW)
    expected = expected_warmup_shapes(parse_spec(b["spec"]))  # the runtime's count (test_operator_estimate.py)
    assert st["phase"] == "Loading" and f"loading, then a warmup of {expected} shapes" in msg(st, "Ready")


STALLED = ("2026-11-27 07:40:02,113 ERROR launcher gaudi_runtime.launcher: start stalled: no progress for 601s "
           "while warming up (decode shapes), 80/298 (--warmup-stall-seconds 600); exiting so that the pod restarts")


@pytest.mark.parametrize("last", [
    {"exitCode": 75, "reason": "Error", "message": STALLED[STALLED.index("start stalled"):]},  # the message file
    {"exitCode": 75, "reason": "Error", "message": "INFO warmup: 298 shapes\n" + STALLED},  # the log's tail
    {"exitCode": 143, "reason": "Error", "message": STALLED},  # the liveness probe got there first
])
def test_a_restart_after_a_stalled_start_is_reported_until_the_pod_serves(last: dict[str, Any]) -> None:
    b = body(replicas=1)
    spec = parse_spec(b["spec"])
    warming_again = pod("a", last=last, restarts=1)
    st = compute(b, spec, None, [warming_again], now=NOW, warmup={"a": {"done": 3, "total": 298}})
    assert cond(st, "Degraded") == ("True", "StartupStalled") and st["phase"] == "Degraded"
    assert cond(st, "Ready") == ("False", "StartupStalled")
    assert ("pod a: restarted because its start stalled (restarts: 1): start stalled: no progress for 601s while "
            "warming up (decode shapes), 80/298") in msg(st, "Degraded")
    assert st["warmup"]["done"] == 3  # and how far the new attempt got
    backing_off = pod("a", waiting={"reason": "CrashLoopBackOff", "message": "back-off"}, last=last, restarts=4)
    st = compute(b, spec, None, [backing_off], now=NOW)
    assert cond(st, "Degraded") == ("True", "StartupStalled") and "(restarts: 4)" in msg(st, "Degraded")
    st = compute(b, spec, None, [ready_pod("a", last=last, restarts=1)], now=NOW)
    assert st["phase"] == "Ready" and cond(st, "Degraded") == ("False", "AsExpected")


def test_another_exit_is_not_a_stall() -> None:
    b = body(replicas=1)
    st = compute(b, parse_spec(b["spec"]), None, [crashing("a", "ValueError: bad config", code=2)], now=NOW)
    assert cond(st, "Degraded") == ("True", "CrashLoopBackOff")


def test_invalid_spec_fails_with_reason() -> None:
    st = invalid_spec_status(body(), "spec.shards must be one of 1, 2, 4 or 8", now=NOW)
    assert st["phase"] == "Failed"
    assert cond(st, "Ready") == ("False", "InvalidSpec") and cond(st, "Degraded") == ("True", "InvalidSpec")
    assert "spec.shards" in msg(st, "Ready")


def test_most_telling_problem_wins() -> None:
    b = body(replicas=2)
    st = compute(b, parse_spec(b["spec"]), None, [unschedulable("a"), crashing("b", "boom")], now=NOW)
    assert cond(st, "Degraded") == ("True", "CrashLoopBackOff")
    assert "2 problems" in msg(st, "Ready")


def test_same_observation_same_status_and_no_patch() -> None:
    b = body(replicas=2)
    spec = parse_spec(b["spec"])
    pods = [ready_pod("a"), pod("b")]
    first = compute(b, spec, None, pods, {"b": {"done": 1, "total": 4}}, now=NOW)
    again = compute(body(replicas=2, status=first), spec, None, pods, {"b": {"done": 1, "total": 4}}, now=LATER)
    assert again == first  # lastTransitionTime kept: nothing flipped
    assert status_patch(first, again) == {}


def test_transition_times_move_only_on_flips() -> None:
    b = body(replicas=1)
    spec = parse_spec(b["spec"])
    warming = compute(b, spec, None, [pod("a")], {"a": {"done": 1, "total": 4}}, now=NOW)
    ready = compute(body(replicas=1, status=warming), spec, None, [ready_pod("a")], now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}
    patch = status_patch(warming, ready)
    assert patch["phase"] == "Ready"
    assert patch["warmup"] is None and patch["warmupSummary"] is None  # merge patch removes them
    assert "url" not in patch and "selector" not in patch


def test_status_patch_leaves_foreign_keys_alone() -> None:
    assert status_patch({"somethingElse": 1, "phase": "Pending"}, {"phase": "Ready"}) == {"phase": "Ready"}


def test_pure_inputs_not_mutated() -> None:
    b = body(replicas=2, status={"conditions": []})
    pods = [ready_pod("a"), crashing("b", "x")]
    snapshot = copy.deepcopy((b, pods))
    compute(b, parse_spec(b["spec"]), None, pods, {}, now=NOW)
    assert (b, pods) == snapshot


# ---- the model-cache download (spec.model.cache.prefetch) --------------------------------------

PREFETCH = {"id": "org/m", "hubTokenSecretRef": {"name": "hf-token"},
            "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True}}
PREFETCHED = pod_template(body(model=PREFETCH), parse_spec(body(model=PREFETCH)["spec"]))["metadata"]["labels"][
    TEMPLATE_HASH_LABEL]
JOB = "gaudi-serve-download-abc"
STUCK = {"metadata": {"name": f"{JOB}-x"}, "status": {"phase": "Pending", "containerStatuses": [{
    "name": "download", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                              "message": 'secret "hf-token" not found'}}}]}}


def downloading(done: int, total: int, **kw: Any) -> Download:
    return Download(JOB, "Downloading", done, total, "model-00002-of-00004.safetensors", **kw)


def cur(name: str, **kw: Any) -> dict[str, Any]:
    return pod(name, hash_=PREFETCHED, **kw)


# (id, download, pods, phase, Downloaded, Ready, Progressing, Degraded, message fragment in a condition)
DOWNLOAD_CASES = [
    ("waiting for the job's pod", Download(JOB, "Pending"), [], "Downloading", ("False", "Downloading"),
     ("False", "Downloading"), ("True", "Downloading"), ("False", "AsExpected"), "waiting for its pod to run"),
    ("downloading", downloading(120_000_000, 300_000_000), [], "Downloading", ("False", "Downloading"),
     ("False", "Downloading"), ("True", "Downloading"), ("False", "AsExpected"), "download 120.0/300.0 MB"),
    ("an attempt failed, retrying", downloading(5, 10, attempts=1, reason="unreachable", message="timed out"), [],
     "Downloading", ("False", "Downloading"), ("False", "Downloading"), ("True", "Downloading"),
     ("False", "AsExpected"), "attempt 1 failed (unreachable: timed out), retrying"),
    ("refused by the hub", Download(JOB, "Failed", reason="unauthorized", message="401 for org/m", attempts=1), [],
     "Failed", ("False", "Unauthorized"), ("False", "ModelDownloadFailed"), ("False", "ModelDownloadFailed"),
     ("True", "ModelDownloadFailed"), "check the HF token Secret 'hf-token' (spec.model.hubTokenSecretRef)"),
    ("claim full", Download(JOB, "Failed", reason="no_space", message="needs 16 GB more"), [], "Failed",
     ("False", "NoSpace"), ("False", "ModelDownloadFailed"), ("False", "ModelDownloadFailed"),
     ("True", "ModelDownloadFailed"), "no space left on the claim"),
    ("the job's pod cannot start", Download(JOB, "Pending", pod=STUCK), [], "Failed", ("False", "Downloading"),
     ("False", "CreateContainerConfigError"), ("False", "CreateContainerConfigError"),
     ("True", "CreateContainerConfigError"), f'download pod {JOB}-x: secret "hf-token" not found'),
    ("downloaded, loading", Download(JOB, "Complete", 300_000_000, 300_000_000, seconds=12.5), [cur("a"), cur("b")],
     "Loading", ("True", "Downloaded"), ("False", "Loading"), ("True", "Loading"), ("False", "AsExpected"),
     "300.0 MB in 12.5s"),
    ("downloaded, ready", Download(JOB, "Complete"), [cur("a", ready=True), cur("b", ready=True)], "Ready",
     ("True", "Downloaded"), ("True", "AllReplicasReady"), ("False", "RolloutComplete"), ("False", "AsExpected"),
     None),
    # A new revision downloads while the pods of the earlier one keep serving.
    ("a new revision downloading", downloading(1, 10), [ready_pod("a"), ready_pod("b")], "Downloading",
     ("False", "Downloading"), ("True", "AllReplicasReady"), ("True", "Downloading"), ("False", "AsExpected"), None),
]


@pytest.mark.parametrize("name,dl,pods,phase,downloaded,ready,progressing,degraded,fragment", DOWNLOAD_CASES,
                         ids=[c[0] for c in DOWNLOAD_CASES])
def test_download_table(name: str, dl: Download, pods: list[dict[str, Any]], phase: str, downloaded: tuple[str, str],
                        ready: tuple[str, str], progressing: tuple[str, str], degraded: tuple[str, str],
                        fragment: str | None) -> None:
    b = body(model=PREFETCH)
    spec = parse_spec(b["spec"])
    st = compute_status(b, spec, render(b, spec, downloaded=dl.state == "Complete"), Observed(None, pods, download=dl),
                        now=NOW)
    assert (st["phase"], cond(st, "Downloaded"), cond(st, "Ready"), cond(st, "Progressing"), cond(st, "Degraded")) \
        == (phase, downloaded, ready, progressing, degraded)
    if fragment:
        assert any(fragment in c["message"] for c in st["conditions"]), st["conditions"]
    assert st["download"] == dl.as_status() and st["download"]["job"] == JOB
    assert st["downloadSummary"]


def test_an_invalid_spec_keeps_naming_the_download_job() -> None:
    """So that the pass after the fix can leave a Job the service no longer needs."""
    previous = {"download": {"job": JOB, "state": "Complete", "total": 10}}
    st = invalid_spec_status(body(status=previous), "spec.shards must be one of 1, 2, 4 or 8", now=NOW)
    assert st["download"] == previous["download"] and st["phase"] == "Failed"


def test_no_download_no_downloaded_condition() -> None:
    st = compute(body(), parse_spec(body()["spec"]), None, [], now=NOW)
    assert "Downloaded" not in {c["type"] for c in st["conditions"]} and "download" not in st


def test_the_latest_pods_start_up_is_reported_and_kept() -> None:
    b = body(replicas=2)
    spec = parse_spec(b["spec"])
    a, c = ready_pod("a"), ready_pod("c")
    a["metadata"]["creationTimestamp"], c["metadata"]["creationTimestamp"] = NOW, LATER
    assert latest_ready_pod([a, c, pod("d"), ready_pod("e", hash_="old")], CURRENT) is c
    health = {"status": "ok", "pod": "c", "startup_seconds": {"download": 0.12, "load": 3.4, "warmup": 17.25},
              "warmup_from_cache": True}
    first = compute_status(b, spec, render(b, spec), Observed(None, [a, c], startup=health), now=NOW)
    assert first["startup"] == {"pod": "c", "downloadSeconds": 0.12, "loadSeconds": 3.4, "warmupSeconds": 17.25,
                                "warmupFromCache": True}
    # Read once per pod: later passes keep it.
    again = compute_status(body(replicas=2, status=first), spec, render(b, spec), Observed(None, [a, c]), now=LATER)
    assert again["startup"] == first["startup"]
    no_cache = {"pod": "c", "startup_seconds": {"download": None, "load": 1.0, "warmup": None},
                "warmup_from_cache": None}
    assert compute_status(b, spec, render(b, spec), Observed(None, [c], startup=no_cache), now=NOW)["startup"] == \
        {"pod": "c", "loadSeconds": 1.0}


def test_warmup_says_whether_it_comes_from_the_recipe_cache() -> None:
    b = body(replicas=1)
    st = compute(b, parse_spec(b["spec"]), None, [pod("a")], {"a": {"done": 1, "total": 4, "from_cache": True}},
                 now=NOW)
    assert st["warmup"]["fromCache"] is True
    st = compute(b, parse_spec(b["spec"]), None, [pod("a")], {"a": {"done": 1, "total": 4, "from_cache": None}},
                 now=NOW)
    assert "fromCache" not in st["warmup"]
