"""What every component of an InferenceService is (pure: no I/O).

A component is one concern among the children (the workload, its autoscaler, the gateway's pool and
route, the endpoint picker, the model download): a pure render of its objects, the kinds it may own,
and the one condition it reports. What it owns is found, not remembered: the objects of its kinds
that carry its `app.kubernetes.io/component` label and an ownerReference to the InferenceService.
`children.py` applies what a render gives and deletes what a component owns but no longer renders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ..picker import PickerConfig
from ..prefetch_job import Download
from ..render import ISVC_LABEL, MANAGED_BY, labels
from ..spec import InferenceServiceSpec

# Kubernetes' recommended label, already on the download Job (`model-download`).
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

__all__ = ["COMPONENT_LABEL", "Component", "Condition", "Context", "Observed", "Rendered", "Report", "owned",
           "stale", "stamp"]


class Condition(NamedTuple):
    """A condition before it is stamped with its transition time (status.py)."""

    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Context:
    """What every component renders from: the object, its spec and the operator's settings."""

    body: dict[str, Any]
    spec: InferenceServiceSpec
    cluster_domain: str = "cluster.local"
    operator: dict[str, Any] | None = None  # the NetworkPolicy peer of the operator's pods (render.operator_peer)
    picker: PickerConfig = field(default_factory=PickerConfig)
    downloaded: bool = True  # the model-cache download is over (or there is none)

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", ""))

    @property
    def namespace(self) -> str:
        return str((self.body.get("metadata") or {}).get("namespace", ""))

    @property
    def uid(self) -> str:
        return str((self.body.get("metadata") or {}).get("uid") or "")

    def metadata(self) -> dict[str, Any]:
        """A child's metadata: named like its InferenceService, in its namespace, with its labels."""
        return {"name": self.name, "namespace": self.namespace, "labels": labels(self.name)}

    def with_download(self, downloaded: bool) -> Context:
        return replace(self, downloaded=downloaded)


@dataclass(frozen=True)
class Observed:
    """What the reconcile read back after applying: the live Deployment, the pods, their warmup.

    `warmup` maps pod name -> the `warmup` object of that pod's /health answer; `autoscaler` is
    the live HorizontalPodAutoscaler or ScaledObject; `unserved` the kinds the cluster refused
    because it does not serve them (a ScaledObject without KEDA installed, an InferencePool or HTTPRoute
    without the Gateway API's CRDs); `route` the live HTTPRoute of spec.gateway.route; `download` is the
    model-cache download (spec.model.cache.prefetch); `startup` the /health answer of the newest
    ready pod (`latest_ready_pod`), with its name under "pod", when it was read in this pass;
    `children` every live object the apply gave back, by component.
    """

    deployment: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    warmup: dict[str, dict[str, Any]] = field(default_factory=dict)
    autoscaler: dict[str, Any] | None = None
    unserved: tuple[str, ...] = ()
    download: Download | None = None
    startup: dict[str, Any] | None = None
    route: dict[str, Any] | None = None
    children: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rendered:
    """One render of an InferenceService: what to apply, by component, and what status reports."""

    children: list[dict[str, Any]]  # every component's objects, each labelled with its component
    held: tuple[tuple[str, str], ...]  # (kind, name) a component keeps without applying (not stale)
    template_hash: str  # label of the pods that run the current template
    selector: str  # label selector of the pods, for the scale subresource
    url: str  # the Service's in-cluster address
    picker: str | None = None  # with spec.gateway: the picker Service the pool refers to (name:port)
    picker_managed: bool = False  # the operator runs that picker (picker.py)

    def of(self, component: str) -> list[dict[str, Any]]:
        return [c for c in self.children if (c["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == component]


@dataclass(frozen=True)
class Report:
    """A component's condition, and whether the InferenceService is Ready only while it is True."""

    type: str
    condition: Condition
    gates_ready: bool = False


def _nothing(ctx: Context) -> list[dict[str, Any]]:
    return []


def _no_report(ctx: Context, rendered: Rendered, observed: Observed) -> Report | None:
    return None


def _holds_nothing(ctx: Context) -> tuple[tuple[str, str], ...]:
    return ()


def _always(ctx: Context) -> bool:
    return True


@dataclass(frozen=True)
class Component:
    """One concern among the children. Adding a child kind is adding one of these to the registry."""

    name: str  # its app.kubernetes.io/component label
    kinds: tuple[str, ...]  # every kind it may render: where the objects it owns are looked for
    render: Callable[[Context], list[dict[str, Any]]] = _nothing
    report: Callable[[Context, Rendered, Observed], Report | None] = _no_report
    # Objects kept as they are, neither applied nor deleted (the Deployment while a download runs).
    held: Callable[[Context], tuple[tuple[str, str], ...]] = _holds_nothing
    # Whether it can own anything under this operator's settings (no picker image: it never ran one).
    active: Callable[[Context], bool] = _always
    maybe_unserved: frozenset[str] = frozenset()  # kinds a cluster may not serve: reported, not errors
    requires: frozenset[str] = frozenset()  # kinds that, unserved, leave this component nothing to apply
    shared: bool = False  # objects several InferenceServices own (created once, joined, left), not applied
    # Kinds whose events trigger a pass of the owner (None: all of `kinds`).
    watch: tuple[str, ...] | None = None

    @property
    def watched(self) -> tuple[str, ...]:
        return self.kinds if self.watch is None else self.watch

    def selector(self, ctx: Context) -> str:
        """The label selector of the objects it may own (their ownerReferences then decide)."""
        own = f"{MANAGED_BY_LABEL}={MANAGED_BY},{COMPONENT_LABEL}={self.name}"
        return own if self.shared else f"{own},{ISVC_LABEL}={ctx.name}"


def stamp(component: Component, objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects with the component's label (metadata only: pod templates keep their hash)."""
    out = []
    for obj in objects:
        meta = obj["metadata"]
        out.append({**obj, "metadata": {**meta, "labels": {**(meta.get("labels") or {}),
                                                            COMPONENT_LABEL: component.name}}})
    return out


def owned(objects: list[dict[str, Any]], uid: str) -> list[dict[str, Any]]:
    """The objects that name the InferenceService `uid` among their owners: adopted by reference and
    label, whatever pass or operator version created them."""
    return [o for o in objects if any(r.get("uid") == uid for r in (o.get("metadata") or {}).get("ownerReferences") or [])]


def stale(owned_objects: list[dict[str, Any]], rendered: list[dict[str, Any]],
          held: tuple[tuple[str, str], ...] = ()) -> list[dict[str, Any]]:
    """What a component owns but neither rendered nor holds: to delete (or to leave, when shared)."""
    keep = {(o["kind"], o["metadata"]["name"]) for o in rendered} | set(held)
    return [o for o in owned_objects if (o["kind"], o["metadata"]["name"]) not in keep]
