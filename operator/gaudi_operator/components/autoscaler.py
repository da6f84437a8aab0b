"""spec.autoscaling: the HorizontalPodAutoscaler or KEDA ScaledObject (autoscaling.py) that scales the
InferenceService. Its state reaches status.autoscaling; a ScaledObject the cluster does not serve,
Degraded (AutoscalerNotInstalled)."""

from __future__ import annotations

from typing import Any

from ..autoscaling import KINDS, render_autoscaler
from .base import Component, Context


def _render(ctx: Context) -> list[dict[str, Any]]:
    return render_autoscaler(ctx.metadata(), ctx.spec)


AUTOSCALER = Component("autoscaler", tuple(KINDS.values()), render=_render,
                       maybe_unserved=frozenset(KINDS.values()))
