"""Creating, applying and deleting the children: the one place the operator writes them.

Per component (components/), in the registry's order: find what it owns (its kinds, listed by its
label, kept where an ownerReference names this InferenceService), delete what it owns but no longer
renders, then server-side apply what it renders. Deleting first lets a new autoscaler take the
scale subresource over from the old one (KEDA refuses a target an HPA already scales). A shared
component's objects (the download Job) are created once and joined, and left instead of deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from . import kube, prefetch_job
from .components import COMPONENTS, Component, Context, Rendered, render_one
from .components.base import owned, stale

log = logging.getLogger(__name__)

__all__ = ["Applied", "find_owned", "sync", "sync_shared"]


@dataclass
class Applied:
    """What the apply gave back: each component's live objects by kind (those named like the service),
    and the kinds the cluster does not serve."""

    live: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    unserved: list[str] = field(default_factory=list)
    objects: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # every live object, by component

    def get(self, component: Component, kind: str) -> dict[str, Any] | None:
        return self.live.get(component.name, {}).get(kind)


async def find_owned(component: Component, ctx: Context) -> list[dict[str, Any]]:
    """The objects `component` owns for this InferenceService: its label, and an ownerReference to it."""
    found = []
    for kind in component.kinds:
        found += await kube.list_objects(kind, ctx.namespace, component.selector(ctx))
    return owned(found, ctx.uid)


async def sync(ctx: Context, rendered: Rendered) -> Applied:
    """Every component that is not shared: delete its stale objects, apply the rest."""
    out = Applied()
    for component in COMPONENTS:
        if component.shared or not component.active(ctx) or component.requires & set(out.unserved):
            continue
        for obj in stale(await find_owned(component, ctx), rendered.of(component.name), rendered.held):
            log.info("deleting %s %s/%s: component %s no longer renders it", obj["kind"], ctx.namespace,
                     obj["metadata"]["name"], component.name)
            await kube.delete(obj["kind"], ctx.namespace, obj["metadata"]["name"])
        await _apply(component, ctx, rendered.of(component.name), out)
    return out


async def _apply(component: Component, ctx: Context, objects: list[dict[str, Any]], out: Applied) -> None:
    for obj in objects:
        try:
            applied = await kube.apply(obj)
        except kube.NotFound:
            if obj["kind"] not in component.maybe_unserved:
                raise
            out.unserved.append(obj["kind"])
            continue
        out.objects.setdefault(component.name, []).append(applied)
        if obj["metadata"]["name"] == ctx.name:
            out.live.setdefault(component.name, {})[obj["kind"]] = applied


async def sync_shared(component: Component, ctx: Context) -> dict[str, Any] | None:
    """A shared component's one object: leave those it owned but no longer renders, create or join
    the rendered one. Returns it live (None when nothing is rendered)."""
    wanted = render_one(component, ctx)
    for obj in stale(await find_owned(component, ctx), wanted):
        await _leave(obj["kind"], ctx.namespace, obj["metadata"]["name"], ctx.uid)
    return await _join(wanted[0]) if wanted else None


async def _join(obj: dict[str, Any]) -> dict[str, Any]:
    """The live object, created as rendered if absent, else with this InferenceService among its
    owners (a write conditional on the version read: owners joining at once never drop one)."""
    meta, mine = obj["metadata"], obj["metadata"]["ownerReferences"][0]
    for _ in range(3):
        live = await kube.get(obj["kind"], meta["namespace"], meta["name"])
        if live is None:
            try:
                return await kube.create(obj)
            except kube.Conflict:
                continue  # created by another owner meanwhile
        if any(o.get("uid") == mine["uid"] for o in prefetch_job.owners(live)):
            return live
        try:
            refs = [*(live["metadata"].get("ownerReferences") or []), mine]
            return await kube.patch_if_unchanged(live, {"metadata": {"ownerReferences": refs}})
        except kube.Conflict:
            continue
    raise kube.Conflict(f"{obj['kind']} {meta['name']} kept changing while joining it")


async def _leave(kind: str, namespace: str, name: str, uid: str) -> None:
    """This InferenceService no longer needs the object: drop its ownerReference, or delete the object
    if it was the last owner (garbage collection never deletes an object that has no owner left)."""
    for _ in range(3):
        live = await kube.get(kind, namespace, name)
        refs = (live or {}).get("metadata", {}).get("ownerReferences") or []
        if live is None or not any(r.get("uid") == uid for r in refs):
            return
        rest = [r for r in refs if r.get("uid") != uid]
        try:
            if rest:
                await kube.patch_if_unchanged(live, {"metadata": {"ownerReferences": rest}})
            else:
                await kube.delete(kind, namespace, name, resource_version=live["metadata"]["resourceVersion"])
            return
        except kube.Conflict:
            continue
