"""spec.kvCache.offload through the operator (pure parts): the runtime's KV_OFFLOADING_* settings, the disk
tier's volume and mount, the host tier counted in the pod's memory, and status.kvCache once a pod serves."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import kubernetes_validate
import pytest

from gaudi_operator.components import render
from gaudi_operator.quantity import add, bytes_of, format_bytes, gib_text
from gaudi_operator.render import TEMPLATE_HASH_LABEL, pod_template
from gaudi_operator.spec import parse_spec
from gaudi_operator.status import Observed, compute_status, status_patch

K8S_VERSION = "1.37.0"
NOW = "2026-01-01T00:00:00Z"
CLAIM = {"persistentVolumeClaim": {"claimName": "models"}}


def body(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    b = {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 1},
         "spec": {"model": {"id": "org/llama"}, **spec}}
    if status is not None:
        b["status"] = status
    return b


def template(**spec: Any) -> dict[str, Any]:
    b = body(**spec)
    return pod_template(b, parse_spec(b["spec"]))


def container(**spec: Any) -> dict[str, Any]:
    return template(**spec)["spec"]["containers"][0]


def env(**spec: Any) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(**spec)["env"]}


def offload(host: str = "64Gi", **disk: Any) -> dict[str, Any]:
    return {"offload": {"hostMemory": host, **({"disk": disk} if disk else {})}}


@pytest.mark.parametrize("quantity,expected", [
    ("16Gi", 16 * 2**30), ("512Mi", 2**29), ("100G", 10**11), ("1.5Ti", 3 * 2**39), ("64000M", 64 * 10**9),
    ("17179869184", 2**34), (8, 8), ("100m", Decimal("0.1")), ("1e3", 1000), ("2k", 2000), (".5Ki", 512)])
def test_quantities_read_as_the_api_server_reads_them(quantity: Any, expected: Any) -> None:
    assert bytes_of(quantity) == Decimal(expected)


def test_quantity_sums_and_gib() -> None:
    assert add("64Gi", 16 * 2**30) == "80Gi"
    assert add("1Ti", 2**30) == "1025Gi"
    assert add("64000M", 2**30) == "63548576Ki"  # exact, in the largest unit that writes it so
    assert add("1", 2) == "3"
    assert add(0, 512 * 2**20) == "512Mi"
    assert format_bytes(Decimal("0.1")) == "1"  # never a fraction of a byte: rounded up
    assert [gib_text(bytes_of(q)) for q in ("16Gi", "512Mi", "100G", "1Mi")] == ["16", "0.5", "93.132257", "0.000976"]
    with pytest.raises(ValueError):
        bytes_of("lots")


def test_no_offload_renders_the_same_pod() -> None:
    """An InferenceService written before spec.kvCache existed keeps its pods (no rollout on upgrade)."""
    plain = template()
    assert template(kvCache={}) == plain
    assert not [e for e in plain["spec"]["containers"][0]["env"] if e["name"].startswith("KV_OFFLOADING")]
    assert "memory" not in plain["spec"]["containers"][0]["resources"]["requests"]


def test_a_host_tier_is_the_runtimes_setting_and_the_pods_memory() -> None:
    c = container(kvCache=offload("64Gi"))
    assert {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("KV_")} == {"KV_OFFLOADING_SIZE": "64"}
    assert c["resources"]["requests"]["memory"] == "64Gi"
    assert "memory" not in c["resources"]["limits"]  # the operator sets no limit of its own
    assert not [m for m in c["volumeMounts"] if m["mountPath"] == "/kv-cache"]


@pytest.mark.parametrize("resources,request_,limit", [
    ({"requests": {"memory": "100Gi", "cpu": 16}}, "164Gi", None),
    ({"requests": {"memory": "100Gi"}, "limits": {"memory": "200Gi"}}, "164Gi", "264Gi"),
    ({"limits": {"memory": "128Gi"}}, "192Gi", "192Gi"),  # a request left unset is the limit: it grows from there
    ({"requests": {"memory": 107374182400}}, "164Gi", None),
    ({"requests": {"memory": "100G"}}, "164765114Ki", None),  # 100 GB + 64 GiB
])
def test_the_host_tier_adds_to_what_spec_resources_asks(resources: dict[str, Any], request_: str,
                                                        limit: str | None) -> None:
    r = container(kvCache=offload("64Gi"), resources=resources)["resources"]
    assert r["requests"]["memory"] == request_
    assert r["limits"].get("memory") == limit
    assert r["requests"]["habana.ai/gaudi"] == "1"


def test_a_disk_tier_on_an_empty_dir() -> None:
    t = template(kvCache=offload("16Gi", size="200Gi"))
    c = t["spec"]["containers"][0]
    e = {x["name"]: x.get("value") for x in c["env"]}
    assert (e["KV_OFFLOADING_SIZE"], e["KV_OFFLOADING_DISK_PATH"], e["KV_OFFLOADING_DISK_SIZE"]) == ("16", "/kv-cache", "200")
    vol = next(v for v in t["spec"]["volumes"] if v["name"] == "kv-offload")
    assert vol == {"name": "kv-offload", "emptyDir": {"sizeLimit": "210Gi"}}  # the bound and 5% for files in flight
    assert {"name": "kv-offload", "mountPath": "/kv-cache"} in c["volumeMounts"]
    assert c["resources"]["requests"]["ephemeral-storage"] == "210Gi"
    # A small disk tier still has room for the block being written.
    small = template(kvCache=offload("1Gi", size="4Gi"))
    assert next(v for v in small["spec"]["volumes"] if v["name"] == "kv-offload")["emptyDir"]["sizeLimit"] == "5Gi"
    limited = container(kvCache=offload("1Gi", size="4Gi"), resources={"limits": {"ephemeral-storage": "20Gi"}})
    assert limited["resources"]["limits"]["ephemeral-storage"] == "25Gi"


@pytest.mark.parametrize("cache,volume_read_only", [
    ({**CLAIM}, False),
    ({**CLAIM, "prefetch": True}, False),  # the model stays read-only at /data; the disk tier's subPath is writable
    ({"ephemeral": {"size": "300Gi"}}, None),
])
def test_a_disk_tier_on_the_model_cache(cache: dict[str, Any], volume_read_only: bool | None) -> None:
    t = template(model={"id": "org/llama", "cache": cache},
                 kvCache=offload("16Gi", volume="modelCache", size="500Gi", subPath="kv/llama"))
    c = t["spec"]["containers"][0]
    assert {"name": "model-cache", "mountPath": "/kv-cache", "subPath": "kv/llama"} in c["volumeMounts"]
    data = next(m for m in c["volumeMounts"] if m["mountPath"] == "/data")
    assert data.get("readOnly", False) == bool(cache.get("prefetch"))
    vol = next(v for v in t["spec"]["volumes"] if v["name"] == "model-cache")
    if volume_read_only is not None:
        assert vol["persistentVolumeClaim"]["readOnly"] is volume_read_only
    assert not [v for v in t["spec"]["volumes"] if v["name"] == "kv-offload"]
    assert "ephemeral-storage" not in c["resources"]["requests"]  # the claim's size is the claim's business
    assert {x["name"]: x.get("value") for x in c["env"]}["KV_OFFLOADING_DISK_SIZE"] == "500"
    default = container(model={"id": "org/llama", "cache": cache},
                        kvCache=offload("16Gi", volume="modelCache", size="500Gi"))
    assert {"name": "model-cache", "mountPath": "/kv-cache", "subPath": "kv-cache"} in default["volumeMounts"]


def test_spec_env_overrides_the_operators_setting() -> None:
    e = env(kvCache=offload("64Gi"), env=[{"name": "KV_OFFLOADING_SIZE", "value": "32"}])
    assert e["KV_OFFLOADING_SIZE"] == "32"


def test_changing_the_tiers_rolls_the_pods() -> None:
    def hash_of(kv: dict[str, Any]) -> str:
        return template(kvCache=kv)["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    assert len({hash_of({}), hash_of(offload("16Gi")), hash_of(offload("32Gi")), hash_of(offload("32Gi", size="1Ti"))}) == 4


@pytest.mark.parametrize("spec", [
    {"kvCache": offload("64Gi", size="200Gi"), "resources": {"requests": {"memory": "100Gi"}, "limits": {"memory": "200Gi"}}},
    {"model": {"id": "org/llama", "cache": {**CLAIM, "prefetch": True, "recipes": True}},
     "kvCache": offload("64Gi", volume="modelCache", size="2Ti")},
])
def test_children_are_valid_kubernetes(spec: dict[str, Any]) -> None:
    for child in render(body(**spec)).children:
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)


# ---- status.kvCache ---------------------------------------------------------------------


def pod(name: str, b: dict[str, Any], ready: bool, hash_: str | None = None) -> dict[str, Any]:
    current = pod_template(b, parse_spec(b["spec"]))["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    cs = {"name": "runtime", "ready": ready, "restartCount": 0, "state": {"running": {}}}
    return {"metadata": {"name": name, "labels": {TEMPLATE_HASH_LABEL: hash_ or current}},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": str(ready)}]}}


def status_of(b: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    spec = parse_spec(b["spec"])
    return compute_status(b, spec, render(b, spec), Observed(None, pods, {}), now=NOW)


def test_status_shows_the_tiers_once_a_pod_of_the_current_template_serves() -> None:
    b = body(model={"id": "org/llama", "cache": CLAIM}, kvCache=offload("64Gi", volume="modelCache", size="1Ti"))
    assert "kvCache" not in status_of(b, [pod("a", b, ready=False)])  # loading: nothing served yet
    st = status_of(b, [pod("a", b, ready=True)])
    assert st["kvCache"] == {"tiers": ["device", "host", "disk"], "hostMemory": "64Gi",
                             "disk": {"volume": "modelCache", "size": "1Ti", "path": "/kv-cache",
                                      "subPath": "kv-cache", "claim": "models"}}
    # A new host tier rolling out: the old pods' tiers stay said until a new pod serves.
    changed = body(status=st, model={"id": "org/llama", "cache": CLAIM}, kvCache=offload("16Gi"))
    old_hash = pod("a", b, ready=True)["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    rolling = status_of(changed, [pod("a", changed, ready=True, hash_=old_hash), pod("b", changed, ready=False)])
    assert rolling["kvCache"] == st["kvCache"]
    done = status_of(changed, [pod("b", changed, ready=True)])
    assert done["kvCache"] == {"tiers": ["device", "host"], "hostMemory": "16Gi"}
    # Offload removed: the key goes from the status.
    plain = body(status=done, model={"id": "org/llama", "cache": CLAIM})
    after = status_of(plain, [pod("c", plain, ready=True)])
    assert "kvCache" not in after and status_patch(done, after)["kvCache"] is None


def test_status_of_an_empty_dir_tier() -> None:
    b = body(kvCache=offload("8Gi", size="100Gi"))
    assert status_of(b, [pod("a", b, ready=True)])["kvCache"]["disk"] == {
        "volume": "emptyDir", "size": "100Gi", "path": "/kv-cache"}
