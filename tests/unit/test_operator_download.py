"""prefetch_job.py: the model-cache download Job (one per model, revision and claim) and what it reports (pure)."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import kubernetes_validate
import pytest

from gaudi_operator import prefetch_job
from gaudi_operator.spec import parse_spec
from gaudi_runtime import download_events

K8S_VERSION = "1.37.0"
MODEL = {"id": "meta-llama/Llama-3.1-8B-Instruct", "revision": "v2", "hubTokenSecretRef": {"name": "hf-token"},
         "cache": {"persistentVolumeClaim": {"claimName": "model-cache"}, "prefetch": True}}


def body(name: str = "llama", namespace: str = "ml", uid: str = "uid-1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"model": MODEL, **spec}}


def job(**spec: Any) -> dict[str, Any]:
    b = body(**spec)
    rendered = prefetch_job.render_job(b, parse_spec(b["spec"]))
    assert rendered is not None
    return rendered


def test_one_job_per_model_revision_and_claim() -> None:
    """The Job's name is what two InferenceServices share: the same model, revision and claim (in one
    namespace, as the claim is) give one name, whatever else differs."""
    def name(model: dict[str, Any], namespace: str = "ml", **spec: Any) -> str:
        b = body(namespace=namespace, model=model, **spec)
        return prefetch_job.render_job(b, parse_spec(b["spec"]))["metadata"]["name"]
    base = name(MODEL)
    assert base.startswith("gaudi-serve-download-") and len(base) <= 63
    assert name({**MODEL, "hubTokenSecretRef": {"name": "other"}}, image="registry/runtime:2", replicas=3) == base
    assert name({**MODEL, "revision": "v3"}) != base
    assert name({**MODEL, "id": "meta-llama/Llama-3.1-70B-Instruct"}) != base
    assert name({**MODEL, "cache": {"persistentVolumeClaim": {"claimName": "other"}, "prefetch": True}}) != base
    assert name(MODEL, namespace="prod") != base
    no_prefetch = body(model={**MODEL, "cache": {"persistentVolumeClaim": {"claimName": "model-cache"}}})
    assert prefetch_job.render_job(no_prefetch, parse_spec(no_prefetch["spec"])) is None


def test_the_job_downloads_into_the_claim_with_the_hub_settings() -> None:
    j = job(env=[{"name": "HF_ENDPOINT", "value": "https://hub.internal"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
                 {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
            image="registry/runtime:2", imagePullSecrets=[{"name": "regcred"}],
            tolerations=[{"key": "habana.ai/gaudi", "operator": "Exists"}])
    pod = j["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry/runtime:2" and c["command"] == ["gaudi-serve"]
    assert c["args"] == ["download", "--model-id", MODEL["id"], "--revision", "v2",
                         "--huggingface-hub-cache", "/data/hub", "--progress", "json"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert env["HF_ENDPOINT"] == "https://hub.internal" and env["HTTPS_PROXY"] == "http://proxy:3128"
    assert "HF_HUB_OFFLINE" not in env  # the serving pods' offline mode would stop the download
    assert c["volumeMounts"] == [{"name": "model-cache", "mountPath": "/data"}]  # read-write
    assert pod["volumes"] == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}]
    assert "habana.ai/gaudi" not in json.dumps(c["resources"])  # no card for a download
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["tolerations"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_failures_no_retry_heals_fail_the_job_at_once() -> None:
    """The podFailurePolicy reads the runtime's exit codes: unauthorized, not_found, no_space and
    not_cached fail the Job; corrupt, unreachable, interrupted and other errors are retried."""
    assert prefetch_job.EXIT_REASONS == {code: reason for reason, code in download_events.EXIT_CODES.items()}
    rules = job()["spec"]["podFailurePolicy"]["rules"]
    fail = rules[0]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["containerName"] == "download"
    codes = download_events.EXIT_CODES
    assert fail["onExitCodes"] == {"containerName": "download", "operator": "In",
                                   "values": sorted(codes[r] for r in ("unauthorized", "not_found", "no_space",
                                                                      "not_cached"))}
    assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert job()["spec"]["backoffLimit"] == prefetch_job.BACKOFF_LIMIT


def test_every_owner_owns_it_none_controls_it() -> None:
    j = job()
    assert prefetch_job.owners(j) == [{"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
                                   "name": "llama", "uid": "uid-1", "controller": False,
                                   "blockOwnerDeletion": False}]
    labels = j["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "gaudi-serve-operator"
    assert "gaudiserve.io/inference-service" not in labels  # not one service's: its pods are not serving pods
    assert j["spec"]["template"]["metadata"]["labels"] == labels


def test_the_job_validates_against_kubernetes_openapi() -> None:
    kubernetes_validate.validate(copy.deepcopy(job(env=[{"name": "HF_ENDPOINT", "value": "http://h"}],
                                                   serviceAccountName="dl", nodeSelector={"a": "b"})),
                                 K8S_VERSION, strict=True)


# ---- what it reports --------------------------------------------------------------------------

def lines(*events: tuple[str, Any]) -> str:
    """Output of `gaudi-serve download --progress json`, written by the runtime's own reporter."""
    out = io.StringIO()
    reporter = download_events.JsonLines(out)
    for kind, args in events:
        getattr(reporter, kind)(*args)
    return out.getvalue()


def live_job(conditions: list[dict[str, Any]] | None = None, failed: int = 0) -> dict[str, Any]:
    j = job()
    j["metadata"]["uid"] = "job-uid"
    j["status"] = {"conditions": conditions or [], "failed": failed}
    return j


def pod(name: str, phase: str, created: str, exit_code: int | None = None, message: str = "") -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}} if phase == "Running" else {"waiting": {"reason": "ContainerCreating"}}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "message": message}}
    return {"metadata": {"name": name, "creationTimestamp": created},
            "status": {"phase": phase, "containerStatuses": [{"name": "download", "state": state}]}}


def test_a_running_download_eventss_the_bytes_of_its_last_line() -> None:
    text = "a warning on stderr\n" + lines(("progress", (0, 300, None)), ("progress", (120, 300, "model.safetensors")))
    pods = [pod("dl-a", "Running", "2026-01-01T00:00:00Z")]
    assert prefetch_job.log_pod(live_job(), pods, None) == "dl-a"
    d = prefetch_job.observe(live_job(), pods, text + "half a li")
    assert (d.state, d.done, d.total, d.file, d.attempts) == ("Downloading", 120, 300, "model.safetensors", 0)
    assert d.as_status() == {"job": d.job, "state": "Downloading", "done": 120, "total": 300,
                             "file": "model.safetensors"}
    assert prefetch_job.summary(d) == "0.0/0.0 MB"
    big = prefetch_job.Download("j", "Downloading", done=1_500_000_000, total=16_060_000_000)
    assert prefetch_job.summary(big) == "1.5/16.1 GB"


def test_a_pod_not_running_yet_is_pending_and_its_log_is_not_read() -> None:
    pods = [pod("dl-a", "Pending", "2026-01-01T00:00:00Z")]
    d = prefetch_job.observe(live_job(), pods, None)
    assert d.state == "Pending" and d.pod is pods[0] and prefetch_job.summary(d) == "waiting"
    assert prefetch_job.log_pod(live_job(), pods, None) is None


def test_a_completed_download_eventss_its_size_and_time_once() -> None:
    done = {"path": "/data/hub/models--m/snapshots/abc", "bytes": 16_060_000_000, "fetched": 16_060_000_000,
            "seconds": 801.25, "repo": "m", "revision": "v2", "commit": "abc"}
    complete = live_job([{"type": "Complete", "status": "True"}])
    pods = [pod("dl-a", "Succeeded", "2026-01-01T00:00:00Z", 0)]
    assert prefetch_job.log_pod(complete, pods, None) == "dl-a"
    d = prefetch_job.observe(complete, pods, lines(("progress", (1, 2, "x")), ("done", (done,))))
    assert (d.state, d.done, d.total, d.seconds) == ("Complete", 16_060_000_000, 16_060_000_000, 801.25)
    assert prefetch_job.summary(d) == "16.1 GB"
    # The next passes keep what the status says instead of reading the log again.
    previous = d.as_status()
    assert prefetch_job.log_pod(complete, pods, previous) is None
    assert prefetch_job.observe(complete, pods, None, previous) == d


@pytest.mark.parametrize("code,reason", [(3, "unauthorized"), (4, "not_found"), (5, "no_space"), (6, "not_cached")])
def test_a_failed_download_names_its_cause(code: int, reason: str) -> None:
    message = f"the hub said no ({reason})"
    tail = lines(("progress", (0, 10, None)), ("error", (reason, message)))
    failed = live_job([{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}], failed=1)
    d = prefetch_job.observe(failed, [pod("dl-a", "Failed", "2026-01-01T00:00:00Z", code, tail)], None)
    assert (d.state, d.reason, d.message, d.attempts) == ("Failed", reason, message, 1)
    assert prefetch_job.summary(d) == f"failed: {reason}"


def test_a_failure_without_its_json_line_is_named_by_its_exit_code() -> None:
    failed = live_job([{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}], failed=1)
    d = prefetch_job.observe(failed, [pod("dl-a", "Failed", "2026-01-01T00:00:00Z", 5, "OSError: disk full")], None)
    assert (d.reason, d.message) == ("no_space", "OSError: disk full")
    gone = live_job([{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                      "message": "Job has reached the specified backoff limit"}], failed=7)
    d = prefetch_job.observe(gone, [], None)
    assert (d.state, d.reason, d.attempts) == ("Failed", "error", 7)
    assert "BackoffLimitExceeded" in d.message


def test_a_retried_attempt_is_still_downloading_with_the_last_failure_said() -> None:
    first = pod("dl-a", "Failed", "2026-01-01T00:00:00Z", 8, lines(("error", ("unreachable", "connection reset"))))
    second = pod("dl-b", "Running", "2026-01-01T00:01:00Z")
    j = live_job(failed=1)
    assert prefetch_job.log_pod(j, [first, second], None) == "dl-b"
    d = prefetch_job.observe(j, [second, first], lines(("progress", (5, 10, "model.safetensors"))))
    assert (d.state, d.done, d.attempts, d.reason, d.message) == ("Downloading", 5, 1, "unreachable",
                                                                   "connection reset")
    assert d.as_status()["attempts"] == 1


def test_last_event_skips_what_is_not_an_event() -> None:
    assert prefetch_job.last_event(None) is None
    assert prefetch_job.last_event("Traceback...\n[1, 2]\n{\"x\": 1}\n") is None
    assert prefetch_job.last_event('{"event": "progress", "done": 1, "total": 2, "file": null}\nwarning\n') == \
        {"event": "progress", "done": 1, "total": 2, "file": None}
