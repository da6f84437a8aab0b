"""What the operator observed -> InferenceService status (pure).

One direction through the facts: the pods and the Deployment become a `Fleet`
(counted once), the fleet gives the three conditions, and the phase is read
off the conditions, so a phase can never disagree with the conditions it
summarizes. What the status says about the children themselves (template hash,
selector, URL) comes from the same `Rendered` the reconcile applied.

`now` is used only for a condition's lastTransitionTime, and only when that
condition's status flips, so the same observation gives the same status and
the operator can patch only on change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gaudi_runtime.progress import STALL_EXIT_CODE

from .autoscaling import autoscaling_status
from .components import Condition, Context, Observed, Rendered, Report, reports
from .estimate import expected_warmup_shapes
from .gateway import KINDS as GATEWAY_KINDS
from .gateway import NO_PICKER_MESSAGE, gateway_status, missing_apis
from .kv_offload import kv_cache_status
from .memory import memory_status
from .prefetch_job import Download
from .prefetch_job import summary as download_summary
from .quantity import bytes_of
from .render import GAUDI_RESOURCE, TEMPLATE_HASH_LABEL, selector_string
from .spec import InferenceServiceSpec

MANAGED_KEYS = ("observedGeneration", "phase", "replicas", "readyReplicas", "updatedReplicas", "selector",
                "url", "readySummary", "warmupSummary", "warmup", "conditions", "autoscaling", "download",
                "downloadSummary", "startup", "gateway", "adapters", "kvCache", "memory")

IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONTAINER_CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# Most telling first: this is the order in which a problem is chosen for the conditions.
PROBLEM_ORDER = (
    "InvalidSpec", "AdapterFailed", "ModelDownloadFailed", "WarmupOutOfMemory", "StartupStalled", "OOMKilled", "CrashLoopBackOff",
    *CONTAINER_CONFIG_REASONS, *IMAGE_PULL_REASONS, "PodFailed", "ProgressDeadlineExceeded", "AutoscalerNotInstalled",
    "GatewayAPINotInstalled", "EndpointPickerNotConfigured", "Unschedulable",
)
# Problems that leave a pod unable to ever serve without a change by the user.
# A stalled start is restarted and may well get through the next time (a hung collective, a stuck mount).
FATAL_REASONS = frozenset(PROBLEM_ORDER) - {"Unschedulable", "AutoscalerNotInstalled", "GatewayAPINotInstalled",
                                            "EndpointPickerNotConfigured", "StartupStalled"}
# Without a problem, the Ready condition's reason names how far the pods got.
PHASE_OF_READY_REASON = {"AllReplicasReady": "Ready", "WarmingUp": "WarmingUp", "Loading": "Loading"}
# What to do about each reason a download gives for failing (download_events.py in the runtime).
DOWNLOAD_ADVICE = {
    "unauthorized": "the hub refused the token: check the HF token Secret",
    "not_found": "no such model, revision or safetensors weights: check spec.model.id and spec.model.revision",
    "no_space": "no space left on the claim: make it larger or free space on it",
    "not_cached": "the download ran offline (HF_HUB_OFFLINE in spec.env?) and the claim has no complete copy",
    "corrupt": "a file failed its checks twice",
    "unreachable": "the hub cannot be reached: check HF_ENDPOINT in spec.env, proxies and egress",
    "interrupted": "the download was stopped",
}

_DOWNLOAD_RE = re.compile(
    r"RepositoryNotFound|GatedRepo|RevisionNotFound|EntryNotFound|LocalEntryNotFound|HfHubHTTPError"
    r"|40[134] Client Error|failed to download|download failed|could not download", re.I)
_OOM_RE = re.compile(r"out of memory|\bOOM\b|RESOURCE_EXHAUSTED|failed to allocate", re.I)
# How the runtime names a LoRA adapter that failed to download or load (launcher.resolve_adapter_dirs and
# check_adapters, adapters.AdapterError): "... adapter 'sql' (org/sql-lora): ..." / "adapter 'sql' has rank 64 ...".
_ADAPTER_RE = re.compile(r"(?:--lora-adapters|download failed).*?\badapter '([^']+)'")
# What the runtime writes when its start made no progress for --warmup-stall-seconds (gaudi_runtime.progress).
_STALL_RE = re.compile(r"start stalled", re.I)

__all__ = ["MANAGED_KEYS", "Condition", "Observed", "compute_status", "invalid_spec_status", "latest_ready_pod",
           "phase_of", "ready_of", "status_patch"]


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class PodState:
    name: str
    terminating: bool
    ready: bool
    running: bool
    updated: bool  # runs the current pod template
    warmup: dict[str, Any] | None  # progress of a pod still warming up
    problem: Problem | None


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
    adapter = next((m for line in reversed(text.splitlines()) if (m := _ADAPTER_RE.search(line))), None)
    if adapter:  # before the download's rule: an adapter's failed download names the adapter
        return Problem("AdapterFailed", f"pod {pod}: LoRA adapter {adapter.group(1)!r} (spec.model.adapters) failed "
                                        f"to load (restarts: {restarts}): {adapter.string.strip()}")
    if text and _DOWNLOAD_RE.search(text):
        return Problem("ModelDownloadFailed", f"pod {pod}: could not download the model (check model.id, "
                                              f"revision and hubTokenSecretRef): {last_line}")
    detail = f": {last_line}" if last_line else (f" ({term.get('reason')})" if term.get("reason") else "")
    return Problem("CrashLoopBackOff", f"pod {pod}: container keeps exiting (exit code {code}, "
                                       f"restarts: {restarts}){detail}")


def _stall_problem(pod: str, cs: dict[str, Any]) -> Problem | None:
    """The container's last run ended because its start stalled: the runtime's exit code and message,
    or the log's tail the kubelet took as the message (FallbackToLogsOnError)."""
    term = (cs.get("lastState") or {}).get("terminated") or {}
    lines = (term.get("message") or "").strip().splitlines()
    said = next((line for line in reversed(lines) if _STALL_RE.search(line)), None)
    if term.get("exitCode") != STALL_EXIT_CODE and said is None:
        return None
    why = said[_STALL_RE.search(said).start():] if said else "no progress within spec.probes.warmupStallSeconds"
    return Problem("StartupStalled", f"pod {pod}: restarted because its start stalled "
                                     f"(restarts: {cs.get('restartCount', 0)}): {why}")


def _pod_problem(name: str, st: dict[str, Any], statuses: list[dict[str, Any]], shards: int,
                 ready: bool = False) -> Problem | None:
    """The first thing that keeps this pod from serving, as the kubelet and the scheduler report it."""
    if st.get("phase") == "Failed":
        return Problem("PodFailed", f"pod {name}: {st.get('reason') or 'Failed'}: {st.get('message', '')}".rstrip(": "))
    sched = next((c for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        msg = sched.get("message") or "no node fits the pod"
        if GAUDI_RESOURCE in msg:
            msg = f"not enough {GAUDI_RESOURCE} on any node ({shards} per replica): {msg}"
        return Problem("Unschedulable", f"pod {name}: {msg}")
    for cs in statuses:
        stalled = None if ready else _stall_problem(name, cs)
        if stalled:  # while it starts again (or waits to): once it serves, the restart is history
            return stalled
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason == "CrashLoopBackOff":
            return _crash_problem(name, cs)
        if reason in IMAGE_PULL_REASONS or reason in CONTAINER_CONFIG_REASONS:
            return Problem(reason, f"pod {name}: {waiting.get('message') or reason}")
    return None


def pod_state(pod: dict[str, Any], template_hash: str, shards: int, warmup: dict[str, Any] | None) -> PodState:
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    name = meta.get("name", "?")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    statuses = list(st.get("initContainerStatuses") or []) + list(st.get("containerStatuses") or [])
    return PodState(
        name=name,
        terminating=bool(meta.get("deletionTimestamp")),
        ready=ready,
        running=st.get("phase") == "Running" and any("running" in (cs.get("state") or {}) for cs in statuses),
        updated=(meta.get("labels") or {}).get(TEMPLATE_HASH_LABEL) == template_hash,
        warmup=warmup if warmup and not ready and int(warmup.get("total") or 0) > 0 else None,
        problem=_pod_problem(name, st, statuses, shards, ready),
    )


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


@dataclass(frozen=True)
class Fleet:
    """The facts every condition reads, counted once over the pods that are not terminating."""

    desired: int
    active: list[PodState]
    problems: list[Problem]  # most telling first
    rolling: bool  # pods with an old template, or the Deployment has not observed its spec yet
    download: Download | None = None  # the model-cache download, with prefetch
    download_problem: Problem | None = None  # it failed, or its pod cannot run

    @property
    def downloading(self) -> bool:
        """The download is not over: the Deployment waits for it (pods of an earlier template keep serving)."""
        return self.download is not None and self.download.state in ("Pending", "Downloading")

    @property
    def ready(self) -> int:
        return sum(s.ready for s in self.active)

    @property
    def updated(self) -> int:
        return sum(s.updated for s in self.active)

    @property
    def problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    @property
    def serving(self) -> bool:
        return self.desired > 0 and self.ready >= self.desired

    @property
    def warming(self) -> list[PodState]:
        return [s for s in self.active if s.warmup and s.running]

    @property
    def stage(self) -> str | None:
        """How far the pods that are not ready got: WarmingUp wins over Loading (weights)."""
        if self.warming:
            return "WarmingUp"
        if any(s.running and not s.ready and not s.warmup for s in self.active):
            return "Loading"
        return None


def _download_problem(download: Download | None, spec: InferenceServiceSpec) -> Problem | None:
    """A failed download names its cause and what to check; a stuck attempt, its pod's problem."""
    if download is None:
        return None
    if download.state == "Failed" and download.adapter:
        return _adapter_download_problem(download, spec)
    if download.state == "Failed":
        advice = DOWNLOAD_ADVICE.get(download.reason or "", "")
        ref = spec.model.hub_token_secret_ref
        if download.reason == "unauthorized":
            advice += (f" {ref.name!r} (spec.model.hubTokenSecretRef) and that its account may read {spec.model.id}"
                       if ref else f": {spec.model.id} needs one, set spec.model.hubTokenSecretRef")
        detail = "; ".join(x for x in (advice, download.message) if x)
        return Problem("ModelDownloadFailed", f"download job {download.job} failed: {download.reason}: {detail} "
                                              f"(delete the Job to try again once fixed)")
    pod = download.pod
    if pod is None:
        return None
    st = pod.get("status") or {}
    problem = _pod_problem((pod.get("metadata") or {}).get("name", "?"), st, list(st.get("containerStatuses") or []), 0)
    return Problem(problem.reason, f"download {problem.message}") if problem else None


def _adapter_download_problem(download: Download, spec: InferenceServiceSpec) -> Problem:
    """A LoRA adapter's download failed (the Job fetches them before the model): name it and what to check."""
    adapter = next((a for a in spec.model.adapters if a.name == download.adapter), None)
    source = f" ({adapter.source}{'@' + adapter.revision if adapter and adapter.revision else ''})" if adapter else ""
    advice = {"not_found": "no such adapter repository, revision or safetensors weights: check its source and "
                           "revision in spec.model.adapters",
              "unauthorized": "the hub refused the token for this adapter: check spec.model.hubTokenSecretRef and "
                              "that its account may read the adapter"}.get(download.reason or "",
                                                                           DOWNLOAD_ADVICE.get(download.reason or "", ""))
    detail = "; ".join(x for x in (advice, download.message) if x)
    return Problem("AdapterFailed", f"download job {download.job} failed on LoRA adapter {download.adapter!r}{source}: "
                                    f"{download.reason}: {detail} (delete the Job to try again once fixed)")


def observe_fleet(spec: InferenceServiceSpec, template_hash: str, observed: Observed, no_picker: bool = False) -> Fleet:
    """The pods counted once, and every problem, most telling first; `no_picker`: spec.gateway has no
    picker to refer its pool to."""
    states = [pod_state(p, template_hash, spec.shards, observed.warmup.get((p.get("metadata") or {}).get("name", "")))
              for p in observed.pods]
    active = [s for s in states if not s.terminating]
    problems = [s.problem for s in active if s.problem]
    download_problem = _download_problem(observed.download, spec)
    # The Deployment's progress deadline knows nothing of warmup: a pod still starting without a problem
    # of its own is judged by its own progress (the runtime's stall rule), not by that deadline.
    starting = any(s.running and not s.ready and s.problem is None for s in active)
    for problem in (None if starting else _deployment_problem(observed.deployment), download_problem):
        if problem:
            problems.append(problem)
    problems += [Problem("AutoscalerNotInstalled", f"this cluster does not serve {kind}: install its autoscaler "
                                                   "(KEDA for engine keda), or change spec.autoscaling.engine")
                 for kind in observed.unserved if kind not in GATEWAY_KINDS]
    if gateway_missing := missing_apis(observed.unserved):
        problems.append(Problem("GatewayAPINotInstalled", f"spec.gateway: {gateway_missing}; the pods still serve "
                                                          "through their Service"))
    if no_picker:
        problems.append(Problem("EndpointPickerNotConfigured", NO_PICKER_MESSAGE))
    problems.sort(key=lambda p: PROBLEM_ORDER.index(p.reason))
    old = any(not s.updated for s in active)
    return Fleet(desired=spec.replicas, active=active, problems=problems,
                 rolling=spec.replicas > 0 and (_deployment_rolling(observed.deployment) or old),
                 download=observed.download, download_problem=download_problem)


def _warmup_progress(fleet: Fleet) -> dict[str, Any] | None:
    """The least advanced warming pod: the one the service waits for."""
    least = min(fleet.warming, key=lambda s: (s.warmup["done"] / max(1, s.warmup["total"]), s.name), default=None)
    if least is None:
        return None
    warm = {"done": int(least.warmup.get("done") or 0), "total": int(least.warmup["total"]), "pod": least.name}
    if least.warmup.get("phase"):
        warm["phase"] = str(least.warmup["phase"])
    if isinstance(least.warmup.get("from_cache"), bool):
        warm["fromCache"] = least.warmup["from_cache"]
    return warm


def _summary(fleet: Fleet, warm: dict[str, Any] | None, spec: InferenceServiceSpec) -> str:
    summary = f"{fleet.ready}/{fleet.desired} replicas ready"
    if fleet.downloading and fleet.download is not None:
        summary += f"; download {download_summary(fleet.download)}"
    if warm:
        summary += f"; warmup {warm['done']}/{warm['total']} shapes"
    elif fleet.stage == "Loading" and (expected := expected_warmup_shapes(spec)):
        summary += f"; loading, then a warmup of {expected} shapes"  # the runtime's own count (estimate.py)
    if len(fleet.problems) > 1:
        summary += f"; {len(fleet.problems)} problems"
    return summary


def _ready(fleet: Fleet, summary: str) -> Condition:
    problem = fleet.problem
    message = summary + (f"; {problem.message}" if problem else "")
    if fleet.desired == 0:
        reason = "ScaledToZero"
    elif fleet.serving:
        reason = "AllReplicasReady"
    elif problem:
        reason = problem.reason
    elif fleet.downloading:
        reason = "Downloading"
    elif fleet.stage:
        reason = fleet.stage
    elif fleet.rolling and fleet.active:
        reason = "RollingOut"
    else:
        reason = "Pending"
    return Condition(fleet.serving, reason, message)


def _progressing(fleet: Fleet, summary: str) -> Condition:
    problem, active, desired = fleet.problem, len(fleet.active), fleet.desired
    if desired == 0 and not active:
        return Condition(False, "ScaledToZero", "scaled to zero replicas")
    if problem and problem.reason == "ProgressDeadlineExceeded":
        return Condition(False, problem.reason, problem.message)
    if fleet.download_problem:  # the Deployment waits for a download that cannot go on
        return Condition(False, fleet.download_problem.reason, f"stalled: {fleet.download_problem.message}")
    if fleet.downloading:
        return Condition(True, "Downloading", f"the replicas start once the model is in the claim; {summary}")
    if fleet.rolling:
        return Condition(True, "RollingOut",
                         f"{fleet.updated}/{desired} replicas updated, {active - fleet.updated} old; {summary}")
    if active != desired:
        return Condition(True, "Scaling", f"{active} replicas, want {desired}")
    if fleet.stage:
        return Condition(True, fleet.stage, summary)
    if fleet.ready < desired and problem:
        return Condition(False, problem.reason, f"stalled: {problem.message}")  # nothing moves until it is fixed
    if fleet.ready < desired:
        return Condition(True, "Pending", summary)
    return Condition(False, "RolloutComplete", f"{fleet.ready}/{desired} replicas ready and up to date")


def _degraded(fleet: Fleet) -> Condition:
    if fleet.problem:
        return Condition(True, fleet.problem.reason, fleet.problem.message)
    return Condition(False, "AsExpected", "no problem observed")


def ready_of(workload: Condition, reports: list[Report]) -> Condition:
    """Ready, from the set of conditions: the workload's (the fleet serves) and every condition that
    gates readiness (Routed, when a gateway is asked for), as KServe derives its readiness from its
    condition set. The workload's reason wins while it is not serving: it says the most."""
    blocking = [r for r in reports if r.gates_ready and not r.condition.status]
    if not workload.status or not blocking:
        return workload
    first = blocking[0]
    return Condition(False, first.condition.reason, f"{workload.message}; {first.type}: {first.condition.message}")


def phase_of(conditions: dict[str, Condition], ready_replicas: int) -> str:
    """The one-word summary of the conditions that `kubectl get` shows."""
    ready, degraded = conditions["Ready"], conditions["Degraded"]
    if ready.reason == "ScaledToZero":
        return "Pending"  # nothing is wanted, so nothing can be degraded or on its way
    if degraded.status:
        return "Failed" if degraded.reason in FATAL_REASONS and ready_replicas == 0 else "Degraded"
    if "Downloaded" in conditions and conditions["Downloaded"].reason == "Downloading":
        return "Downloading"  # even while pods of an earlier template serve: the current one waits for it
    return PHASE_OF_READY_REASON.get(ready.reason, "Pending")


def _stamp(body: dict[str, Any], conditions: dict[str, Condition], now: str) -> list[dict[str, Any]]:
    """metav1.Conditions; a condition keeps its lastTransitionTime unless its status flips."""
    generation = (body.get("metadata") or {}).get("generation")
    previous = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    out = []
    for ctype, cond in conditions.items():
        status = "True" if cond.status else "False"
        prev = previous.get(ctype) or {}
        since = prev.get("lastTransitionTime") if prev.get("status") == status else None
        stamped = {"type": ctype, "status": status, "reason": cond.reason, "message": cond.message,
                   "lastTransitionTime": since or now}
        if generation is not None:
            stamped["observedGeneration"] = generation
        out.append(stamped)
    return out


def compute_status(body: dict[str, Any], spec: InferenceServiceSpec, rendered: Rendered, observed: Observed,
                   *, now: str, context: Context | None = None) -> dict[str, Any]:
    """The status of an InferenceService whose children were rendered as `rendered` and observed as `observed`
    (`context`: what they were rendered from; by default the object and its spec)."""
    fleet = observe_fleet(spec, rendered.template_hash, observed, spec.gateway is not None and rendered.picker is None)
    warm = _warmup_progress(fleet)
    summary = _summary(fleet, warm, spec)
    workload = _ready(fleet, summary)
    reported = reports(context or Context(body, spec), rendered, observed)
    conditions = {"Ready": workload, "Progressing": _progressing(fleet, summary), "Degraded": _degraded(fleet),
                  **{r.type: r.condition for r in reported}}
    conditions["Ready"] = ready_of(workload, reported)
    meta = body.get("metadata") or {}
    status: dict[str, Any] = {
        "observedGeneration": (body.get("metadata") or {}).get("generation"),
        "selector": rendered.selector,
        "phase": phase_of(conditions, fleet.ready),
        "replicas": len(fleet.active),
        "readyReplicas": fleet.ready,
        "updatedReplicas": fleet.updated,
        "url": rendered.url,
        "readySummary": f"{fleet.ready}/{fleet.desired}",
        "conditions": _stamp(body, conditions, now),
    }
    if warm:
        status["warmup"] = warm
        status["warmupSummary"] = f"{warm['done']}/{warm['total']}"
    autoscaling = autoscaling_status(spec, observed.autoscaler)
    if autoscaling:
        status["autoscaling"] = autoscaling
    if observed.download is not None:
        status["download"] = observed.download.as_status()
        status["downloadSummary"] = download_summary(observed.download)
    gateway = gateway_status(spec, meta.get("name", ""), meta.get("namespace", ""), observed.route,
                             rendered.picker, rendered.picker_managed)
    if gateway:
        status["gateway"] = gateway
    startup = _startup(observed.startup) or (body.get("status") or {}).get("startup")
    if startup:
        status["startup"] = startup
    previous = body.get("status") or {}
    adapters = _served(fleet, _adapters(spec), previous.get("adapters"), list)
    if adapters:
        status["adapters"] = adapters
    cache = spec.model.cache
    claim = cache.persistent_volume_claim.claim_name if cache and cache.persistent_volume_claim else None
    kv_cache = _served(fleet, kv_cache_status(spec, claim), previous.get("kvCache"), dict)
    if kv_cache:
        status["kvCache"] = kv_cache
    memory = _memory(spec, observed.download)
    if memory:
        status["memory"] = memory
    return status


def _memory(spec: InferenceServiceSpec, download: Download | None) -> dict[str, Any] | None:
    """status.memory: the estimate from the config.json the download Job reported (spec.model.cache.prefetch),
    for spec.shards and the host tier. BF16 only: an FP8 pod's bytes depend on its QUANT_CONFIG."""
    if download is None or download.config is None or spec.precision != "bf16":
        return None
    host = int(bytes_of(spec.offload.host_memory)) if spec.offload else None
    return memory_status(download.config, spec.shards, host)


def _adapters(spec: InferenceServiceSpec) -> list[dict[str, str]] | None:
    return [{"name": a.name, "source": a.source, **({"revision": a.revision} if a.revision else {})}
            for a in spec.model.adapters] or None


def _served(fleet: Fleet, current: Any, previous: Any, kind: type) -> Any:
    """What the ready pods run of a setting of their template: `current` once a pod of the current template is
    ready (spec.model.adapters: a pod starts only once every adapter loaded; spec.kvCache.offload: the tiers
    it started with, whose health while serving is in its metrics); while only pods of an earlier template
    are ready, what the status said of them (`previous`) stays."""
    if not fleet.ready:
        return None
    if not any(s.ready and s.updated for s in fleet.active):
        return previous if isinstance(previous, kind) else None
    return current


def latest_ready_pod(pods: list[dict[str, Any]], template_hash: str) -> dict[str, Any] | None:
    """The newest ready pod running the current template: whose start-up the status reports."""
    def ready(pod: dict[str, Any]) -> bool:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        return (not meta.get("deletionTimestamp") and (meta.get("labels") or {}).get(TEMPLATE_HASH_LABEL) == template_hash
                and any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []))
    candidates = [p for p in pods if ready(p)]
    return max(candidates, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"].get("name") or ""),
               default=None)


def _startup(health: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.startup from a ready pod's /health: its download, load and warmup seconds."""
    if not health:
        return None
    seconds = health.get("startup_seconds") if isinstance(health.get("startup_seconds"), dict) else {}
    out: dict[str, Any] = {"pod": health["pod"]}
    for key in ("download", "load", "warmup"):
        value = seconds.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{key}Seconds"] = round(float(value), 3)
    if isinstance(health.get("warmup_from_cache"), bool):
        out["warmupFromCache"] = health["warmup_from_cache"]
    return out if len(out) > 1 else None


def invalid_spec_status(body: dict[str, Any], message: str, *, now: str) -> dict[str, Any]:
    """The status of an InferenceService whose spec the operator cannot read: nothing was rendered."""
    meta = body.get("metadata") or {}
    invalid = Condition(False, "InvalidSpec", message)
    conditions = {"Ready": invalid, "Progressing": invalid, "Degraded": Condition(True, "InvalidSpec", message)}
    status = {
        "observedGeneration": meta.get("generation"),
        "selector": selector_string(meta.get("name", "")),
        "phase": phase_of(conditions, 0),
        "replicas": 0,
        "readyReplicas": 0,
        "updatedReplicas": 0,
        "readySummary": "0/?",
        "conditions": _stamp(body, conditions, now),
    }
    # The download Job the status named stays named: the pass after a fix leaves it if it must.
    download = (body.get("status") or {}).get("download")
    if download:
        status["download"] = download
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
