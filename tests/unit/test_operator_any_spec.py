"""The operator against any spec the API server admits (property-based).

Specs are drawn from the CRD's own openAPIV3Schema (hypothesis-jsonschema), then put through
the same admission emulation as test_operator_crd.py (structural defaulting, the schema with
unknown fields refused, every CEL rule evaluated with cel-python). For each admitted spec:

* `parse_spec` accepts it: whatever it refused would be a rule that admission does not
  enforce, an object the API server stores and the operator can only report as Failed;
* `render` does not raise, and every child it renders (and the download Job of a prefetched
  model) validates against the Kubernetes OpenAPI schemas (the API server would refuse to apply
  an ill-typed child).

Bounded and reproducible: a fixed number of examples, derandomized, no example database.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from gaudi_operator import prefetch_job
from gaudi_operator.components import render
from gaudi_operator.spec import SpecError, parse_spec
from tests.unit.test_operator_crd import SCHEMA, _strict, admit

K8S_VERSION = "1.37.0"
# The API server checks these formats' ranges (a value outside is refused naming the field).
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# Core Kubernetes types the CRD hands through to the pod verbatim: their content is checked when
# the Deployment is applied (a refusal shows in the status), not at admission, so the check of
# the rendered children leaves them out.
PASSTHROUGH = ("resources", "tolerations", "affinity")
OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gaudi-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gaudi-serve-operator"}}}
# Validating children against the OpenAPI schemas is the slow part: fewer examples there.
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])
SETTINGS_VALIDATED = settings(SETTINGS, max_examples=50)


def _drawable(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema with integer formats turned into the bounds the API server enforces (then
    `_strict` makes it JSON Schema, unknown fields refused, for hypothesis-jsonschema to draw from)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: (_drawable(v) if isinstance(v, dict) else [_drawable(i) for i in v] if isinstance(v, list) else v)
           for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {name: _drawable(sub) for name, sub in schema["properties"].items()}
    if out.get("type") == "integer" and out.get("format") in INT_RANGES:
        low, high = INT_RANGES[out.pop("format")]
        out["minimum"], out["maximum"] = max(out.get("minimum", low), low), min(out.get("maximum", high), high)
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("maxProperties", 3)  # free-form core types: a few keys say as much as many
    if out.get("type") == "number":
        out["maximum"] = min(out.get("maximum", 1e9), 1e9)  # JSON numbers the API server round-trips
    return out


SPEC_SCHEMA = _strict(_drawable(SCHEMA["properties"]["spec"]))


def _manifest(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "u-1", "generation": 1}, "spec": spec}


def _fits_json_numbers(value: Any) -> bool:
    """Kubernetes decodes a JSON integer as an int64: a larger one never reaches admission."""
    if isinstance(value, dict):
        return all(_fits_json_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(_fits_json_numbers(v) for v in value)
    return not isinstance(value, int) or INT_RANGES["int64"][0] <= value <= INT_RANGES["int64"][1]


def _admitted(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The defaulted object if the API server would store it, else None (refused, naming a field)."""
    if not _fits_json_numbers(spec):
        return None
    defaulted, errors = admit(_manifest(spec))
    assert all(e.split(":", 1)[0] for e in errors), errors  # every refusal names a field
    event("refused at admission" if errors else "admitted")  # (--hypothesis-show-statistics)
    return None if errors else defaulted


def _typed_only(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` without the pass-through content (also podTemplate.spec, and env's valueFrom)."""
    out = {k: v for k, v in spec.items() if k not in PASSTHROUGH}
    if "podTemplate" in out:
        out["podTemplate"] = {k: v for k, v in out["podTemplate"].items() if k != "spec"}
    if "env" in out:
        out["env"] = [{k: v for k, v in e.items() if k in ("name", "value")} for e in out["env"]]
    return out


# The groups of the optional children that CRDs serve (KEDA, the Gateway API and its inference extension).
CRD_GROUPS = ("keda.sh", "inference.networking.k8s.io", "gateway.networking.k8s.io")


def _reconciles(obj: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        spec = parse_spec(obj["spec"])
    except SpecError as exc:
        raise AssertionError(f"admitted but refused by parse_spec (no admission rule enforces it): {exc}") from None
    job = prefetch_job.render_job(obj, spec)  # created as rendered, with prefetch
    return render(obj, spec, operator=OPERATOR).children + ([job] if job else [])


@SETTINGS
@given(from_schema(SPEC_SCHEMA))
def test_every_admitted_spec_parses_and_renders(spec: dict[str, Any]) -> None:
    obj = _admitted(spec)
    if obj is not None:
        _reconciles(obj)


@SETTINGS_VALIDATED
@given(from_schema(SPEC_SCHEMA).map(_typed_only))
def test_every_admitted_spec_renders_children_the_api_server_accepts(spec: dict[str, Any]) -> None:
    obj = _admitted(spec)
    if obj is None:
        return
    for child in _reconciles(obj):
        if child["apiVersion"].split("/")[0] in CRD_GROUPS:
            continue  # not built in: admitted by their CRDs in tests/e2e (scenarios 2, 8a and 95)
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)


@SETTINGS
@given(st.sampled_from([1, 2, 4, 8]), from_schema(SPEC_SCHEMA["properties"]["serving"]),
       from_schema(SPEC_SCHEMA["properties"]["networkPolicy"]), from_schema(SPEC_SCHEMA["properties"]["apiKeySecretRef"]))
def test_admitted_serving_and_security_settings_reconcile(shards: int, serving: dict[str, Any],
                                                          network: dict[str, Any], api_key: dict[str, Any]) -> None:
    """The fields with cross-field rules, drawn on their own so that most draws are admitted."""
    obj = _admitted({"model": {"id": "m"}, "shards": shards, "serving": serving, "networkPolicy": network,
                     "apiKeySecretRef": api_key})
    if obj is not None:
        (policy,) = [c for c in _reconciles(obj) if c["kind"] == "NetworkPolicy"]
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


@SETTINGS_VALIDATED
@given(from_schema(SPEC_SCHEMA["properties"]["model"]), st.booleans(), st.booleans())
def test_admitted_model_caches_reconcile(model: dict[str, Any], prefetch: bool, recipes: bool) -> None:
    """spec.model drawn on its own, half the draws turned into a prefetched hub model (which random
    draws hardly ever are): every admitted one renders a pod, and with prefetch a download Job,
    that validate against the Kubernetes OpenAPI schemas."""
    if prefetch:
        claim = (model.get("cache") or {}).get("persistentVolumeClaim") or {"claimName": "models"}
        model = {**model, "id": "org/m", "cache": {"persistentVolumeClaim": {**claim, "readOnly": False},
                                                   "prefetch": True, "recipes": recipes}}
    obj = _admitted({"model": model})
    if obj is None:
        return
    kinds = set()
    for child in _reconciles(obj):
        kinds.add(child["kind"])
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)
    assert ("Job" in kinds) == prefetch
    event("with a download Job" if prefetch else "without a download Job")
