"""Children + pods + runtime warmup progress -> InferenceService status (pure).

`compute_status` is a function of what the operator observed and of `now`
(used only for a condition's lastTransitionTime, and only when that
condition's status flips), so the same observation gives the same status and
the operator can patch only on change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .render import GAUDI_RESOURCE, TEMPLATE_HASH_LABEL, pod_template, selector_string, service_url
from .spec import InferenceServiceSpec

PHASES = ("Pending", "Loading", "WarmingUp", "Ready", "Degraded", "Failed")
MANAGED_KEYS = ("observedGeneration", "phase", "replicas", "readyReplicas", "updatedReplicas", "selector",
                "url", "readySummary", "warmupSummary", "warmup", "conditions")

IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONTAINER_CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# Most telling first: this is the order in which a problem is chosen for the conditions.
PROBLEM_ORDER = (
    "InvalidSpec", "ModelDownloadFailed", "WarmupOutOfMemory", "OOMKilled", "CrashLoopBackOff",
    *CONTAINER_CONFIG_REASONS, *IMAGE_PULL_REASONS, "PodFailed", "ProgressDeadlineExceeded", "Unschedulable",
)
# Problems that leave a pod unable to ever serve without a change by the user.
FATAL_REASONS = frozenset(PROBLEM_ORDER) - {"Unschedulable"}

_DOWNLOAD_RE = re.compile(
    r"RepositoryNotFound|GatedRepo|RevisionNotFound|EntryNotFound|LocalEntryNotFound|HfHubHTTPError"
    r"|40[134] Client Error|failed to download|download failed|could not download", re.I)
_OOM_RE = re.compile(r"out of memory|\bOOM\b|RESOURCE_EXHAUSTED|failed to allocate", re.I)

__all__ = ["MANAGED_KEYS", "PHASES", "PodState", "compute_status", "pod_state", "status_patch"]


@dataclass
class Problem:
    reason: str
    message: str


@dataclass
class PodState:
    name: str
    terminating: bool = False
    ready: bool = False
    running: bool = False
    updated: bool = False
    warmup: dict[str, Any] | None = None
    problem: Problem | None = None
    restarts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _crash_problem(pod: str, cs: dict[str, Any]) -> Problem:
    term = (cs.get("lastState") or {}).get("terminated") or {}
    text = (term.get("message") or "").strip()
    last_line = text.splitlines()[-1] if text else ""
    code = term.get("exitCode")
    restarts = cs.get("restartCount", 0)
    if term.get("reason") == "OOMKilled":
        return Problem("OOMKilled", f"pod {pod}: container killed for exceeding its memory limit "
                                    f"(restarts: {restarts})")
    if text and _OOM_RE.search(text) and "warmup" in text.lower():
        return Problem("WarmupOutOfMemory", f"pod {pod}: out of device memory during warmup; lower "
                                            f"maxBatchTotalTokens/maxBatchSize or the bucket sizes: {last_line}")
    if text and _DOWNLOAD_RE.search(text):
        return Problem("ModelDownloadFailed", f"pod {pod}: could not download the model (check model.id, "
                                              f"revision and hubTokenSecretRef): {last_line}")
    detail = f": {last_line}" if last_line else (f" ({term.get('reason')})" if term.get("reason") else "")
    return Problem("CrashLoopBackOff", f"pod {pod}: container keeps exiting (exit code {code}, "
                                       f"restarts: {restarts}){detail}")


def pod_state(pod: dict[str, Any], current_hash: str | None, shards: int,
              warmup: dict[str, Any] | None = None) -> PodState:
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    state = PodState(name=name)
    state.terminating = bool(meta.get("deletionTimestamp"))
    state.updated = current_hash is not None and (meta.get("labels") or {}).get(TEMPLATE_HASH_LABEL) == current_hash
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    state.ready = (conds.get("Ready") or {}).get("status") == "True"
    statuses = list(st.get("initContainerStatuses") or []) + list(st.get("containerStatuses") or [])
    state.restarts = sum(cs.get("restartCount", 0) for cs in statuses)
    state.running = st.get("phase") == "Running" and any("running" in (cs.get("state") or {}) for cs in statuses)
    sched = conds.get("PodScheduled") or {}
    if st.get("phase") == "Failed":
        state.problem = Problem("PodFailed", f"pod {name}: {st.get('reason') or 'Failed'}: {st.get('message', '')}".rstrip(": "))
    elif sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        msg = sched.get("message") or "no node fits the pod"
        if GAUDI_RESOURCE in msg:
            msg = f"not enough {GAUDI_RESOURCE} on any node ({shards} per replica): {msg}"
        state.problem = Problem("Unschedulable", f"pod {name}: {msg}")
    else:
        for cs in statuses:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason == "CrashLoopBackOff":
                state.problem = _crash_problem(name, cs)
            elif reason in IMAGE_PULL_REASONS or reason in CONTAINER_CONFIG_REASONS:
                state.problem = Problem(reason, f"pod {name}: {waiting.get('message') or reason}")
            if state.problem:
                break
    if warmup and not state.ready and int(warmup.get("total") or 0) > 0:
        state.warmup = warmup
    return state


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = previous.get(ctype) or {}
    since = prev.get("lastTransitionTime") if prev.get("status") == status and prev.get("lastTransitionTime") else now
    cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _deployment_rolling(dep: dict[str, Any] | None) -> bool:
    if not dep:
        return False
    gen = (dep.get("metadata") or {}).get("generation")
    observed = (dep.get("status") or {}).get("observedGeneration")
    return gen is not None and observed is not None and observed < gen


def _deployment_problem(dep: dict[str, Any] | None) -> Problem | None:
    for c in ((dep or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return Problem("ProgressDeadlineExceeded", c.get("message") or "the rollout exceeded its deadline")
    return None


def compute_status(
    body: dict[str, Any],
    spec: InferenceServiceSpec | None,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    warmup: dict[str, dict[str, Any]] | None = None,
    *,
    now: str,
    spec_error: str | None = None,
    cluster_domain: str = "cluster.local",
) -> dict[str, Any]:
    """The status of an InferenceService from its observed children and pods.

    `warmup` maps pod name -> the `warmup` object of that pod's /health answer.
    `spec_error` (with `spec` None) reports a spec the operator could not read.
    """
    meta = body.get("metadata") or {}
    name, namespace, generation = meta.get("name", ""), meta.get("namespace", ""), meta.get("generation")
    previous = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    warmup = warmup or {}

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return _condition(ctype, ok, reason, message, generation, previous, now)

    status: dict[str, Any] = {"observedGeneration": generation, "selector": selector_string(name)}
    if spec is None:
        msg = spec_error or "the spec cannot be read"
        status.update(phase="Failed", replicas=0, readyReplicas=0, updatedReplicas=0, readySummary="0/?",
                      conditions=[cond("Ready", False, "InvalidSpec", msg),
                                  cond("Progressing", False, "InvalidSpec", msg),
                                  cond("Degraded", True, "InvalidSpec", msg)])
        return status

    desired = spec.replicas
    current_hash = pod_template(body, spec)["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    states = [pod_state(p, current_hash, spec.shards, warmup.get((p.get("metadata") or {}).get("name", "")))
              for p in pods]
    active = [s for s in states if not s.terminating]
    ready = sum(s.ready for s in active)
    updated = sum(s.updated for s in active)
    old = len(active) - updated
    warming = [s for s in active if s.warmup and s.running]
    loading = [s for s in active if s.running and not s.ready and not s.warmup]
    problems = [s.problem for s in active if s.problem]
    dep_problem = _deployment_problem(deployment)
    if dep_problem:
        problems.append(dep_problem)
    problems.sort(key=lambda p: PROBLEM_ORDER.index(p.reason))
    problem = problems[0] if problems else None

    least = min(warming, key=lambda s: (s.warmup["done"] / max(1, s.warmup["total"]), s.name), default=None)
    warm = None
    if least is not None:
        warm = {"done": int(least.warmup.get("done") or 0), "total": int(least.warmup["total"]), "pod": least.name}
        if least.warmup.get("phase"):
            warm["phase"] = str(least.warmup["phase"])

    rolling = desired > 0 and (_deployment_rolling(deployment) or old > 0)
    scaling = len(active) != desired
    serving = desired > 0 and ready >= desired

    if problem and ready == 0 and desired > 0 and problem.reason in FATAL_REASONS:
        phase = "Failed"
    elif problem and desired > 0:
        phase = "Degraded"
    elif serving:
        phase = "Ready"
    elif warming:
        phase = "WarmingUp"
    elif loading:
        phase = "Loading"
    else:
        phase = "Pending"

    summary = f"{ready}/{desired} replicas ready"
    if warm:
        summary += f"; warmup {warm['done']}/{warm['total']} shapes"
    if problems and len(problems) > 1:
        summary += f"; {len(problems)} problems"

    if desired == 0:
        ready_reason = "ScaledToZero"
    elif serving:
        ready_reason = "AllReplicasReady"
    elif problem:
        ready_reason = problem.reason
    elif warming:
        ready_reason = "WarmingUp"
    elif loading:
        ready_reason = "Loading"
    elif rolling and active:
        ready_reason = "RollingOut"
    else:
        ready_reason = "Pending"
    ready_msg = summary + (f"; {problem.message}" if problem else "")

    if desired == 0 and not active:
        prog = (False, "ScaledToZero", "scaled to zero replicas")
    elif problem and problem.reason == "ProgressDeadlineExceeded":
        prog = (False, problem.reason, problem.message)
    elif rolling:
        prog = (True, "RollingOut", f"{updated}/{desired} replicas updated, {old} old; {summary}")
    elif scaling:
        prog = (True, "Scaling", f"{len(active)} replicas, want {desired}")
    elif warming:
        prog = (True, "WarmingUp", summary)
    elif loading:
        prog = (True, "Loading", summary)
    elif ready < desired and problem:
        prog = (False, problem.reason, f"stalled: {problem.message}")  # nothing moves until it is fixed
    elif ready < desired:
        prog = (True, "Pending", summary)
    else:
        prog = (False, "RolloutComplete", f"{ready}/{desired} replicas ready and up to date")

    degraded = (True, problem.reason, problem.message) if problem else (False, "AsExpected", "no problem observed")

    status.update(
        phase=phase,
        replicas=len(active),
        readyReplicas=ready,
        updatedReplicas=updated,
        url=service_url(name, namespace, spec, cluster_domain),
        readySummary=f"{ready}/{desired}",
        conditions=[cond("Ready", serving, ready_reason, ready_msg),
                    cond("Progressing", *prog),
                    cond("Degraded", *degraded)],
    )
    if warm:
        status["warmup"] = warm
        status["warmupSummary"] = f"{warm['done']}/{warm['total']}"
    return status


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch turning `old` into `new` for the operator's keys; {} when nothing changed."""
    old = old or {}
    patch: dict[str, Any] = {}
    for key in MANAGED_KEYS:
        if key in new:
            if old.get(key) != new[key]:
                patch[key] = new[key]
        elif old.get(key) is not None:
            patch[key] = None
    return patch
