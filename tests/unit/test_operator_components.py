"""The operator's components: Ready from the set of conditions, what each component owns, and a child
kind added as one more component."""

from __future__ import annotations

from typing import Any

import pytest

from gaudi_operator import children, components, handlers, kube
from gaudi_operator.components import (
    COMPONENT_LABEL,
    COMPONENTS,
    Component,
    Condition,
    Context,
    Report,
    render,
)
from gaudi_operator.components.base import owned, stale
from gaudi_operator.config import OperatorConfig
from gaudi_operator.picker import PickerConfig
from gaudi_operator.spec import parse_spec
from gaudi_operator.status import Observed, compute_status, ready_of
from tests.unit.test_operator_handlers import FakeKube, fake  # noqa: F401 (the fixture)
from tests.unit.test_operator_status import NOW, body, ready_pod

SERVING = Condition(True, "AllReplicasReady", "2/2 replicas ready")
ROUTE = {"gateway": {"name": "gw", "namespace": "edge"}}
PICKER = {"service": {"name": "epp"}}


def _cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_ready_is_the_workloads_condition_and_every_gating_one() -> None:
    routed_no = Report("Routed", Condition(False, "RoutePending", "no status yet"), gates_ready=True)
    routed_yes = Report("Routed", Condition(True, "RouteAccepted", "accepted"), gates_ready=True)
    downloading = Report("Downloaded", Condition(False, "Downloading", "next revision"))
    assert ready_of(SERVING, [routed_yes, downloading]) == SERVING  # a download does not gate: old pods serve
    ready = ready_of(SERVING, [downloading, routed_no])
    assert (ready.status, ready.reason) == (False, "RoutePending")
    assert ready.message == "2/2 replicas ready; Routed: no status yet"
    loading = Condition(False, "Loading", "0/2 replicas ready")
    assert ready_of(loading, [routed_no]) == loading  # the workload's reason says the most while it is not serving


@pytest.mark.parametrize("parents,ready,phase", [
    (None, ("False", "RoutePending"), "Pending"),
    ([{"parentRef": {"name": "gw", "namespace": "edge"}, "conditions": [
        {"type": "Accepted", "status": "True", "reason": "Accepted"},
        {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs"}]}], ("True", "AllReplicasReady"), "Ready"),
])
def test_routed_counts_for_ready_when_a_gateway_is_asked_for(parents: list | None, ready: tuple[str, str],
                                                             phase: str) -> None:
    b = body(gateway={"endpointPicker": PICKER, "route": ROUTE})
    spec = parse_spec(b["spec"])
    route = {"status": {"parents": parents}} if parents else None
    status = compute_status(b, spec, render(b, spec), Observed(pods=[ready_pod("a"), ready_pod("b")], route=route),
                            now=NOW)
    assert status["readyReplicas"] == 2
    assert (_cond(status, "Ready")["status"], _cond(status, "Ready")["reason"]) == ready
    assert status["phase"] == phase


def test_without_a_gateway_ready_is_the_workloads() -> None:
    b = body()
    spec = parse_spec(b["spec"])
    status = compute_status(b, spec, render(b, spec), Observed(pods=[ready_pod("a"), ready_pod("b")]), now=NOW)
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}
    assert _cond(status, "Ready")["status"] == "True" and status["phase"] == "Ready"


def test_each_child_is_labelled_with_one_component_that_declares_its_kind() -> None:
    b = body(networkPolicy={}, autoscaling={"maxReplicas": 3}, gateway={"route": ROUTE})
    r = render(b, picker=PickerConfig(image="epp:v1", cluster_role="epp"))
    by_name = {c.name: c for c in COMPONENTS}
    assert len(by_name) == len(COMPONENTS)
    assert {c["metadata"]["labels"][COMPONENT_LABEL] for c in r.children} == {
        "workload", "autoscaler", "gateway", "endpoint-picker"}
    for child in r.children:
        assert child["kind"] in by_name[child["metadata"]["labels"][COMPONENT_LABEL]].kinds
    for c in COMPONENTS:
        assert all(kind in kube._KINDS for kind in c.kinds), c.name  # the I/O layer knows every kind


def test_owned_means_an_owner_reference_to_this_object() -> None:
    def obj(name: str, *uids: str) -> dict[str, Any]:
        return {"kind": "Service", "metadata": {"name": name, "ownerReferences": [{"uid": u} for u in uids]}}
    mine, shared, theirs, orphan = obj("a", "u"), obj("b", "x", "u"), obj("c", "x"), obj("d")
    assert owned([mine, shared, theirs, orphan], "u") == [mine, shared]
    rendered = [{"kind": "Service", "metadata": {"name": "a"}}]
    assert stale([mine, shared], rendered) == [shared]
    assert stale([mine, shared], rendered, held=(("Service", "b"),)) == []


# A child kind the operator does not have: the whole change is this record and its place in the registry.
def _render_config(ctx: Context) -> list[dict[str, Any]]:
    if not ctx.spec.env:
        return []
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": ctx.metadata(), "data": {"env": "set"}}]


CONFIG_MAP = Component("settings", ("ConfigMap",), render=_render_config)


async def test_a_new_child_kind_is_one_more_component(fake: FakeKube,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components, "COMPONENTS", (*COMPONENTS, CONFIG_MAP))
    monkeypatch.setattr(children, "COMPONENTS", (*COMPONENTS, CONFIG_MAP))
    assert fake.body is not None
    fake.body["spec"]["env"] = [{"name": "A", "value": "1"}]
    await handlers.reconcile("ml", "llama", OperatorConfig())
    (cm,) = [c for c in fake.applied if c["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"][COMPONENT_LABEL] == "settings"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "u"  # owned, adopted by the next pass
    del fake.body["spec"]["env"]
    await handlers.reconcile("ml", "llama", OperatorConfig())
    assert fake.deleted == [("ConfigMap", "ml", "llama")]


@pytest.mark.parametrize("engine,unserved,live,want", [
    ("hpa", (), None, ("True", "AutoscalerApplied")),
    ("hpa", (), {"metadata": {"name": "llama"}, "status": {"conditions": [{"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
                                            "message": "no metrics"}]}}, ("False", "FailedGetPodsMetric")),
    ("keda", ("ScaledObject",), None, ("False", "AutoscalerNotInstalled")),
])
def test_the_autoscaler_reports_whether_it_scales_without_gating_ready(engine: str, unserved: tuple, live: dict | None,
                                                                      want: tuple[str, str]) -> None:
    autoscaling: dict[str, Any] = {"maxReplicas": 3, "engine": engine}
    if engine == "keda":
        autoscaling["prometheus"] = {"serverAddress": "http://prometheus:9090"}
    b = body(autoscaling=autoscaling)
    spec = parse_spec(b["spec"])
    observed = Observed(pods=[ready_pod("a"), ready_pod("b")], autoscaler=live, unserved=unserved)
    status = compute_status(b, spec, render(b, spec), observed, now=NOW)
    assert (_cond(status, "Autoscaled")["status"], _cond(status, "Autoscaled")["reason"]) == want
    assert _cond(status, "Ready")["status"] == "True"


async def test_the_operators_picker_reports_whether_a_pod_of_it_is_available(
        fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    assert fake.body is not None
    config = OperatorConfig(picker_image="registry.example/epp:v1", picker_cluster_role="gso-endpoint-picker")
    fake.body["spec"]["gateway"] = {}
    status = await handlers.reconcile("ml", "llama", config)
    assert status is not None
    picker = _cond(status, "EndpointPickerAvailable")
    assert (picker["status"], picker["reason"]) == ("False", "PickerUnavailable")
    assert picker["message"] == "Deployment llama-epp: 0/1 replicas available"
    apply = fake.apply

    async def available(obj: dict[str, Any]) -> dict[str, Any]:
        live = await apply(obj)
        return {**live, "status": {"availableReplicas": 1}} if obj["metadata"]["name"] == "llama-epp" else live
    monkeypatch.setattr(kube, "apply", available)
    status = await handlers.reconcile("ml", "llama", config)
    assert status is not None and _cond(status, "EndpointPickerAvailable")["status"] == "True"
    fake.body["spec"]["gateway"] = {"endpointPicker": {"service": {"name": "mine"}}}  # a picker of the user's
    status = await handlers.reconcile("ml", "llama", config)
    assert status is not None and "EndpointPickerAvailable" not in {c["type"] for c in status["conditions"]}
