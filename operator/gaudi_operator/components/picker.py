"""The endpoint picker the operator runs for a spec.gateway that names none (picker.py): its
ServiceAccount, RoleBinding, Deployment and Service `<name>-epp`. Nothing to run where the cluster
does not serve the InferencePool it would serve, nothing ever run without the chart's image."""

from __future__ import annotations

from typing import Any

from ..picker import KINDS, picker_name, render_picker
from .base import Component, Condition, Context, Observed, Rendered, Report


def _render(ctx: Context) -> list[dict[str, Any]]:
    return render_picker(ctx.metadata(), ctx.spec, ctx.picker)


def _report(ctx: Context, rendered: Rendered, observed: Observed) -> Report | None:
    """Whether the picker the operator runs has a pod available (the gateway asks it for every request).
    Nothing to say of a picker it does not run, or did not apply (no pool to serve: Routed says why)."""
    name = picker_name(ctx.name)
    live = next((o for o in observed.children.get(PICKER_COMPONENT, []) if o["kind"] == "Deployment"), None)
    if not rendered.picker_managed or live is None:
        return None
    available = int((live.get("status") or {}).get("availableReplicas") or 0)
    wanted = int((live.get("spec") or {}).get("replicas") or 1)
    what = f"Deployment {name}: {available}/{wanted} replicas available"
    if available:
        return Report("EndpointPickerAvailable", Condition(True, "PickerAvailable", what))
    return Report("EndpointPickerAvailable", Condition(False, "PickerUnavailable", what))


def _active(ctx: Context) -> bool:
    return bool(ctx.picker.image)  # the chart grants the picker's kinds only with an image


PICKER_COMPONENT = "endpoint-picker"
PICKER = Component(PICKER_COMPONENT, KINDS, render=_render, report=_report, active=_active,
                   requires=frozenset({"InferencePool"}),
                   watch=("Deployment", "Service"))  # the chart grants no watch of ServiceAccounts, RoleBindings
