"""The CRD's openAPIV3Schema and CEL rules accept good manifests and reject bad ones,
with messages naming the field; spec.py's defaults equal the schema's.

Validation here mirrors the API server: structural defaulting, then the
schema (jsonschema, with unknown fields rejected as `kubectl --validate=strict`
does), then every `x-kubernetes-validations` rule evaluated with a CEL
library (cel-python) on the value at its place in the object.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from gaudi_operator.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.gaudiserve.io.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Copy of a structural schema where unknown fields are errors (and no k8s-only keywords)."""
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "properties":
            out[k] = {name: _strict(sub) for name, sub in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = _strict(v)
        elif k == "anyOf":
            out[k] = [_strict(s) for s in v]
        elif k == "pattern" and v.endswith("$"):
            out[k] = v[:-1] + r"\Z"  # Go's `$` is the end of the text; Python's also matches before a final newline
        elif not k.startswith("x-kubernetes-"):
            out[k] = v
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _default(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, as the API server does before validation."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _default(sub, value[name])
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], v) for v in value]
    return value


_CEL = celpy.Environment()


@functools.cache
def _program(rule: str) -> Any:
    return _CEL.program(_CEL.compile(rule))


def _cel(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations") or []:
        prog = _program(rule["rule"])
        result = prog.evaluate({"self": celpy.json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType) or not bool(result):
            errors.append(f"{path}: Invalid value: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += _cel(sub, value[name], f"{path}.{name}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += _cel(schema["items"], v, f"{path}[{i}]")
    return errors


def _duplicates(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Lists of type map (x-kubernetes-list-type) hold each key once."""
    errors = []
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        if schema.get("x-kubernetes-list-type") == "map":
            seen = set()
            for i, item in enumerate(value):
                key = tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"])
                if key in seen:
                    errors.append(f"{path}[{i}]: Duplicate value: {key}")
                seen.add(key)
        for i, item in enumerate(value):
            errors += _duplicates(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += _duplicates(sub, value[name], f"{path}.{name}".lstrip("."))
    return errors


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(defaulted object, errors) as the API server would answer a create."""
    obj = _default(SCHEMA, copy.deepcopy(obj))
    validator = jsonschema.Draft202012Validator(_strict(SCHEMA))
    errors = []
    for err in validator.iter_errors(obj):
        # The API server's spelling of the path: list indices in brackets.
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path).lstrip(".") or "<root>"
        errors.append(f"{field}: {err.message}")
    errors += _duplicates(SCHEMA, obj, "")
    if not errors:  # the API server runs CEL only on a schema-valid object
        errors = _cel(SCHEMA, obj, "")
        errors = [f"<nil>{e}" if e.startswith(":") else e.lstrip(".") for e in errors]  # the root: as the API server says
    return obj, errors


def manifest(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "default"},
            "spec": {"model": {"id": "meta-llama/Llama-3.1-8B-Instruct"}, **spec}}


GOOD = [
    manifest(),
    manifest(replicas=0),
    manifest(replicas=4, shards=8, serving={"maxInputTokens": 4096, "maxTotalTokens": 8192,
                                             "maxBatchPrefillTokens": 8192, "waitingServedRatio": 1.2}),
    manifest(precision="fp8", quantization={"configMapRef": {"name": "q"},
                                            "measurements": {"persistentVolumeClaim": {"claimName": "m"}}}),
    manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                    "hubTokenSecretRef": {"name": "hf"}}),
    manifest(model={"id": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main",
                    "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True, "recipes": True}}),
    manifest(model={"id": "gpt2", "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True}}),
    manifest(model={"id": "m", "cache": {"ephemeral": {}, "recipes": True}}),
    manifest(model={"id": "/data/models/llama", "cache": {"persistentVolumeClaim": {"claimName": "m", "readOnly": True}}}),
    manifest(resources={"limits": {"cpu": 8, "memory": "100Gi"}},
             env=[{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
             tolerations=[{"key": "habana.ai/gaudi", "operator": "Exists"}], affinity={"nodeAffinity": {}},
             podTemplate={"spec": {"priorityClassName": "high"}}, probes={"startup": {"budgetSeconds": 3600}}),
    manifest(apiKeySecretRef={"name": "llama-api-key"}, networkPolicy={}),
    manifest(apiKeySecretRef={"name": "keys.ml", "key": "token.v1"}, env=[{"name": "LOG_LEVEL", "value": "debug"}],
             networkPolicy={"from": [
                 {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
                 {"podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                                        "values": ["web", "chat-ui"]},
                                                       {"key": "canary", "operator": "DoesNotExist"}]}},
                 {"namespaceSelector": {}, "podSelector": {"matchLabels": {"example.com/role": "llm-client"}}}]}),
    # spec.autoscaling and spec.serving.drainSeconds
    manifest(autoscaling={"maxReplicas": 4}, serving={"drainSeconds": 600}),
    manifest(autoscaling={"minReplicas": 2, "maxReplicas": 2, "targets": {"runningRequests": 48, "kvCacheUsage": 1},
                          "behavior": {"scaleDown": {"stabilizationWindowSeconds": 900, "pods": 2}}}),
    manifest(autoscaling={"engine": "keda", "maxReplicas": 8, "targets": {"queueSize": 10},
                          "prometheus": {"serverAddress": "http://prometheus.monitoring:9090",
                                         "authenticationRef": {"name": "prom-auth"}}}),
    # spec.model.adapters: hub ids (with a revision), paths on the claim
    manifest(model={"id": "meta-llama/Llama-3.1-8B-Instruct", "adapters": [
        {"name": "sql", "source": "org/llama-sql-lora", "revision": "v1.2"},
        {"name": "org/chat-lora", "source": "org/chat-lora"},
        {"name": "support:v2", "source": "gpt2-lora"}]}),
    manifest(model={"id": "/data/models/llama", "cache": {"persistentVolumeClaim": {"claimName": "m"}},
                    "adapters": [{"name": "local", "source": "/data/adapters/local-lora"}]}),
    manifest(gateway={"endpointPicker": {"service": {"name": "llama-epp"}}}),
    manifest(gateway={}),
    manifest(gateway={"endpointPicker": {"failureMode": "FailOpen"}, "route": {"gateway": {"name": "gw"}}}),
    manifest(replicas=3, gateway={"endpointPicker": {"service": {"name": "epp", "port": 9010}, "failureMode": "FailOpen"},
                                  "route": {"gateway": {"name": "inference-gateway", "namespace": "gateway-system"},
                                            "path": "/v1"}}),
    # spec.kvCache.offload: a host tier alone, on an emptyDir, on the model cache claim (prefetched or not, ephemeral)
    manifest(kvCache={"offload": {"hostMemory": "64Gi"}}),
    manifest(kvCache={"offload": {"hostMemory": "512Mi", "disk": {"size": "100G"}}}),
    manifest(model={"id": "org/m", "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True}},
             kvCache={"offload": {"hostMemory": "1Ti", "disk": {"volume": "modelCache", "size": "2Ti",
                                                                "subPath": "kv/llama-8b_v1.2"}}}),
    manifest(model={"id": "m", "cache": {"ephemeral": {"size": "500Gi"}}},
             kvCache={"offload": {"hostMemory": "16Gi", "disk": {"volume": "modelCache", "size": "200Gi"}}}),
    manifest(kvCache={}),
]


@pytest.mark.parametrize("obj", GOOD, ids=range(len(GOOD)))
def test_good_manifests_are_admitted(obj: dict[str, Any]) -> None:
    defaulted, errors = admit(obj)
    assert errors == []
    # ...and the operator reads them the same way.
    parse_spec(defaulted["spec"])


BAD = [
    ("wrong type replicas", manifest(replicas="two"), "spec.replicas", "is not of type 'integer'"),
    ("wrong type model", manifest(model="llama"), "spec.model", "is not of type 'object'"),
    ("wrong type hpuGraphs", manifest(batching={"hpuGraphs": "yes"}), "spec.batching.hpuGraphs", "not of type"),
    ("unknown field", manifest(replica=2), "spec", "'replica' was unexpected"),
    ("missing model id", manifest(model={}), "spec.model", "'id' is a required property"),
    ("input >= total", manifest(serving={"maxInputTokens": 2048, "maxTotalTokens": 2048}),
     "spec.serving", "spec.serving.maxInputTokens must be less than spec.serving.maxTotalTokens"),
    ("input > default total", manifest(serving={"maxInputTokens": 4096}),
     "spec.serving", "spec.serving.maxInputTokens must be less than spec.serving.maxTotalTokens"),
    ("fp8 without config", manifest(precision="fp8"),
     "spec", "spec.quantization.configMapRef is required when spec.precision is fp8"),
    ("fp8 with empty quantization", manifest(precision="fp8", quantization={}),
     "spec", "spec.quantization.configMapRef is required when spec.precision is fp8"),
    ("shards 3", manifest(shards=3), "spec", "spec.shards must be one of 1, 2, 4 or 8"),
    ("shards 16", manifest(shards=16), "spec.shards", "16 is greater than the maximum of 8"),
    ("bucket 0", manifest(batching={"batchBucketSize": 0}), "spec.batching.batchBucketSize", "less than the minimum"),
    ("prefill bucket -1", manifest(batching={"prefillBatchBucketSize": -1}),
     "spec.batching.prefillBatchBucketSize", "less than the minimum"),
    ("replicas -1", manifest(replicas=-1), "spec.replicas", "-1 is less than the minimum of 0"),
    ("stall window 5 s", manifest(probes={"warmupStallSeconds": 5}), "spec.probes.warmupStallSeconds",
     "5 is less than the minimum of 10"),
    ("precision int8", manifest(precision="int8"), "spec.precision", "is not one of"),
    ("api key in env and from a Secret", manifest(apiKeySecretRef={"name": "k"}, env=[{"name": "API_KEY", "value": "x"}]),
     "spec", "spec.env must not set API_KEY when spec.apiKeySecretRef is set"),
    ("api key secret name", manifest(apiKeySecretRef={"name": "Llama_Keys"}), "spec.apiKeySecretRef.name", "does not match"),
    ("api key secret key", manifest(apiKeySecretRef={"name": "k", "key": "a/b"}), "spec.apiKeySecretRef.key",
     "does not match"),
    ("api key without secret name", manifest(apiKeySecretRef={"key": "k"}), "spec.apiKeySecretRef",
     "'name' is a required property"),
    ("network peer without selector", manifest(networkPolicy={"from": [{}]}), "spec.networkPolicy.from[0]",
     "spec.networkPolicy.from: each peer needs a namespaceSelector, a podSelector or both"),
    ("network peer Exists with values", manifest(networkPolicy={"from": [{"podSelector": {"matchExpressions": [
        {"key": "a", "operator": "Exists", "values": ["x"]}]}}]}), "spec.networkPolicy.from[0].podSelector.matchExpressions[0]",
     "spec.networkPolicy.from: a matchExpressions entry needs values with In or NotIn"),
    ("network peer In without values", manifest(networkPolicy={"from": [{"namespaceSelector": {"matchExpressions": [
        {"key": "a", "operator": "In"}]}}]}), "spec.networkPolicy.from[0].namespaceSelector.matchExpressions[0]",
     "spec.networkPolicy.from: a matchExpressions entry needs values with In or NotIn"),
    ("network label key", manifest(networkPolicy={"from": [{"podSelector": {"matchLabels": {"app name": "web"}}}]}),
     "spec.networkPolicy.from[0].podSelector.matchLabels", "spec.networkPolicy.from: a matchLabels key is not a label key"),
    ("network label value", manifest(networkPolicy={"from": [{"podSelector": {"matchLabels": {"app": "web ui"}}}]}),
     "spec.networkPolicy.from[0].podSelector.matchLabels.app", "does not match"),
    ("network operator", manifest(networkPolicy={"from": [{"podSelector": {"matchExpressions": [
        {"key": "a", "operator": "Gt", "values": ["1"]}]}}]}),
     "spec.networkPolicy.from[0].podSelector.matchExpressions[0].operator", "is not one of"),
    ("service name", manifest() | {"metadata": {"name": "7b.llama", "namespace": "default"}}, "<nil>",
     "metadata.name must be at most 63 lowercase letters, digits or '-', starting with a letter"),
    ("hub token secret name", manifest(model={"id": "m", "hubTokenSecretRef": {"name": ""}}),
     "spec.model.hubTokenSecretRef.name", "should be non-empty"),
    ("claim name", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "My Models"}}}),
     "spec.model.cache.persistentVolumeClaim.claimName", "does not match"),
    ("shm size", manifest(shmSize="lots"), "spec.shmSize", "does not match"),
    ("cache size", manifest(model={"id": "m", "cache": {"ephemeral": {"size": "-1Gi"}}}),
     "spec.model.cache.ephemeral.size", "does not match"),
    ("image", manifest(image=" registry/gaudi-serve:1"), "spec.image", "does not match"),
    ("node selector key", manifest(nodeSelector={"gaudi model": "3"}), "spec.nodeSelector",
     "spec.nodeSelector: a key is not a label key"),
    ("pod label value", manifest(podTemplate={"metadata": {"labels": {"team": "ml ops"}}}),
     "spec.podTemplate.metadata.labels.team", "does not match"),
    ("measurements over the cache", manifest(precision="fp8", quantization={
        "configMapRef": {"name": "q"}, "measurements": {"persistentVolumeClaim": {"claimName": "m"}, "mountPath": "/data"}}),
     "spec.quantization.measurements.mountPath", "spec.quantization.measurements.mountPath must not be /data"),
    ("env twice", manifest(env=[{"name": "LOG_LEVEL", "value": "info"}, {"name": "LOG_LEVEL", "value": "debug"}]),
     "spec.env[1]", "Duplicate value"),
    ("two caches", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "a"},
                                                        "ephemeral": {}}}),
     "spec.model.cache", "set persistentVolumeClaim or ephemeral, not both"),
    ("prefetch without a claim", manifest(model={"id": "org/m", "cache": {"prefetch": True}}),
     "spec.model.cache", "spec.model.cache.prefetch needs spec.model.cache.persistentVolumeClaim"),
    ("prefetch into an ephemeral volume", manifest(model={"id": "org/m", "cache": {"ephemeral": {}, "prefetch": True}}),
     "spec.model.cache", "spec.model.cache.prefetch needs spec.model.cache.persistentVolumeClaim"),
    ("prefetch into a read-only claim", manifest(model={"id": "org/m", "cache": {
        "persistentVolumeClaim": {"claimName": "a", "readOnly": True}, "prefetch": True}}),
     "spec.model.cache", "spec.model.cache.persistentVolumeClaim.readOnly must be false with prefetch"),
    ("prefetch a path", manifest(model={"id": "/data/models/llama", "cache": {
        "persistentVolumeClaim": {"claimName": "a"}, "prefetch": True}}),
     "spec.model", "spec.model.id must be a hub id (org/name) with spec.model.cache.prefetch"),
    ("recipes on a read-only claim", manifest(model={"id": "m", "cache": {
        "persistentVolumeClaim": {"claimName": "a", "readOnly": True}, "recipes": True}}),
     "spec.model.cache", "spec.model.cache.recipes needs a cache the pods can write"),
    ("recipes without a volume", manifest(model={"id": "m", "cache": {"recipes": True}}),
     "spec.model.cache", "spec.model.cache.recipes needs a cache the pods can write"),
    # spec.model.adapters
    ("adapter name twice", manifest(model={"id": "m", "adapters": [{"name": "sql", "source": "org/a"},
                                                                   {"name": "sql", "source": "org/b"}]}),
     "spec.model.adapters[1]", "Duplicate value"),
    ("adapter name with a space", manifest(model={"id": "m", "adapters": [{"name": "sql lora", "source": "org/a"}]}),
     "spec.model.adapters[0].name", "does not match"),
    ("adapter name with a comma", manifest(model={"id": "m", "adapters": [{"name": "a,b", "source": "org/a"}]}),
     "spec.model.adapters[0].name", "does not match"),
    ("adapter named like the model", manifest(model={"id": "org/m", "adapters": [{"name": "org/m", "source": "org/a"}]}),
     "spec.model", "spec.model.adapters: an adapter's name must differ from spec.model.id"),
    ("adapter without a source", manifest(model={"id": "m", "adapters": [{"name": "sql"}]}),
     "spec.model.adapters[0]", "'source' is a required property"),
    ("adapter source outside the cache", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {
        "claimName": "c"}}, "adapters": [{"name": "sql", "source": "/etc/sql"}]}),
     "spec.model.adapters[0].source", "does not match"),
    ("adapter path without a claim", manifest(model={"id": "m", "adapters": [{"name": "sql", "source": "/data/sql"}]}),
     "spec.model", "spec.model.adapters: a source that is a path (/data/...) needs spec.model.cache.persistentVolumeClaim"),
    ("adapter path with a revision", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "c"}},
                                                     "adapters": [{"name": "sql", "source": "/data/sql",
                                                                   "revision": "main"}]}),
     "spec.model.adapters[0]", "spec.model.adapters[].revision is for a hub source only"),
    ("adapter revision with a space", manifest(model={"id": "m", "adapters": [{"name": "sql", "source": "org/a",
                                                                              "revision": "main branch"}]}),
     "spec.model.adapters[0].revision", "does not match"),
    ("adapters with fp8", manifest(precision="fp8", quantization={"configMapRef": {"name": "q"}},
                                   model={"id": "m", "adapters": [{"name": "sql", "source": "org/a"}]}),
     "spec", "spec.model.adapters cannot be combined with spec.precision fp8"),
    # spec.autoscaling and spec.serving.drainSeconds
    ("autoscaling without maxReplicas", manifest(autoscaling={"minReplicas": 2}),
     "spec.autoscaling", "'maxReplicas' is a required property"),
    ("autoscaling min above max", manifest(autoscaling={"minReplicas": 3, "maxReplicas": 2}),
     "spec.autoscaling", "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas"),
    ("autoscaling min 0", manifest(autoscaling={"minReplicas": 0, "maxReplicas": 2}),
     "spec.autoscaling.minReplicas", "0 is less than the minimum of 1"),
    ("autoscaling no target", manifest(autoscaling={"maxReplicas": 2, "targets": {}}),
     "spec.autoscaling.targets", "spec.autoscaling.targets needs at least one of queueSize, kvCacheUsage"),
    ("autoscaling kv above 1", manifest(autoscaling={"maxReplicas": 2, "targets": {"kvCacheUsage": 60}}),
     "spec.autoscaling.targets.kvCacheUsage", "60 is greater than the maximum of 1"),
    ("autoscaling engine", manifest(autoscaling={"maxReplicas": 2, "engine": "kpa"}),
     "spec.autoscaling.engine", "is not one of"),
    ("keda without prometheus", manifest(autoscaling={"maxReplicas": 2, "engine": "keda"}),
     "spec.autoscaling", "spec.autoscaling.prometheus.serverAddress is required when spec.autoscaling.engine is keda"),
    ("scale-down window too long", manifest(autoscaling={"maxReplicas": 2, "behavior": {
        "scaleDown": {"stabilizationWindowSeconds": 7200}}}),
     "spec.autoscaling.behavior.scaleDown.stabilizationWindowSeconds", "7200 is greater than the maximum of 3600"),
    ("drain too short", manifest(serving={"drainSeconds": 10}),
     "spec.serving.drainSeconds", "10 is less than the minimum of 40"),
    ("gateway picker without name", manifest(gateway={"endpointPicker": {"service": {"port": 9002}}}),
     "spec.gateway.endpointPicker.service", "'name' is a required property"),
    ("gateway picker not a service name", manifest(gateway={"endpointPicker": {"service": {"name": "EPP"}}}),
     "spec.gateway.endpointPicker.service.name", "does not match"),
    ("gateway picker port", manifest(gateway={"endpointPicker": {"service": {"name": "epp", "port": 0}}}),
     "spec.gateway.endpointPicker.service.port", "0 is less than the minimum of 1"),
    ("gateway failure mode", manifest(gateway={"endpointPicker": {"service": {"name": "epp"}, "failureMode": "Open"}}),
     "spec.gateway.endpointPicker.failureMode", "is not one of"),
    ("gateway route without gateway", manifest(gateway={"endpointPicker": {"service": {"name": "epp"}}, "route": {}}),
     "spec.gateway.route", "'gateway' is a required property"),
    ("gateway route path", manifest(gateway={"endpointPicker": {"service": {"name": "epp"}},
                                             "route": {"gateway": {"name": "gw"}, "path": "/v1//chat"}}),
     "spec.gateway.route.path", "spec.gateway.route.path must be an absolute path"),
    ("gateway route path characters", manifest(gateway={"endpointPicker": {"service": {"name": "epp"}},
                                                        "route": {"gateway": {"name": "gw"}, "path": "/v1 chat"}}),
     "spec.gateway.route.path", "does not match"),
    ("gateway route relative path", manifest(gateway={"endpointPicker": {"service": {"name": "epp"}},
                                                      "route": {"gateway": {"name": "gw"}, "path": "v1"}}),
     "spec.gateway.route.path", "spec.gateway.route.path must be an absolute path"),
    # spec.kvCache.offload
    ("offload without host memory", manifest(kvCache={"offload": {"disk": {"size": "10Gi"}}}),
     "spec.kvCache.offload", "'hostMemory' is a required property"),
    ("offload host memory in bytes", manifest(kvCache={"offload": {"hostMemory": "17179869184"}}),
     "spec.kvCache.offload.hostMemory", "does not match"),
    ("offload host memory fraction", manifest(kvCache={"offload": {"hostMemory": "0.5Gi"}}),
     "spec.kvCache.offload.hostMemory", "does not match"),
    ("offload host memory zero", manifest(kvCache={"offload": {"hostMemory": "0Gi"}}),
     "spec.kvCache.offload.hostMemory", "does not match"),
    ("offload host memory milli", manifest(kvCache={"offload": {"hostMemory": "100m"}}),
     "spec.kvCache.offload.hostMemory", "does not match"),
    ("offload disk without size", manifest(kvCache={"offload": {"hostMemory": "8Gi", "disk": {}}}),
     "spec.kvCache.offload.disk", "'size' is a required property"),
    ("offload disk volume", manifest(kvCache={"offload": {"hostMemory": "8Gi", "disk": {"size": "8Gi",
                                                                                      "volume": "hostPath"}}}),
     "spec.kvCache.offload.disk.volume", "is not one of"),
    ("offload subPath on an emptyDir", manifest(kvCache={"offload": {"hostMemory": "8Gi", "disk": {
        "size": "8Gi", "subPath": "kv"}}}),
     "spec.kvCache.offload.disk", "spec.kvCache.offload.disk.subPath is for volume modelCache only"),
    ("offload subPath climbing out", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
                                               kvCache={"offload": {"hostMemory": "8Gi", "disk": {
                                                   "volume": "modelCache", "size": "8Gi", "subPath": "kv/../hub"}}}),
     "spec.kvCache.offload.disk.subPath", "does not match"),
    ("offload subPath absolute", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
                                           kvCache={"offload": {"hostMemory": "8Gi", "disk": {
                                               "volume": "modelCache", "size": "8Gi", "subPath": "/kv"}}}),
     "spec.kvCache.offload.disk.subPath", "does not match"),
    ("offload subPath in the hub cache", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
                                                  kvCache={"offload": {"hostMemory": "8Gi", "disk": {
                                                      "volume": "modelCache", "size": "8Gi", "subPath": "hub/kv"}}}),
     "spec.kvCache.offload.disk", "spec.kvCache.offload.disk.subPath must not be in hub/ or recipes/"),
    ("offload subPath on the recipes", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
                                                kvCache={"offload": {"hostMemory": "8Gi", "disk": {
                                                    "volume": "modelCache", "size": "8Gi", "subPath": "recipes"}}}),
     "spec.kvCache.offload.disk", "spec.kvCache.offload.disk.subPath must not be in hub/ or recipes/"),
    ("offload on a model cache that is an emptyDir", manifest(kvCache={"offload": {"hostMemory": "8Gi", "disk": {
        "volume": "modelCache", "size": "8Gi"}}}),
     "spec", "spec.kvCache.offload.disk.volume modelCache needs a model cache the pods can write"),
    ("offload on a read-only claim", manifest(model={"id": "m", "cache": {"persistentVolumeClaim": {
        "claimName": "c", "readOnly": True}}}, kvCache={"offload": {"hostMemory": "8Gi", "disk": {
            "volume": "modelCache", "size": "8Gi"}}}),
     "spec", "spec.kvCache.offload.disk.volume modelCache needs a model cache the pods can write"),
    ("measurements over the disk tier", manifest(precision="fp8", quantization={
        "configMapRef": {"name": "q"}, "measurements": {"persistentVolumeClaim": {"claimName": "m"},
                                                        "mountPath": "/kv-cache"}}),
     "spec.quantization.measurements.mountPath", "must not be /data, /dev/shm, /etc/gaudi-serve/quant or /kv-cache"),
]


@pytest.mark.parametrize("name,obj,field,message", BAD, ids=[b[0] for b in BAD])
def test_bad_manifests_are_rejected_naming_the_field(name: str, obj: dict[str, Any], field: str, message: str) -> None:
    _, errors = admit(obj)
    assert errors, f"{name} was admitted"
    assert any(e.startswith(f"{field}:") and message in e for e in errors), errors


@pytest.mark.parametrize("rule_path,schema_path", [
    ("spec.serving.drainSeconds", ["spec", "serving", "drainSeconds"]),
    ("spec.batching.batchBucketSize", ["spec", "batching", "batchBucketSize"]),
    ("spec.batching.prefillBatchBucketSize", ["spec", "batching", "prefillBatchBucketSize"]),
    ("spec.batching.padSequenceToMultipleOf", ["spec", "batching", "padSequenceToMultipleOf"]),
    ("spec.replicas", ["spec", "replicas"]),
])
def test_cel_rules_on_their_own_catch_what_the_schema_also_catches(rule_path: str, schema_path: list[str]) -> None:
    """The minimum/CEL pairs agree: the CEL rule's message names the field on a bad value."""
    schema = SCHEMA
    for p in schema_path:
        schema = schema["properties"][p]
    bad = -1 if rule_path == "spec.replicas" else 0
    errors = _cel(schema, bad, rule_path)
    assert errors and rule_path in errors[0]
    assert _cel(schema, 40 if rule_path == "spec.serving.drainSeconds" else 1, rule_path) == []


def test_operator_rejects_what_the_crd_rejects() -> None:
    """For objects that skipped admission (or an older CRD), spec.py says the same thing."""
    for name, obj, _field, message in BAD:
        if "unexpected" in message or message.startswith("metadata."):
            continue  # unknown fields are pruned by the API server, ignored by the operator; names are not spec
        with pytest.raises(SpecError) as exc:
            parse_spec(obj["spec"])
        assert "spec." in str(exc.value), name


def test_spec_defaults_equal_crd_defaults() -> None:
    defaulted, errors = admit(manifest())
    assert not errors
    from_crd = parse_spec(defaulted["spec"]).model_dump(by_alias=True)
    from_code = parse_spec(manifest()["spec"]).model_dump(by_alias=True)
    assert from_crd == from_code

    def leaves(schema: dict[str, Any], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        out = []
        for name, sub in (schema.get("properties") or {}).items():
            if "default" in sub and sub["default"] != {}:
                out.append(((*path, name), sub["default"]))
            out += leaves(sub, (*path, name))
        return out
    for path, default in leaves(SCHEMA["properties"]["spec"], ()):
        obj: Any = from_code
        try:
            for p in path:
                obj = obj[p]
        except (KeyError, TypeError):
            continue  # a default inside an optional object that is absent here
        assert obj == default, path


def test_crd_shape() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["metadata"]["name"] == "inferenceservices.gaudiserve.io"
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], names["kind"], names["shortNames"], names["categories"]) == \
        ("gaudiserve.io", "InferenceService", ["gisvc"], ["gaudi"])
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in VERSION["additionalPrinterColumns"]] == \
        ["Phase", "Ready", "Warmup", "Download", "Shards", "URL", "Age"]


def test_every_field_has_a_description() -> None:
    missing = []

    def walk(schema: dict[str, Any], path: str) -> None:
        # The root `metadata` may hold nothing but its type: the API server rejects a description there.
        if not schema.get("description") and path and path != "metadata":
            missing.append(path)
        for name, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{name}" if path else name)
        if isinstance(schema.get("items"), dict) and schema["items"].get("properties"):
            for name, sub in schema["items"]["properties"].items():
                walk(sub, f"{path}[].{name}")
    walk(SCHEMA, "")
    assert missing == []


def test_printer_columns_point_at_status_fields() -> None:
    status = SCHEMA["properties"]["status"]["properties"]
    for col in VERSION["additionalPrinterColumns"]:
        path = col["jsonPath"].lstrip(".").split(".")
        if path[0] == "status":
            assert path[1] in status, col


def test_examples_validate() -> None:
    """Every InferenceService in examples/ (when the directory exists) is admitted."""
    for path in sorted((ROOT / "examples").glob("*.y*ml")) if (ROOT / "examples").is_dir() else []:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                _, errors = admit(doc)
                assert errors == [], (path.name, errors)


def test_cel_rules_are_well_formed() -> None:
    """Every rule compiles; reason is one the API server accepts; fieldPath points into the schema."""
    allowed = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}
    count = 0

    def walk(schema: dict[str, Any], path: str) -> None:
        nonlocal count
        for rule in schema.get("x-kubernetes-validations") or []:
            count += 1
            _CEL.compile(rule["rule"])
            assert rule.get("message"), (path, rule)
            assert rule.get("reason", "FieldValueInvalid") in allowed, (path, rule)
            if "fieldPath" in rule:
                sub = schema
                for part in rule["fieldPath"].lstrip(".").split("."):
                    sub = sub["properties"][part]
        for name, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{name}")
    walk(SCHEMA, "")
    assert count >= 8
