"""Kopf handlers: thin triggers around one idempotent pass per InferenceService.

The pass (`reconcile`) goes one way through the data and never back: read the
object, render its children, apply them, observe what the cluster made of them,
report the status. With spec.model.cache.prefetch the model-cache download Job comes
first (download.py): the Deployment waits for it. Triggers: create/update/resume of an
InferenceService, any event of a child (Deployment, Service, PodDisruptionBudget,
NetworkPolicy, autoscaler, InferencePool, HTTPRoute) or pod carrying our labels, of a
download Job (its owners' passes), and a resync timer that also polls warmup progress of warming pods and a download's progress.
Runs for the same object are serialized; a trigger arriving during a run causes
one more run after it, never a pile-up.

Operator-wide state (the `OperatorConfig`, the `Reconciler`, the resync task)
lives in Kopf's memo, which Kopf hands to every handler.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from . import kube, prefetch_job
from .autoscaling import KINDS as AUTOSCALER_KINDS
from .config import OperatorConfig
from .gateway import KINDS as GATEWAY_KINDS
from .gateway import named_in_status
from .picker import PickerConfig, stale_picker
from .prefetch_job import Download
from .render import ISVC_LABEL, MANAGED_BY, Rendered, operator_peer, render
from .spec import (
    FIELD_MANAGER,
    GROUP,
    PLURAL,
    RUNTIME_PORT,
    VERSION,
    InferenceServiceSpec,
    SpecError,
    parse_spec,
)
from .status import Observed, compute_status, invalid_spec_status, latest_ready_pod, status_patch

log = logging.getLogger(__name__)

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, ISVC_LABEL: kopf.PRESENT}
WARNING_PHASES = ("Degraded", "Failed")
# Every kind the operator renders, and the pods: their events trigger a pass of the owner.
# The kinds a spec may or may not want (render.OPTIONAL_KINDS).
# The InferencePool and HTTPRoute among them: a route's status, written by the Gateway's controller, is reported.
OPTIONAL_RESOURCES = [("policy", "v1", "poddisruptionbudgets"), ("networking.k8s.io", "v1", "networkpolicies"),
                      ("autoscaling", "v2", "horizontalpodautoscalers"), ("keda.sh", "v1alpha1", "scaledobjects"),
                      ("inference.networking.k8s.io", "v1", "inferencepools"),
                      ("gateway.networking.k8s.io", "v1", "httproutes")]
# Kinds whose API a cluster may not serve (CRDs of KEDA, of the Gateway API and its inference extension):
# reported in the status, not retried as errors.
MAYBE_UNSERVED = frozenset({*AUTOSCALER_KINDS.values(), *GATEWAY_KINDS})
CHILD_RESOURCES = [("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "pods"), *OPTIONAL_RESOURCES]
# The model-cache download Jobs: shared, so they name their owners in ownerReferences, not in a label.
DOWNLOAD_JOBS = ("batch", "v1", "jobs")
DOWNLOAD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, prefetch_job.KEY_LABEL: kopf.PRESENT}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(namespace: str, name: str, config: OperatorConfig,
                    optional: kopf.Index[tuple[str, str], str] | None = None) -> dict[str, Any] | None:
    """Read, render, apply, observe, report. Returns the status computed, None when the object is gone.

    `optional`: the optional children that exist, by owner (the `optional_children` index); without
    it every unwanted optional kind is deleted blindly."""
    body = await kube.get("InferenceService", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None  # gone or going: the children follow through their ownerReferences
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as exc:
        return await _report(body, invalid_spec_status(body, str(exc), now=_now()))
    try:
        fetched = await _prefetch(body, spec)
        rendered = render(body, spec, cluster_domain=config.cluster_domain,
                          operator=operator_peer(config.namespace, config.pod_labels),
                          downloaded=fetched is None or fetched.state == "Complete", picker=_picker(config))
        existing = None if optional is None else set(optional.get((namespace, name), ())) | named_in_status(
            body.get("status"))
        for kind, stale in stale_picker(body.get("status"), name, rendered.picker_managed):
            await kube.delete(kind, namespace, stale)
        live, unserved = await _apply(rendered, namespace, name, existing)
    except kube.Invalid as exc:
        # Admitted, but a child is not: content the CRD hands through verbatim (podTemplate,
        # resources, tolerations, affinity, env's valueFrom) is checked only in the child.
        return await _report(body, invalid_spec_status(body, str(exc), now=_now()))
    observed = await _observe(body, rendered, live, config, fetched, unserved)
    return await _report(body, compute_status(body, spec, rendered, observed, now=_now()))


async def _apply(rendered: Rendered, namespace: str, name: str,
                 existing: set[str] | None = None) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """Delete the optional children this spec does not want (of the `existing` kinds, when known),
    server-side apply the others.

    Returns kind -> live object, and the kinds the cluster does not serve (KEDA's ScaledObject
    without KEDA, the InferencePool and HTTPRoute without the Gateway API's CRDs). Deleting first
    lets a new autoscaler take over the scale subresource from the old one (KEDA refuses a target
    that an HPA already scales).
    """
    for kind in rendered.unwanted:
        if existing is None or kind in existing:
            await kube.delete(kind, namespace, name)
    live, unserved = {}, []
    for child in rendered.children:
        if child["metadata"]["name"] != name and "InferencePool" in unserved:
            continue  # the operator's picker (<name>-epp) would serve a pool the cluster cannot hold
        try:
            applied = await kube.apply(child)
        except kube.NotFound:
            if child["kind"] not in MAYBE_UNSERVED:
                raise
            unserved.append(child["kind"])
            continue
        if child["metadata"]["name"] == name:  # not the picker's objects (<name>-epp)
            live[child["kind"]] = applied
    return live, tuple(unserved)


def _picker(config: OperatorConfig) -> PickerConfig:
    return PickerConfig(config.picker_image, tuple(config.picker_args.split()), config.picker_cluster_role)


async def _observe(body: dict[str, Any], rendered: Rendered, live: dict[str, dict[str, Any]],
                   config: OperatorConfig, fetched: Download | None, unserved: tuple[str, ...] = ()) -> Observed:
    meta = body["metadata"]
    pods = await kube.list_pods(meta["namespace"], f"{ISVC_LABEL}={meta['name']}")
    warmup = await kube.fetch_warmup(pods, RUNTIME_PORT, concurrency=config.warmup_concurrency,
                                     timeout=config.warmup_timeout)
    # The start-up timings of the newest ready pod, read once per pod.
    startup = None
    latest = latest_ready_pod(pods, rendered.template_hash)
    if latest is not None and latest["metadata"]["name"] != ((body.get("status") or {}).get("startup") or {}).get("pod"):
        health = await kube.fetch_health(latest, RUNTIME_PORT, timeout=config.warmup_timeout)
        startup = {**health, "pod": latest["metadata"]["name"]} if health else None
    autoscaler = next((live[k] for k in AUTOSCALER_KINDS.values() if k in live), None)
    return Observed(deployment=live.get("Deployment"), pods=pods, warmup=warmup, autoscaler=autoscaler,
                    unserved=unserved, download=fetched, startup=startup, route=live.get("HTTPRoute"))


async def _prefetch(body: dict[str, Any], spec: InferenceServiceSpec) -> Download | None:
    """The model-cache download: create or join its Job, read how far it got. Leaves the Job of an
    earlier model, revision or claim (the status names it) to its other owners, or deletes it."""
    meta = body["metadata"]
    previous = (body.get("status") or {}).get("download") or {}
    job = prefetch_job.render_job(body, spec)
    if previous.get("job") and (job is None or previous["job"] != job["metadata"]["name"]):
        await _leave_job(meta["namespace"], previous["job"], meta["uid"])
    if job is None:
        return None
    live = await _join_job(job)
    key = job["metadata"]["labels"][prefetch_job.KEY_LABEL]
    pods = [p for p in await kube.list_pods(meta["namespace"], f"{prefetch_job.KEY_LABEL}={key}")
            if any(o.get("uid") == live["metadata"].get("uid") for o in p["metadata"].get("ownerReferences") or [])]
    log_pod = prefetch_job.log_pod(live, pods, previous)
    text = await kube.pod_log(meta["namespace"], log_pod, prefetch_job.CONTAINER) if log_pod else None
    return prefetch_job.observe(live, pods, text, previous)


async def _join_job(job: dict[str, Any]) -> dict[str, Any]:
    """The live download Job, created as rendered if absent, else with this InferenceService among
    its owners (a write conditional on the version read: owners joining at once never drop one)."""
    meta, mine = job["metadata"], job["metadata"]["ownerReferences"][0]
    for _ in range(3):
        live = await kube.get("Job", meta["namespace"], meta["name"])
        if live is None:
            try:
                return await kube.create(job)
            except kube.Conflict:
                continue  # created by another owner meanwhile
        if any(o.get("uid") == mine["uid"] for o in prefetch_job.owners(live)):
            return live
        try:
            refs = [*(live["metadata"].get("ownerReferences") or []), mine]
            return await kube.patch_if_unchanged(live, {"metadata": {"ownerReferences": refs}})
        except kube.Conflict:
            continue
    raise kube.Conflict(f"job {meta['name']} kept changing while joining it")


async def _leave_job(namespace: str, name: str, uid: str) -> None:
    """This InferenceService no longer needs the Job: drop its ownerReference, or delete the Job
    if it was the last owner (garbage collection never deletes an object that has no owner left)."""
    for _ in range(3):
        live = await kube.get("Job", namespace, name)
        refs = (live or {}).get("metadata", {}).get("ownerReferences") or []
        if live is None or not any(r.get("uid") == uid for r in refs):
            return
        rest = [r for r in refs if r.get("uid") != uid]
        try:
            if rest:
                await kube.patch_if_unchanged(live, {"metadata": {"ownerReferences": rest}})
            else:
                await kube.delete("Job", namespace, name, resource_version=live["metadata"]["resourceVersion"])
            return
        except kube.Conflict:
            continue


async def _report(body: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """Patch the status if a managed key changed; an Event when the phase changed."""
    meta, old = body["metadata"], body.get("status") or {}
    patch = status_patch(old, new)
    if not patch:
        return new
    if await kube.patch_status(meta["namespace"], meta["name"], patch) is None:
        return None
    if new.get("phase") != old.get("phase"):
        ready = next(c for c in new["conditions"] if c["type"] == "Ready")
        etype = "Warning" if new["phase"] in WARNING_PHASES else "Normal"
        await kube.post_event(body, etype, new["phase"], ready["message"])
    return new


class Reconciler:
    """Serializes runs of `reconcile_one` per object and coalesces triggers that arrive during a run."""

    def __init__(self, reconcile_one: Callable[[str, str], Awaitable[dict[str, Any] | None]]) -> None:
        self._reconcile_one = reconcile_one
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._pending: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, namespace: str, name: str) -> dict[str, Any] | None:
        key = (namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            self._pending.discard(key)
            return await self._reconcile_one(namespace, name)

    def trigger(self, namespace: str, name: str) -> None:
        """Schedule a run in the background (no-op if one is already waiting)."""
        key = (namespace, name)
        if key in self._pending:
            return
        self._pending.add(key)
        task = asyncio.get_running_loop().create_task(self._background(namespace, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background(self, namespace: str, name: str) -> None:
        try:
            await self.run(namespace, name)
        except Exception as exc:
            log.warning("reconcile of %s/%s failed (will retry on the next event or resync): %s",
                        namespace, name, exc)


@kopf.index(GROUP, VERSION, PLURAL)
def inference_services(namespace: str, name: str, **_: Any) -> dict[str, str]:
    """Names of the watched InferenceServices by namespace: the resync's work list.

    Kopf keeps it current (a deleted object drops out) without the finalizer that a
    Kopf timer would put on every object, so a deletion never waits for the operator.
    """
    return {namespace: name}


def optional_children(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], str]:
    """The optional children that exist, as (namespace, owner) -> kind: a pass deletes only those
    its spec no longer wants, instead of a DELETE per absent kind on every pass. A child created
    after the index last saw it triggers the pass that deletes it."""
    owner = labels.get(ISVC_LABEL)
    return {(namespace, owner): body["kind"]} if owner and namespace else {}


for _resource in OPTIONAL_RESOURCES:
    kopf.index(*_resource, labels=CHILD_LABELS, id="optional_children")(optional_children)


async def _resync_loop(reconciler: Reconciler, index: kopf.Index[str, str], interval: float) -> None:
    """Periodic pass over every known object: repairs drift, polls warmup progress."""
    while True:
        await asyncio.sleep(interval)
        for namespace, name in sorted((ns, n) for ns, names in index.items() for n in names):
            reconciler.trigger(namespace, name)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, inference_services: kopf.Index[str, str],
                  optional_children: kopf.Index[tuple[str, str], str], **_: Any) -> None:
    # `gaudi-operator` passes its OperatorConfig in the memo; embedded without one, read the environment.
    config = memo.get("config") or OperatorConfig.from_env()
    # Kopf's bookkeeping lives in annotations, never in our status; no finalizer (no delete handler).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # our own Events, on phase changes only
    settings.execution.max_workers = max(settings.execution.max_workers or 0, 4)
    # Server-side filtering: watch only our children and their pods, not every pod in the cluster.
    for key in [*CHILD_RESOURCES, DOWNLOAD_JOBS]:
        settings.watching.label_selectors[key] = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    settings.watching.server_timeout = config.watch_timeout
    kube.configure()
    memo.reconciler = Reconciler(functools.partial(reconcile, config=config, optional=optional_children))
    memo.resync = asyncio.get_running_loop().create_task(
        _resync_loop(memo.reconciler, inference_services, config.resync_seconds))
    log.info("gaudi-serve operator started (field manager %s, resync %ss)", FIELD_MANAGER, config.resync_seconds)
    if not config.namespace:
        log.info("GAUDI_OPERATOR_NAMESPACE is unset: a spec.networkPolicy will not admit this operator's warmup poll")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("resync") is not None:
        memo.resync.cancel()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else $KUBECONFIG / ~/.kube/config (read at login time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    try:
        await memo.reconciler.run(namespace, name)
    except kube.NotFound:
        return
    except Exception as exc:
        raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=5) from exc


async def on_child(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A child or pod changed: a pass of its owner, named by our label (pods carry no ownerReference to it)."""
    owner = (body.get("metadata", {}).get("labels") or {}).get(ISVC_LABEL)
    if owner and namespace:
        memo.reconciler.trigger(namespace, owner)


async def on_download_job(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A download Job changed (or went): a pass of each InferenceService that owns it."""
    for owner in prefetch_job.owners(dict(body)):
        if namespace and owner.get("name"):
            memo.reconciler.trigger(namespace, owner["name"])


for _resource in CHILD_RESOURCES:
    kopf.on.event(*_resource, labels=CHILD_LABELS)(on_child)
kopf.on.event(*DOWNLOAD_JOBS, labels=DOWNLOAD_LABELS)(on_download_job)
