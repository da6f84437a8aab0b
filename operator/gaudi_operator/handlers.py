"""Kopf handlers: thin triggers around one idempotent pass per InferenceService.

The pass (`reconcile`) goes one way through the data and never back: read the
object, render its children (one component each concern, components/), apply them and
delete what a component owns but no longer renders (children.py), observe what the cluster
made of them, report the status. The shared model-cache download Job comes first: the
Deployment waits for it. Triggers: create/update/resume of an InferenceService, any event of
a component's kind or a pod carrying our labels, of a download Job (its owners' passes), and a
resync timer that also polls warmup progress of warming pods and a download's progress.
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

from . import children, kube, prefetch_job
from .components import COMPONENT_LABEL, COMPONENTS, Context, Observed, Rendered, render_context
from .components.autoscaler import AUTOSCALER
from .components.download import DOWNLOAD
from .components.gateway import GATEWAY
from .components.workload import WORKLOAD
from .config import OperatorConfig
from .picker import PickerConfig
from .prefetch_job import Download
from .render import ISVC_LABEL, MANAGED_BY, operator_peer
from .spec import FIELD_MANAGER, GROUP, PLURAL, RUNTIME_PORT, VERSION, SpecError, parse_spec
from .status import compute_status, invalid_spec_status, latest_ready_pod, status_patch

log = logging.getLogger(__name__)

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, ISVC_LABEL: kopf.PRESENT}
WARNING_PHASES = ("Degraded", "Failed")
# The kinds whose events trigger a pass of their owner: every component's (components/), and the pods.
# The components' own objects by our labels; the shared ones (the download Jobs) name their owners in
# ownerReferences, not in a label.
CHILD_RESOURCES = [("", "v1", "pods"), *dict.fromkeys(
    kube.resource(k) for c in COMPONENTS if not c.shared for k in c.watched)]
SHARED_RESOURCES = {kube.resource(k): {"app.kubernetes.io/managed-by": MANAGED_BY, COMPONENT_LABEL: c.name}
                    for c in COMPONENTS if c.shared for k in c.watched}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(namespace: str, name: str, config: OperatorConfig) -> dict[str, Any] | None:
    """Read, (download,) render, apply, observe, report. Returns the status computed, None when the object is gone."""
    body = await kube.get("InferenceService", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None  # gone or going: the children follow through their ownerReferences
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as exc:
        return await _report(body, invalid_spec_status(body, str(exc), now=_now()))
    ctx = Context(body, spec, config.cluster_domain, operator_peer(config.namespace, config.pod_labels),
                  _picker(config))
    try:
        fetched = await _prefetch(ctx)
        ctx = ctx.with_download(fetched is None or fetched.state == "Complete")
        rendered = render_context(ctx)
        applied = await children.sync(ctx, rendered)
    except kube.Invalid as exc:
        # Admitted, but a child is not: content the CRD hands through verbatim (podTemplate,
        # resources, tolerations, affinity, env's valueFrom) is checked only in the child.
        return await _report(body, invalid_spec_status(body, str(exc), now=_now()))
    observed = await _observe(ctx, rendered, applied, config, fetched)
    return await _report(body, compute_status(body, spec, rendered, observed, now=_now(), context=ctx))


def _picker(config: OperatorConfig) -> PickerConfig:
    return PickerConfig(config.picker_image, tuple(config.picker_args.split()), config.picker_cluster_role)


async def _observe(ctx: Context, rendered: Rendered, applied: children.Applied, config: OperatorConfig,
                   fetched: Download | None) -> Observed:
    pods = await kube.list_pods(ctx.namespace, f"{ISVC_LABEL}={ctx.name}")
    warmup = await kube.fetch_warmup(pods, RUNTIME_PORT, concurrency=config.warmup_concurrency,
                                     timeout=config.warmup_timeout)
    # The start-up timings of the newest ready pod, read once per pod.
    startup = None
    latest = latest_ready_pod(pods, rendered.template_hash)
    if latest is not None and latest["metadata"]["name"] != ((ctx.body.get("status") or {}).get("startup") or {}).get("pod"):
        health = await kube.fetch_health(latest, RUNTIME_PORT, timeout=config.warmup_timeout)
        startup = {**health, "pod": latest["metadata"]["name"]} if health else None
    autoscaler = next(iter(applied.live.get(AUTOSCALER.name, {}).values()), None)
    return Observed(deployment=applied.get(WORKLOAD, "Deployment"), pods=pods, warmup=warmup, autoscaler=autoscaler,
                    unserved=tuple(applied.unserved), download=fetched, startup=startup,
                    route=applied.get(GATEWAY, "HTTPRoute"), children=applied.objects)


async def _prefetch(ctx: Context) -> Download | None:
    """The model-cache download: create or join its Job (leaving those of an earlier model, revision
    or claim), read how far it got."""
    live = await children.sync_shared(DOWNLOAD, ctx)
    if live is None:
        return None
    previous = (ctx.body.get("status") or {}).get("download") or {}
    key = live["metadata"]["labels"][prefetch_job.KEY_LABEL]
    pods = [p for p in await kube.list_pods(ctx.namespace, f"{prefetch_job.KEY_LABEL}={key}")
            if any(o.get("uid") == live["metadata"].get("uid") for o in p["metadata"].get("ownerReferences") or [])]
    log_pod = prefetch_job.log_pod(live, pods, previous)
    text = await kube.pod_log(ctx.namespace, log_pod, prefetch_job.CONTAINER) if log_pod else None
    return prefetch_job.observe(live, pods, text, previous)


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


async def _resync_loop(reconciler: Reconciler, index: kopf.Index[str, str], interval: float) -> None:
    """Periodic pass over every known object: repairs drift, polls warmup progress."""
    while True:
        await asyncio.sleep(interval)
        for namespace, name in sorted((ns, n) for ns, names in index.items() for n in names):
            reconciler.trigger(namespace, name)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, inference_services: kopf.Index[str, str],
                  **_: Any) -> None:
    # `gaudi-operator` passes its OperatorConfig in the memo; embedded without one, read the environment.
    config = memo.get("config") or OperatorConfig.from_env()
    # Kopf's bookkeeping lives in annotations, never in our status; no finalizer (no delete handler).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # our own Events, on phase changes only
    settings.execution.max_workers = max(settings.execution.max_workers or 0, 4)
    # Server-side filtering: watch only our children and their pods, not every pod in the cluster.
    for key in [*CHILD_RESOURCES, *SHARED_RESOURCES]:
        settings.watching.label_selectors[key] = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    settings.watching.server_timeout = config.watch_timeout
    kube.configure()
    memo.reconciler = Reconciler(functools.partial(reconcile, config=config))
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


async def on_shared_child(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A shared child (a download Job) changed (or went): a pass of each InferenceService that owns it."""
    for owner in prefetch_job.owners(dict(body)):
        if namespace and owner.get("name"):
            memo.reconciler.trigger(namespace, owner["name"])


for _resource in CHILD_RESOURCES:
    kopf.on.event(*_resource, labels=CHILD_LABELS)(on_child)
for _resource, _labels in SHARED_RESOURCES.items():
    kopf.on.event(*_resource, labels=_labels)(on_shared_child)
