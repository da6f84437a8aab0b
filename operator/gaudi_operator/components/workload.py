"""The workload: the Deployment of the serving pods, their Service, the disruption budget and the
NetworkPolicy (render.py builds each). Its condition is the fleet's readiness, which status.py counts
from the pods, and on which the InferenceService's Ready rests."""

from __future__ import annotations

from typing import Any

from ..render import render_deployment, render_network_policy, render_pdb, render_service
from .base import Component, Context


def _render(ctx: Context) -> list[dict[str, Any]]:
    spec = ctx.spec
    out = [render_deployment(ctx.body, spec)] if ctx.downloaded else []
    out.append(render_service(ctx.body, spec))
    # Autoscaled: the PDB stays whatever the current count, instead of coming and going with it.
    if spec.replicas > 1 or (spec.autoscaling is not None and spec.autoscaling.max_replicas > 1):
        out.append(render_pdb(ctx.body, spec))
    if spec.network_policy is not None:
        out.append(render_network_policy(ctx.body, spec, ctx.operator))
    return out


def _held(ctx: Context) -> tuple[tuple[str, str], ...]:
    """While the model downloads, the Deployment is neither changed nor deleted: pods of an earlier
    template keep serving, a first start waits."""
    return () if ctx.downloaded else (("Deployment", ctx.name),)


WORKLOAD = Component("workload", ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"),
                     render=_render, held=_held)
