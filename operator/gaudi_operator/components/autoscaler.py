"""spec.autoscaling: the HorizontalPodAutoscaler or KEDA ScaledObject (autoscaling.py) that scales the
InferenceService, and the Autoscaled condition: whether the autoscaler says it can scale. Its figures
reach status.autoscaling; a ScaledObject the cluster does not serve is also Degraded
(AutoscalerNotInstalled). Not a gate of Ready: the replicas serve at spec.replicas meanwhile."""

from __future__ import annotations

from typing import Any

from ..autoscaling import KINDS, render_autoscaler
from .base import Component, Condition, Context, Observed, Rendered, Report

# The autoscaler's own conditions that, False, mean it does not scale (HPA; KEDA's Ready).
_BLOCKING = {"HorizontalPodAutoscaler": ("AbleToScale", "ScalingActive"), "ScaledObject": ("Ready",)}


def _render(ctx: Context) -> list[dict[str, Any]]:
    return render_autoscaler(ctx.metadata(), ctx.spec)


def _report(ctx: Context, rendered: Rendered, observed: Observed) -> Report | None:
    a = ctx.spec.autoscaling
    if a is None:
        return None
    kind = KINDS[a.engine]
    if kind in observed.unserved:
        return Report("Autoscaled", Condition(False, "AutoscalerNotInstalled", f"this cluster does not serve {kind}"))
    what = f"{kind}/{ctx.name} scales {a.min_replicas}..{a.max_replicas} replicas"
    conds = {c.get("type"): c for c in ((observed.autoscaler or {}).get("status") or {}).get("conditions") or []}
    for ctype in _BLOCKING[kind]:
        cond = conds.get(ctype) or {}
        if cond.get("status") == "False":
            return Report("Autoscaled", Condition(False, str(cond.get("reason") or ctype),
                                                  f"{what}, but {ctype} is False: {cond.get('message', '')}"))
    return Report("Autoscaled", Condition(True, "AutoscalerApplied", what))


AUTOSCALER = Component("autoscaler", tuple(KINDS.values()), render=_render, report=_report,
                       maybe_unserved=frozenset(KINDS.values()))
