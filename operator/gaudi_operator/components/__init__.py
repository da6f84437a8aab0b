"""The components of an InferenceService, and the render of all of them (pure).

Each component (base.Component) renders its own objects, owns what carries its
`app.kubernetes.io/component` label and an ownerReference to the InferenceService, and reports at
most one condition. `COMPONENTS` is the registry, in the order a pass applies them: the download
first (the Deployment waits for it), the pool before its picker (a picker is not run for a pool the
cluster cannot hold). A new child kind is a new component here: its file and a line below.
"""

from __future__ import annotations

from typing import Any

import kopf

from ..picker import PickerConfig, picker_ref
from ..render import TEMPLATE_HASH_LABEL, pod_template, selector_string, service_url
from ..spec import InferenceServiceSpec, parse_spec
from .autoscaler import AUTOSCALER
from .base import COMPONENT_LABEL, Component, Condition, Context, Observed, Rendered, Report, stamp
from .download import DOWNLOAD
from .gateway import GATEWAY
from .picker import PICKER
from .workload import WORKLOAD

COMPONENTS: tuple[Component, ...] = (DOWNLOAD, WORKLOAD, AUTOSCALER, GATEWAY, PICKER)

__all__ = ["COMPONENTS", "COMPONENT_LABEL", "Component", "Condition", "Context", "Observed", "Rendered", "Report",
           "render", "render_context", "render_one", "reports"]


def render_one(component: Component, ctx: Context) -> list[dict[str, Any]]:
    """A component's objects, labelled with it; those it alone owns with a controller reference
    (garbage collection removes them with their owner, blockOwnerDeletion keeps a foreground delete
    waiting for them). Shared objects carry the plain ownerReference their render gave them."""
    objects = stamp(component, component.render(ctx))
    if not component.shared:
        kopf.append_owner_reference(objects, owner=ctx.body, controller=True, block_owner_deletion=True)
    return objects


def render_context(ctx: Context) -> Rendered:
    """Every component's objects (the shared download Job aside: it is created or joined before the
    render, which it decides) and the facts the status reports about them."""
    ref = picker_ref(ctx.spec, ctx.name, ctx.picker)
    children = [o for c in COMPONENTS if not c.shared for o in render_one(c, ctx)]
    return Rendered(
        children=children,
        held=tuple(h for c in COMPONENTS for h in c.held(ctx)),
        template_hash=pod_template(ctx.body, ctx.spec)["metadata"]["labels"][TEMPLATE_HASH_LABEL],
        selector=selector_string(ctx.name),
        url=service_url(ctx.name, ctx.namespace, ctx.spec, ctx.cluster_domain),
        picker=f"{ref[0]}:{ref[1]}" if ref else None,
        picker_managed=any(o["metadata"]["labels"][COMPONENT_LABEL] == PICKER.name for o in children),
    )


def render(body: dict[str, Any], spec: InferenceServiceSpec | None = None, *,
           cluster_domain: str = "cluster.local", operator: dict[str, Any] | None = None,
           downloaded: bool = True, picker: PickerConfig | None = None) -> Rendered:
    """All children of an InferenceService `body`.

    `body` needs apiVersion, kind and metadata name, namespace and uid: the children's
    owner reference is built from them. `operator` is the NetworkPolicy peer of the
    operator's pods (`render.operator_peer`), admitted by a NetworkPolicy for the warmup poll.
    `downloaded` False (the model-cache download is not over) leaves the Deployment out: it is
    neither created nor changed, so a first start waits and pods of an earlier template keep serving.
    `picker`: the picker the operator runs for a spec.gateway that names none (the chart's image).
    """
    ctx = Context(body, spec or parse_spec(body.get("spec")), cluster_domain, operator, picker or PickerConfig(),
                  downloaded)
    return render_context(ctx)


def reports(ctx: Context, rendered: Rendered, observed: Observed) -> list[Report]:
    """Each component's condition, in the registry's order."""
    return [r for c in COMPONENTS if (r := c.report(ctx, rendered, observed)) is not None]
