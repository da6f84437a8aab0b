"""The endpoint picker the operator runs for a spec.gateway that names none (picker.py): its
ServiceAccount, RoleBinding, Deployment and Service `<name>-epp`. Nothing to run where the cluster
does not serve the InferencePool it would serve, nothing ever run without the chart's image."""

from __future__ import annotations

from typing import Any

from ..picker import KINDS, render_picker
from .base import Component, Context


def _render(ctx: Context) -> list[dict[str, Any]]:
    return render_picker(ctx.metadata(), ctx.spec, ctx.picker)


def _active(ctx: Context) -> bool:
    return bool(ctx.picker.image)  # the chart grants the picker's kinds only with an image


PICKER = Component("endpoint-picker", KINDS, render=_render, active=_active,
                   requires=frozenset({"InferencePool"}),
                   watch=("Deployment", "Service"))  # the chart grants no watch of ServiceAccounts, RoleBindings
