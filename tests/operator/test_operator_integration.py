"""The whole operator (Kopf in-process) against the stateful API-server emulator on 127.0.0.1.

The tests play the missing controllers: they create the pods a ReplicaSet
would, and set the conditions a scheduler or kubelet would.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from k8s_emulator import ThreadedEmulator

NS = "default"
ISVC = ("gaudiserve.io/v1alpha1", "InferenceService")
DEPLOY = ("apps/v1", "Deployment")
SVC = ("v1", "Service")
PDB = ("policy/v1", "PodDisruptionBudget")
NETPOL = ("networking.k8s.io/v1", "NetworkPolicy")
POD = ("v1", "Pod")


def wait_for(fn: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (KeyError, TypeError, IndexError, StopIteration):
            last = None
        if last:
            return last
        time.sleep(0.05)  # polling interval, not a wait for an outcome
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedEmulator, _Errors]]:
    import kopf

    with ThreadedEmulator() as emu:
        kubeconfig = tmp_path_factory.mktemp("kube") / "config"
        kubeconfig.write_text(yaml.safe_dump(emu.kubeconfig()))
        old_env = dict(os.environ)
        os.environ["KUBECONFIG"] = str(kubeconfig)
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        os.environ["GAUDI_OPERATOR_RESYNC_SECONDS"] = "2"
        os.environ["GAUDI_OPERATOR_WATCH_TIMEOUT"] = "60"
        import gaudi_operator.handlers  # noqa: F401  (registers the handlers)

        errors = _Errors()
        logging.getLogger().addHandler(errors)
        stop, ready = threading.Event(), threading.Event()

        def run() -> None:
            asyncio.run(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready))

        thread = threading.Thread(target=run, name="operator", daemon=True)
        thread.start()
        try:
            assert ready.wait(30), "operator did not start"
            yield emu, errors
        finally:
            stop.set()
            thread.join(timeout=20)
            logging.getLogger().removeHandler(errors)
            os.environ.clear()
            os.environ.update(old_env)
        assert not emu.emu.errors, emu.emu.errors


def _isvc(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": ISVC[0], "kind": ISVC[1], "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"id": "meta-llama/Llama-3.1-8B-Instruct"}, **spec}}


def _get(emu: ThreadedEmulator, what: tuple[str, str], name: str) -> dict[str, Any] | None:
    return emu.get(what[0], what[1], NS, name)


def _cond(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return next(c for c in ((obj or {}).get("status") or {}).get("conditions", []) if c["type"] == ctype)


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def _make_pods(emu: ThreadedEmulator, dep: dict[str, Any], n: int, status: dict[str, Any],
               prefix: str) -> list[str]:
    """Play the ReplicaSet controller: n pods from the Deployment's template, with `status`."""
    names = []
    for i in range(n):
        tmpl = copy.deepcopy(dep["spec"]["template"])
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**tmpl["metadata"], "name": f"{prefix}-{i}", "namespace": NS},
               "spec": tmpl["spec"], "status": status}
        emu.create(pod)
        names.append(pod["metadata"]["name"])
    return names


RUNNING_READY = {
    "phase": "Running", "podIP": "127.0.0.1",
    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
    "containerStatuses": [{"name": "runtime", "ready": True, "restartCount": 0, "state": {"running": {}}}],
}


def test_create_renders_children(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    obj = emu.create(_isvc("llama", replicas=2, shards=2))
    dep = wait_for(lambda: _get(emu, DEPLOY, "llama"), what="deployment")
    svc = wait_for(lambda: _get(emu, SVC, "llama"), what="service")
    wait_for(lambda: _get(emu, PDB, "llama"), what="pdb")
    c = _container(dep)
    assert dep["spec"]["replicas"] == 2
    assert c["resources"]["limits"]["habana.ai/gaudi"] == "2"
    assert dep["spec"]["template"]["spec"]["hostIPC"] is True
    assert ["--num-shard", "2"] == c["args"][c["args"].index("--num-shard"):][:2]
    owner = dep["metadata"]["ownerReferences"][0]
    assert (owner["uid"], owner["kind"], owner["controller"]) == (obj["metadata"]["uid"], "InferenceService", True)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    st = wait_for(lambda: _get(emu, ISVC, "llama").get("status"), what="status")
    assert st["observedGeneration"] == 1
    assert st["url"] == "http://llama.default.svc.cluster.local"
    assert st["phase"] == "Pending" and st["readySummary"] == "0/2"
    # Kopf's bookkeeping stays out of our status, and no finalizer is needed.
    assert "kopf" not in st
    assert not _get(emu, ISVC, "llama")["metadata"].get("finalizers")
    # Children and pods are watched with a server-side label selector, not cluster-wide unfiltered.
    watches = [(p, q) for m, p, q, _ in emu.emu.requests if m == "GET" and "watch=true" in q]
    for plural in ("pods", "deployments", "services", "poddisruptionbudgets", "networkpolicies", "jobs"):
        qs = [q for p, q in watches if p.endswith("/" + plural)]
        assert qs and all("managed-by%3Dgaudi-serve-operator" in q for q in qs), (plural, qs)
    # Children are written with server-side apply under our field manager.
    applies = [(p, q) for m, p, q, ct in emu.emu.requests
               if m == "PATCH" and ct.startswith("application/apply-patch+yaml")]
    assert {p.rsplit("/", 2)[-2] for p, _ in applies} >= {"deployments", "services", "poddisruptionbudgets"}
    assert all("fieldManager=gaudi-serve-operator" in q and "force=true" in q for _, q in applies)


def test_spec_change_updates_deployment(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    wait_for(lambda: _get(emu, DEPLOY, "llama"), what="deployment")
    gen = _get(emu, DEPLOY, "llama")["metadata"]["generation"]
    emu.patch(*ISVC, NS, "llama", {"spec": {"serving": {"maxInputTokens": 1536}, "replicas": 1}})

    def updated() -> bool:
        args = _container(_get(emu, DEPLOY, "llama"))["args"]
        return args[args.index("--max-input-tokens") + 1] == "1536"
    wait_for(updated, what="deployment args updated")
    dep = _get(emu, DEPLOY, "llama")
    assert dep["metadata"]["generation"] > gen and dep["spec"]["replicas"] == 1
    wait_for(lambda: _get(emu, ISVC, "llama")["status"]["observedGeneration"] == 2, what="observedGeneration 2")
    wait_for(lambda: _get(emu, PDB, "llama") is None, what="pdb removed at 1 replica")


def test_network_policy_follows_the_spec(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    wait_for(lambda: _get(emu, DEPLOY, "llama"), what="deployment")
    emu.patch(*ISVC, NS, "llama", {"spec": {"networkPolicy": {"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}}})
    np = wait_for(lambda: _get(emu, NETPOL, "llama"), what="network policy")
    assert np["spec"]["ingress"][0]["from"][0] == {"podSelector": {"matchLabels": {"app": "web"}}}
    assert np["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    emu.patch(*ISVC, NS, "llama", {"spec": {"networkPolicy": None}})
    wait_for(lambda: _get(emu, NETPOL, "llama") is None, what="network policy removed with the spec's")


def test_child_deleted_by_hand_is_restored(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    old = wait_for(lambda: _get(emu, SVC, "llama"), what="service")
    emu.delete(*SVC, NS, "llama")
    new = wait_for(lambda: _get(emu, SVC, "llama"), what="service restored")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    old_dep = _get(emu, DEPLOY, "llama")
    emu.patch(*DEPLOY, NS, "llama", {"spec": {"replicas": 5}})  # edited by hand: reverted
    wait_for(lambda: _get(emu, DEPLOY, "llama")["spec"]["replicas"] == 1, what="deployment reverted")
    assert _get(emu, DEPLOY, "llama")["spec"]["template"] == old_dep["spec"]["template"]


def test_ready_pods_make_status_ready(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    emu.patch(*ISVC, NS, "llama", {"spec": {"replicas": 2}})
    dep = wait_for(lambda: (d := _get(emu, DEPLOY, "llama")) and d["spec"]["replicas"] == 2 and d,
                   what="deployment at 2 replicas")
    gen = dep["metadata"]["generation"]
    _make_pods(emu, dep, 2, RUNNING_READY, "llama-abc")
    st = wait_for(lambda: (s := _get(emu, ISVC, "llama")["status"])["phase"] == "Ready" and s, what="Ready")
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 2, 2)
    assert st["readySummary"] == "2/2"
    ready = _cond(_get(emu, ISVC, "llama"), "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")
    assert _cond(_get(emu, ISVC, "llama"), "Degraded")["status"] == "False"
    # A status-only change does not roll the pods.
    assert _get(emu, DEPLOY, "llama")["metadata"]["generation"] == gen
    events = wait_for(lambda: [e for e in emu.list("v1", "Event", NS)
                               if e["involvedObject"]["name"] == "llama" and e["reason"] == "Ready"],
                      what="Ready event")
    assert len(events) == 1


def test_unschedulable_pod_degrades(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    emu.create(_isvc("big", shards=8))
    dep = wait_for(lambda: _get(emu, DEPLOY, "big"), what="deployment")
    _make_pods(emu, dep, 1, {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient habana.ai/gaudi."}]}, "big-xyz")
    st = wait_for(lambda: (s := _get(emu, ISVC, "big")["status"])["phase"] == "Degraded" and s, what="Degraded")
    degraded = _cond(_get(emu, ISVC, "big"), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable")
    assert "habana.ai/gaudi" in degraded["message"] and "8 per replica" in degraded["message"]
    assert _cond(_get(emu, ISVC, "big"), "Ready")["reason"] == "Unschedulable"
    assert st["readyReplicas"] == 0
    warnings = wait_for(lambda: [e for e in emu.list("v1", "Event", NS)
                                 if e["involvedObject"]["name"] == "big" and e["type"] == "Warning"],
                        what="Warning event")
    assert warnings[0]["reason"] == "Degraded"


def test_resync_repairs_a_status_edited_by_hand(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    """A status edit changes neither the spec nor a child, so only the periodic resync sees it."""
    emu, _ = cluster
    phase = wait_for(lambda: _get(emu, ISVC, "llama")["status"]["phase"], what="status")
    emu.patch(*ISVC, NS, "llama", {"status": {"phase": "Bogus", "readySummary": "9/9"}}, sub="status")
    st = wait_for(lambda: (s := _get(emu, ISVC, "llama")["status"])["phase"] != "Bogus" and s,
                  what="status repaired by the resync")
    assert st["phase"] == phase and st["readySummary"] != "9/9"


JOB = ("batch/v1", "Job")
CACHED = {"id": "org/tiny", "revision": "main", "hubTokenSecretRef": {"name": "hf-token"},
          "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True}}


def _download_jobs(emu: ThreadedEmulator) -> list[dict[str, Any]]:
    return emu.list(*JOB, NS, "gaudiserve.io/model-download")


def _job_pod(emu: ThreadedEmulator, job: dict[str, Any], name: str, status: dict[str, Any]) -> None:
    """Play the Job controller: a pod from the Job's template, controlled by the Job."""
    tmpl = copy.deepcopy(job["spec"]["template"])
    emu.create({"apiVersion": "v1", "kind": "Pod",
                "metadata": {**tmpl["metadata"], "name": name, "namespace": NS, "ownerReferences": [
                    {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
                     "uid": job["metadata"]["uid"], "controller": True}]},
                "spec": tmpl["spec"], "status": status})


def test_a_prefetched_model_is_downloaded_once_then_served(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    """Two InferenceServices naming the same model, revision and claim share one download Job; their
    Deployments wait for it; progress comes from the Job pod's log; the Job goes with its last owner."""
    emu, _ = cluster
    a = emu.create(_isvc("cached-a", model=CACHED))
    b = emu.create(_isvc("cached-b", model=CACHED, replicas=2))
    job = wait_for(lambda: (j := _download_jobs(emu)) and len(j[0]["metadata"].get("ownerReferences") or []) == 2
                   and j[0], what="one download Job owned by both")
    assert len(_download_jobs(emu)) == 1
    assert {o["uid"] for o in job["metadata"]["ownerReferences"]} == {a["metadata"]["uid"], b["metadata"]["uid"]}
    for name in ("cached-a", "cached-b"):
        st = wait_for(lambda n=name: (s := _get(emu, ISVC, n).get("status")) and s.get("phase") == "Downloading"
                      and s, what=f"{name} Downloading")
        assert st["download"]["job"] == job["metadata"]["name"]
        assert _get(emu, DEPLOY, name) is None  # no replica before the model is in the claim

    pod = f"{job['metadata']['name']}-x1"
    emu.set_log(NS, pod, '{"event": "progress", "done": 2000000, "total": 8000000, "file": "model.safetensors"}\n')
    _job_pod(emu, job, pod, {"phase": "Running", "containerStatuses": [{"name": "download", "state": {"running": {}}}]})
    st = wait_for(lambda: (s := _get(emu, ISVC, "cached-a")["status"])["download"].get("done") and s,
                  what="download progress in the status")
    assert st["download"] == {"job": job["metadata"]["name"], "state": "Downloading", "done": 2000000,
                              "total": 8000000, "file": "model.safetensors"}
    assert st["downloadSummary"] == "2.0/8.0 MB" and _cond(_get(emu, ISVC, "cached-a"), "Downloaded")["status"] == "False"

    emu.set_log(NS, pod, '{"event": "done", "bytes": 8000000, "fetched": 8000000, "seconds": 3.5, "path": "/x"}\n')
    emu.patch("v1", "Pod", NS, pod, {"status": {"phase": "Succeeded", "containerStatuses": [
        {"name": "download", "state": {"terminated": {"exitCode": 0}}}]}}, sub="status")
    emu.patch(*JOB, NS, job["metadata"]["name"], {"status": {"succeeded": 1, "conditions": [
        {"type": "Complete", "status": "True"}]}}, sub="status")
    for name in ("cached-a", "cached-b"):
        dep = wait_for(lambda n=name: _get(emu, DEPLOY, n), what=f"{name}'s Deployment once downloaded")
        c = _container(dep)
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
        assert {"name": "model-cache", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
        assert _cond(wait_for(lambda n=name: (o := _get(emu, ISVC, n)) and o["status"]["phase"] == "Pending" and o,
                              what=f"{name} past Downloading"), "Downloaded")["status"] == "True"
    assert _get(emu, ISVC, "cached-a")["status"]["download"]["seconds"] == 3.5

    emu.delete(*ISVC, NS, "cached-a")  # garbage collection: the Job stays for cached-b
    job = wait_for(lambda: (j := _download_jobs(emu)) and len(j[0]["metadata"]["ownerReferences"]) == 1 and j[0],
                   what="the Job left to cached-b")
    assert job["metadata"]["ownerReferences"][0]["uid"] == b["metadata"]["uid"]
    emu.delete(*ISVC, NS, "cached-b")
    assert _download_jobs(emu) == [] and emu.get("v1", "Pod", NS, pod) is None


def test_a_download_refused_by_the_hub_fails_the_service(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, _ = cluster
    uid = emu.create(_isvc("refused", model={**CACHED, "revision": "v9"}))["metadata"]["uid"]
    job = wait_for(lambda: next(j for j in _download_jobs(emu) if [o["uid"] for o in j["metadata"]["ownerReferences"]]
                                == [uid]), what="the download Job")
    pod = f"{job['metadata']['name']}-x1"
    tail = '{"event": "error", "reason": "unauthorized", "message": "the hub refused the request for org/tiny (401)"}'
    _job_pod(emu, job, pod, {"phase": "Failed", "containerStatuses": [
        {"name": "download", "state": {"terminated": {"exitCode": 3, "message": tail}}}]})
    emu.patch(*JOB, NS, job["metadata"]["name"], {"status": {"failed": 1, "conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]}}, sub="status")
    st = wait_for(lambda: (s := _get(emu, ISVC, "refused")["status"])["phase"] == "Failed" and s, what="Failed")
    assert _cond(_get(emu, ISVC, "refused"), "Downloaded")["reason"] == "Unauthorized"
    assert st["download"]["reason"] == "unauthorized"
    warning = wait_for(lambda: [e for e in emu.list("v1", "Event", NS)
                                if e["involvedObject"]["name"] == "refused" and e["type"] == "Warning"],
                       what="Warning event")[0]
    assert "check the HF token Secret 'hf-token'" in warning["message"] and "(401)" in warning["message"]
    emu.delete(*ISVC, NS, "refused")
    assert _download_jobs(emu) == []


def test_a_dependent_of_a_deleted_owner_is_collected(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    """A pass that read its InferenceService just before the deletion may still create a child (a
    download Job); as in a real cluster, the garbage collector removes it, and a dangling reference
    beside a live owner is dropped."""
    emu, _ = cluster
    live = emu.create(_isvc("owner"))["metadata"]
    ref = {"apiVersion": ISVC[0], "kind": ISVC[1], "name": "gone", "uid": "no-such-uid"}
    emu.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "orphan", "namespace": NS,
                "ownerReferences": [ref]}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    assert emu.get("v1", "Pod", NS, "orphan") is None
    emu.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kept", "namespace": NS, "ownerReferences": [
        ref, {"apiVersion": ISVC[0], "kind": ISVC[1], "name": "owner", "uid": live["uid"]}]},
        "spec": {"containers": [{"name": "c", "image": "x"}]}})
    assert [o["uid"] for o in emu.get("v1", "Pod", NS, "kept")["metadata"]["ownerReferences"]] == [live["uid"]]
    emu.delete(*ISVC, NS, "owner")
    assert emu.get("v1", "Pod", NS, "kept") is None


def test_delete_is_clean(cluster: tuple[ThreadedEmulator, _Errors]) -> None:
    emu, errors = cluster
    wait_for(lambda: _get(emu, DEPLOY, "big"), what="deployment")
    seen = len(emu.emu.requests)
    emu.delete(*ISVC, NS, "big")
    # The emulator's garbage collector removes the children; the operator sees their
    # DELETED events, finds its object gone, and neither restores them nor fails.
    assert _get(emu, DEPLOY, "big") is None and _get(emu, SVC, "big") is None
    wait_for(lambda: any(m == "GET" and p.endswith("/inferenceservices/big")
                         for m, p, *_ in emu.emu.requests[seen:]), what="operator noticed the deletion")
    # One more full round for the remaining object proves the operator is still alive and idle on "big".
    emu.patch(*ISVC, NS, "llama", {"metadata": {"labels": {"touched": "yes"}}})
    emu.patch(*ISVC, NS, "llama", {"spec": {"serving": {"maxWaitingTokens": 21}}})
    wait_for(lambda: "21" in _container(_get(emu, DEPLOY, "llama"))["args"], what="llama still reconciled")
    assert _get(emu, DEPLOY, "big") is None
    assert not [r for r in errors.records if "big" in r.getMessage() or r.name.startswith(("kopf", "gaudi"))], \
        [r.getMessage() for r in errors.records]
