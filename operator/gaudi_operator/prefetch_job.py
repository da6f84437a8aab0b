"""The model-cache download Job of `spec.model.cache.prefetch`, and what it reports (pure).

One Job per model, revision and claim (and hub adapters, when there are: it fetches them first), in the claim's namespace: its name is a hash of the three,
so every InferenceService naming them finds the same Job. None of them controls it: each adds an
ownerReference of its own (not a controller one), and garbage collection deletes the Job with the
last owner. The Job's template is never changed once created (a Job's pod template is immutable),
so it is the first InferenceService's: its image, hub token Secret and variables.

The Job's pod runs `gaudi-serve download --progress json` with the claim mounted read-write; its
JSON lines (`download_events.py` in the runtime) are the interface read here: the last line of the
pod's log while it runs (bytes done / total), its exit code and the error line of its termination
message when it failed (the container's terminationMessagePolicy puts the log's tail there). The
exit codes also drive the Job's podFailurePolicy: a failure that no retry can heal fails the Job
at once, the others are retried up to `BACKOFF_LIMIT` times.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .memory import config_subset
from .spec import InferenceServiceSpec, lora_adapters_flag

CONTAINER = "download"
DATA_DIR = "/data"
HUB_CACHE = f"{DATA_DIR}/hub"
JOB_PREFIX = "gaudi-serve-download-"
KEY_LABEL = "gaudiserve.io/model-download"
BACKOFF_LIMIT = 6
# `gaudi-serve download`'s exit code of each failure (runtime: download_events.EXIT_CODES).
EXIT_REASONS = {1: "error", 3: "unauthorized", 4: "not_found", 5: "no_space", 6: "not_cached", 7: "corrupt",
                8: "unreachable", 143: "interrupted"}
# Failures a retry cannot heal: the Job fails at the first (podFailurePolicy FailJob).
FINAL_REASONS = ("unauthorized", "not_found", "no_space", "not_cached")
# Variables of spec.env the download does not take (the serving pods' offline mode would stop it).
NOT_FOR_DOWNLOAD = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
STATES = ("Pending", "Downloading", "Complete", "Failed")

__all__ = ["CONTAINER", "KEY_LABEL", "Download", "download_key", "job_name", "last_event", "log_pod", "observe",
           "owner_reference", "owners", "render_job", "summary"]


def download_key(namespace: str, spec: InferenceServiceSpec) -> str | None:
    """What names the download: model, revision, claim and the hub adapters (None without prefetch).
    Without adapters the key is what it was before they existed, so no Job is made again."""
    cache = spec.model.cache
    if not spec.model.prefetched or cache is None or cache.persistent_volume_claim is None:
        return None
    parts = [namespace, spec.model.id, spec.model.revision or "", cache.persistent_volume_claim.claim_name]
    # The adapters' order does not change what is fetched; their names do not either, but they name a
    # failure in the Job's output, which every owner reads.
    parts += sorted(a.flag_entry() for a in spec.model.hub_adapters)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def job_name(key: str) -> str:
    return JOB_PREFIX + key


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """This InferenceService as one of the Job's owners: not its controller, and a foreground
    deletion of one owner does not wait for a Job the others still use."""
    meta = body["metadata"]
    return {"apiVersion": body["apiVersion"], "kind": body["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": False, "blockOwnerDeletion": False}


def owners(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The InferenceServices that own a download Job."""
    return [o for o in (job.get("metadata") or {}).get("ownerReferences") or [] if o.get("kind") == "InferenceService"]


def _labels(key: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "gaudi-serve", "app.kubernetes.io/component": "model-download",
            "app.kubernetes.io/managed-by": "gaudi-serve-operator", KEY_LABEL: key}


def _env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": DATA_DIR}, {"name": "HUGGINGFACE_HUB_CACHE", "value": HUB_CACHE}]
    ref = spec.model.hub_token_secret_ref
    if ref:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    # The user's variables reach the download as they reach the runtime (HF_ENDPOINT, proxies, CA bundles).
    ours = {e["name"] for e in env}
    env += [e for e in spec.env if e.get("name") not in ours and e.get("name") not in NOT_FOR_DOWNLOAD]
    return env


def _args(spec: InferenceServiceSpec) -> list[str]:
    args = ["download", "--model-id", spec.model.id]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.hub_adapters:  # fetched first, into the same cache: the replicas find them offline
        args += ["--lora-adapters", lora_adapters_flag(spec.model.hub_adapters)]
    return args + ["--huggingface-hub-cache", HUB_CACHE, "--progress", "json"]


def _pod_spec(spec: InferenceServiceSpec) -> dict[str, Any]:
    assert spec.model.cache is not None and spec.model.cache.persistent_volume_claim is not None
    container: dict[str, Any] = {
        "name": CONTAINER, "image": spec.image, "command": ["gaudi-serve"], "args": _args(spec), "env": _env(spec),
        "volumeMounts": [{"name": "model-cache", "mountPath": DATA_DIR}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # A failed container's status carries the log's tail: the JSON error line, with no log API call.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # each attempt is a pod of its own, as podFailurePolicy needs
        "containers": [container],
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {
            "claimName": spec.model.cache.persistent_volume_claim.claim_name}}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key, value in (("serviceAccountName", spec.service_account_name), ("nodeSelector", dict(spec.node_selector)),
                       ("tolerations", spec.tolerations), ("imagePullSecrets", spec.image_pull_secrets)):
        if value:
            pod[key] = value
    return pod


def render_job(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The download Job this InferenceService needs, with itself as one owner (None without prefetch)."""
    namespace = body["metadata"]["namespace"]
    key = download_key(namespace, spec)
    if key is None:
        return None
    assert spec.model.cache is not None and spec.model.cache.persistent_volume_claim is not None
    final = sorted(code for code, reason in EXIT_REASONS.items() if reason in FINAL_REASONS)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job_name(key), "namespace": namespace, "labels": _labels(key),
                     "annotations": {"gaudiserve.io/model": spec.model.id,
                                     "gaudiserve.io/revision": spec.model.revision or "",
                                     "gaudiserve.io/claim": spec.model.cache.persistent_volume_claim.claim_name,
                                     **({"gaudiserve.io/adapters": lora_adapters_flag(spec.model.hub_adapters)}
                                        if spec.model.hub_adapters else {})},
                     "ownerReferences": [owner_reference(body)]},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": final}},
                # A pod evicted or preempted did not fail: its attempt is not counted.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"metadata": {"labels": _labels(key)}, "spec": _pod_spec(spec)},
        },
    }


# ---- what the Job reports ---------------------------------------------------------------------

@dataclass(frozen=True)
class Download:
    """The download as the status reports it."""

    job: str
    state: str  # one of STATES
    done: int | None = None
    total: int | None = None
    file: str | None = None
    seconds: float | None = None
    attempts: int = 0  # failed attempts
    reason: str | None = None  # of the failure, or of the last failed attempt
    message: str = ""
    adapter: str | None = None  # the LoRA adapter whose download failed (spec.model.adapters[].name)
    config: dict[str, Any] | None = None  # what the memory estimate reads of the model's config.json, once done
    pod: dict[str, Any] | None = None  # the attempt under way (its problems are the service's)

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job, "state": self.state}
        for key in ("done", "total", "file", "seconds", "reason"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.attempts:
            out["attempts"] = self.attempts
        if self.message:
            out["message"] = self.message
        if self.adapter:
            out["adapter"] = self.adapter
        if self.config is not None:
            out["config"] = self.config
        return out


def last_event(text: str | None) -> dict[str, Any] | None:
    """The last JSON line of a download's output that is one of its events (other lines are skipped)."""
    for line in reversed((text or "").splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            return event
    return None


def _condition(job: dict[str, Any], *types: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("type") in types and c.get("status") == "True"), None)


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            return (cs.get("state") or {}).get("terminated") or {}
    return {}


def _failure(pod: dict[str, Any]) -> tuple[str, str, str | None]:
    """(reason, message, adapter) of a failed attempt: its exit code, and the error line of its termination
    message (which names the LoRA adapter when the failure was one's)."""
    term = _terminated(pod)
    code = term.get("exitCode")
    event = last_event(term.get("message"))
    reason = EXIT_REASONS.get(code, "error") if isinstance(code, int) else "error"
    if event and event.get("event") == "error":
        adapter = event.get("adapter")
        return (str(event.get("reason") or reason), str(event.get("message") or ""),
                adapter if isinstance(adapter, str) and adapter else None)
    if (pod.get("status") or {}).get("reason"):  # evicted, deadline exceeded: the kubelet's word
        return reason, f"{pod['status']['reason']}: {pod['status'].get('message', '')}".rstrip(": "), None
    last = (term.get("message") or "").strip().splitlines()
    return reason, (last[-1] if last else f"exit code {code}"), None


def _sorted(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(pods, key=lambda p: ((p.get("metadata") or {}).get("creationTimestamp") or "",
                                       (p.get("metadata") or {}).get("name") or ""))


def _phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _current(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The attempt under way: the newest pod that has not ended and is not going away."""
    return next((p for p in reversed(_sorted(pods)) if _phase(p) not in ("Failed", "Succeeded")
                 and not (p.get("metadata") or {}).get("deletionTimestamp")), None)


def log_pod(job: dict[str, Any], pods: list[dict[str, Any]], previous: dict[str, Any] | None) -> str | None:
    """Whose log says the progress: the running attempt's; once the Job completed, the successful
    pod's, read once (the status keeps what it said)."""
    if _condition(job, "Complete", "SuccessCriteriaMet"):
        if (previous or {}).get("job") == job["metadata"]["name"] and (previous or {}).get("state") == "Complete":
            return None
        done = [p for p in _sorted(pods) if _phase(p) == "Succeeded"]
        return done[-1]["metadata"]["name"] if done else None
    current = _current(pods)
    return current["metadata"]["name"] if current is not None and _phase(current) == "Running" else None


def _progress(log_text: str | None, previous: dict[str, Any] | None, job: str) -> dict[str, Any]:
    """done/total/file/seconds (and the model's config, once done) from the log's last event, else what the
    status said about this Job."""
    event = last_event(log_text) or {}
    if event.get("event") == "done":
        return {"done": event.get("bytes"), "total": event.get("bytes"), "seconds": event.get("seconds"),
                "config": config_subset(event.get("config"))}
    if event.get("event") == "progress":
        return {k: event.get(k) for k in ("done", "total", "file")}
    if (previous or {}).get("job") == job:
        return {k: previous.get(k) for k in ("done", "total", "seconds", "config")}  # type: ignore[union-attr]
    return {}


def observe(job: dict[str, Any], pods: list[dict[str, Any]], log_text: str | None,
            previous: dict[str, Any] | None = None) -> Download:
    """The download from the live Job, its pods (this Job's only), the last lines of the log of
    `log_pod` and the previous status's `download` (what an earlier pass read)."""
    name = job["metadata"]["name"]
    ordered = _sorted(pods)
    failed = [p for p in ordered if _phase(p) == "Failed"]
    attempts = max(int((job.get("status") or {}).get("failed") or 0), len(failed))
    reason, message, adapter = _failure(failed[-1]) if failed else (None, "", None)
    progress = _progress(log_text, previous, name)
    if _condition(job, "Complete", "SuccessCriteriaMet"):
        config = progress.get("config")
        return Download(name, "Complete", progress.get("total"), progress.get("total"),
                        seconds=progress.get("seconds"), attempts=attempts,
                        config=config if isinstance(config, dict) else None)
    if _condition(job, "Failed", "FailureTarget"):
        if reason is None:
            cond = _condition(job, "Failed", "FailureTarget") or {}
            reason, message = "error", f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".rstrip(": ")
        return Download(name, "Failed", progress.get("done"), progress.get("total"), attempts=attempts,
                        reason=reason, message=message, adapter=adapter)
    current = _current(pods)
    running = current is not None and _phase(current) == "Running"
    return Download(name, "Downloading" if running else "Pending", progress.get("done"), progress.get("total"),
                    progress.get("file"), attempts=attempts, reason=reason, message=message, adapter=adapter,
                    pod=current)


def _size(n: int, unit: str) -> str:
    return f"{n / (1e9 if unit == 'GB' else 1e6):.1f}"


def summary(download: Download) -> str:
    """The printer column: done/total while it runs, the size once complete, the reason when failed."""
    if download.state == "Failed":
        return f"failed: {download.reason}"
    total = download.total
    if total is None:
        return "complete" if download.state == "Complete" else "waiting"
    unit = "GB" if total >= 1e9 else "MB"
    if download.state == "Complete":
        return f"{_size(total, unit)} {unit}"
    return f"{_size(download.done or 0, unit)}/{_size(total, unit)} {unit}"
