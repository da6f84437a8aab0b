"""spec.gateway: the InferencePool and HTTPRoute (gateway.py), and the Routed condition, which Ready
waits for: a service asked to be reached through a gateway is not ready until it is."""

from __future__ import annotations

from typing import Any

from ..gateway import KINDS, render_gateway, routed
from ..picker import picker_ref
from ..render import selector_labels
from .base import Component, Condition, Context, Observed, Rendered, Report


def _render(ctx: Context) -> list[dict[str, Any]]:
    return render_gateway(ctx.metadata(), ctx.spec, selector_labels(ctx.name), picker_ref(ctx.spec, ctx.name, ctx.picker))


def _report(ctx: Context, rendered: Rendered, observed: Observed) -> Report | None:
    route = routed(ctx.spec, ctx.name, ctx.namespace, observed.unserved, observed.route, rendered.picker)
    return None if route is None else Report("Routed", Condition(*route), gates_ready=True)


GATEWAY = Component("gateway", KINDS, render=_render, report=_report, maybe_unserved=frozenset(KINDS))
