"""Kopf handlers: thin triggers around one idempotent `reconcile(namespace, name)`.

Triggers: create/update/resume of an InferenceService, any event of a child
(Deployment, Service, PodDisruptionBudget) or pod carrying our labels, and a
resync timer that also polls warmup progress of warming pods. Runs for the
same object are serialized; a trigger arriving during a run causes one more
run after it, never a pile-up.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from typing import Any

import kopf

from . import kube
from .render import ISVC_LABEL, MANAGED_BY, render
from .spec import FIELD_MANAGER, GROUP, PLURAL, RUNTIME_PORT, VERSION, SpecError, parse_spec
from .status import compute_status, status_patch

log = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("GAUDI_OPERATOR_RESYNC_SECONDS", "15"))
CLUSTER_DOMAIN = os.environ.get("GAUDI_OPERATOR_CLUSTER_DOMAIN", "cluster.local")
WARMUP_CONCURRENCY = int(os.environ.get("GAUDI_OPERATOR_WARMUP_CONCURRENCY", "8"))
WARMUP_TIMEOUT = float(os.environ.get("GAUDI_OPERATOR_WARMUP_TIMEOUT", "2"))
CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY, ISVC_LABEL: kopf.PRESENT}
WARNING_PHASES = ("Degraded", "Failed")
CHILD_RESOURCES = [("apps", "v1", "deployments"), ("", "v1", "services"),
                   ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "pods")]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(namespace: str, name: str) -> dict[str, Any] | None:
    """Render + apply the children, observe them, patch the status if it changed. Idempotent."""
    body = await kube.get("InferenceService", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None  # gone or going: the children follow through their ownerReferences
    try:
        spec, spec_error = parse_spec(body.get("spec")), None
    except SpecError as exc:
        spec, spec_error = None, str(exc)

    deployment = None
    if spec is not None:
        children = render(body, spec)
        for child in children:
            live = await kube.apply(child)
            if child["kind"] == "Deployment":
                deployment = live
        if not any(c["kind"] == "PodDisruptionBudget" for c in children):
            await kube.delete("PodDisruptionBudget", namespace, name)

    pods = await kube.list_pods(namespace, f"{ISVC_LABEL}={name}")
    warmup = await kube.fetch_warmup(pods, RUNTIME_PORT, concurrency=WARMUP_CONCURRENCY, timeout=WARMUP_TIMEOUT)
    new = compute_status(body, spec, deployment, pods, warmup, now=_now(), spec_error=spec_error,
                         cluster_domain=CLUSTER_DOMAIN)
    old = body.get("status") or {}
    patch = status_patch(old, new)
    if patch:
        if await kube.patch_status(namespace, name, patch) is None:
            return None
        if new.get("phase") != old.get("phase"):
            ready = next(c for c in new["conditions"] if c["type"] == "Ready")
            etype = "Warning" if new["phase"] in WARNING_PHASES else "Normal"
            await kube.post_event(body, etype, new["phase"], ready["message"])
    return new


class Reconciler:
    """Serializes runs per object and coalesces triggers that arrive during a run."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._pending: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.known: set[tuple[str, str]] = set()

    async def run(self, namespace: str, name: str) -> dict[str, Any] | None:
        key = (namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            self._pending.discard(key)
            return await reconcile(namespace, name)

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


reconciler = Reconciler()
_resync_task: asyncio.Task[None] | None = None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Kopf's bookkeeping lives in annotations, never in our status; no finalizer (no delete handler).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # our own Events, on phase changes only
    settings.execution.max_workers = max(settings.execution.max_workers or 0, 4)
    # Server-side filtering: watch only our children and their pods, not every pod in the cluster.
    for key in CHILD_RESOURCES:
        settings.watching.label_selectors[key] = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    settings.watching.server_timeout = int(os.environ.get("GAUDI_OPERATOR_WATCH_TIMEOUT", "300"))
    kube.configure()
    global _resync_task
    _resync_task = asyncio.get_running_loop().create_task(_resync_loop())
    log.info("gaudi-serve operator started (field manager %s, resync %ss)", FIELD_MANAGER, RESYNC_SECONDS)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if _resync_task is not None:
        _resync_task.cancel()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, else $KUBECONFIG / ~/.kube/config (read at login time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(namespace: str, name: str, **_: Any) -> None:
    try:
        await reconciler.run(namespace, name)
    except kube.NotFound:
        return
    except Exception as exc:
        raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=5) from exc


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track(type: str | None, namespace: str, name: str, **_: Any) -> None:
    """Keep the set of objects to resync (no finalizer: Kopf timers would need one)."""
    if type == "DELETED":
        reconciler.known.discard((namespace, name))
    else:
        reconciler.known.add((namespace, name))


async def _resync_loop() -> None:
    """Periodic reconcile of every known object: repairs drift, polls warmup progress."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for namespace, name in sorted(reconciler.known):
            reconciler.trigger(namespace, name)


def _owner_event(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(ISVC_LABEL)
    if owner and namespace:
        reconciler.trigger(namespace, owner)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def on_deployment(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    _owner_event(body, namespace)


@kopf.on.event("", "v1", "services", labels=CHILD_LABELS)
async def on_service(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    _owner_event(body, namespace)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def on_pdb(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    _owner_event(body, namespace)


@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
async def on_pod(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    _owner_event(body, namespace)
