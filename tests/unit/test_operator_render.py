"""render.py: InferenceService -> Deployment, Service, PodDisruptionBudget (pure)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gaudi_operator.components import render
from gaudi_operator.render import GAUDI_RESOURCE, TEMPLATE_HASH_LABEL
from gaudi_operator.spec import parse_spec

K8S_VERSION = "1.37.0"
CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.gaudiserve.io.yaml"


def body(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "1234", "generation": 1},
            "spec": {"model": {"id": "meta-llama/Llama-3.1-8B-Instruct"}, **spec}}


def children(**spec: Any) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render(body(**spec)).children}


def pod_spec(**spec: Any) -> dict[str, Any]:
    return children(**spec)["Deployment"]["spec"]["template"]["spec"]


def container(**spec: Any) -> dict[str, Any]:
    return pod_spec(**spec)["containers"][0]


def env(**spec: Any) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(**spec)["env"]}


def arg(c: dict[str, Any], flag: str) -> str | None:
    return c["args"][c["args"].index(flag) + 1] if flag in c["args"] else None


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_gaudi_pod_basics(shards: int) -> None:
    ps = pod_spec(shards=shards)
    c = ps["containers"][0]
    assert c["resources"]["limits"][GAUDI_RESOURCE] == str(shards)
    assert c["resources"]["requests"][GAUDI_RESOURCE] == str(shards)
    assert ps["hostIPC"] is True
    assert "SYS_NICE" in c["securityContext"]["capabilities"]["add"]
    shm = next(v for v in ps["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["startupProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert "initialDelaySeconds" not in c["startupProbe"]
    assert c["command"] == ["gaudi-serve"] and c["args"][0] == "launch"
    assert arg(c, "--port") == "8080" and arg(c, "--num-shard") == str(shards)
    assert arg(c, "--sharded") == ("true" if shards > 1 else "false")
    assert "HABANA_VISIBLE_DEVICES" not in {e["name"] for e in c["env"]}  # the device plugin's job
    assert ps["securityContext"]["runAsNonRoot"] is True


def test_labels_annotations_owner() -> None:
    ch = children(replicas=2)
    assert set(ch) == {"Deployment", "Service", "PodDisruptionBudget"}
    want = {"app.kubernetes.io/name": "gaudi-serve", "app.kubernetes.io/instance": "llama",
            "app.kubernetes.io/managed-by": "gaudi-serve-operator", "gaudiserve.io/inference-service": "llama"}
    for child in ch.values():
        # The workload component's own label marks what it owns (objects only: the pods' template keeps its hash).
        assert child["metadata"]["labels"] == {**want, "app.kubernetes.io/component": "workload"}
        assert child["metadata"]["namespace"] == "ml"
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService", "name": "llama", "uid": "1234",
            "controller": True, "blockOwnerDeletion": True}]
    tmpl = ch["Deployment"]["spec"]["template"]["metadata"]
    assert want.items() <= tmpl["labels"].items() and "app.kubernetes.io/component" not in tmpl["labels"]
    assert tmpl["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8080",
                                   "prometheus.io/path": "/metrics"}
    sel = ch["Deployment"]["spec"]["selector"]["matchLabels"]
    assert ch["Service"]["spec"]["selector"] == sel == ch["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert sel.items() <= tmpl["labels"].items()


@pytest.mark.parametrize("replicas,has_pdb", [(0, False), (1, False), (2, True), (5, True)])
def test_pdb_only_with_more_than_one_replica(replicas: int, has_pdb: bool) -> None:
    ch = children(replicas=replicas)
    assert ("PodDisruptionBudget" in ch) is has_pdb
    assert ch["Deployment"]["spec"]["replicas"] == replicas


@pytest.mark.parametrize("spec,flag,value", [
    ({}, "--max-input-tokens", "1024"),
    ({}, "--max-total-tokens", "2048"),
    ({"serving": {"maxInputTokens": 4096, "maxTotalTokens": 8192}}, "--max-input-tokens", "4096"),
    ({"serving": {"maxInputTokens": 4096, "maxTotalTokens": 8192}}, "--max-total-tokens", "8192"),
    ({"serving": {"maxBatchSize": 64}}, "--max-batch-size", "64"),
    ({}, "--max-batch-size", None),
    ({"serving": {"maxBatchPrefillTokens": 8192}}, "--max-batch-prefill-tokens", "8192"),
    ({"serving": {"maxBatchTotalTokens": 65536}}, "--max-batch-total-tokens", "65536"),
    ({"serving": {"maxConcurrentRequests": 512}}, "--max-concurrent-requests", "512"),
    ({"serving": {"maxWaitingTokens": 10}}, "--max-waiting-tokens", "10"),
    ({"serving": {"waitingServedRatio": 1.2}}, "--waiting-served-ratio", "1.2"),
    ({"model": {"id": "org/m", "revision": "abc123"}}, "--revision", "abc123"),
    ({"model": {"id": "org/m"}}, "--model-id", "org/m"),
])
def test_runtime_flags(spec: dict[str, Any], flag: str, value: str | None) -> None:
    assert arg(container(**spec), flag) == value


@pytest.mark.parametrize("spec,name,value", [
    ({}, "BATCH_BUCKET_SIZE", "8"),
    ({}, "PREFILL_BATCH_BUCKET_SIZE", "4"),
    ({}, "PAD_SEQUENCE_TO_MULTIPLE_OF", "128"),
    ({}, "ENABLE_HPU_GRAPH", "true"),
    ({}, "LIMIT_HPU_GRAPH", "false"),
    ({}, "WARMUP_ENABLED", "true"),
    ({"batching": {"batchBucketSize": 16}}, "BATCH_BUCKET_SIZE", "16"),
    ({"batching": {"prefillBatchBucketSize": 2}}, "PREFILL_BATCH_BUCKET_SIZE", "2"),
    ({"batching": {"padSequenceToMultipleOf": 256}}, "PAD_SEQUENCE_TO_MULTIPLE_OF", "256"),
    ({"batching": {"hpuGraphs": False}}, "ENABLE_HPU_GRAPH", "false"),
    ({"batching": {"limitHpuGraphs": True}}, "LIMIT_HPU_GRAPH", "true"),
    ({"batching": {"warmup": False}}, "WARMUP_ENABLED", "false"),
    ({}, "HF_HOME", "/data"),
    ({}, "QUANT_CONFIG", None),
    ({"shards": 4}, "PT_HPU_ENABLE_LAZY_COLLECTIVES", "true"),
    ({"model": {"id": "m", "hubTokenSecretRef": {"name": "hf"}}}, "HF_TOKEN",
     {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}),
    ({"env": [{"name": "WARMUP_ENABLED", "value": "false"}, {"name": "LOG_LEVEL", "value": "debug"}]},
     "WARMUP_ENABLED", "false"),
    ({"env": [{"name": "LOG_LEVEL", "value": "debug"}]}, "LOG_LEVEL", "debug"),
])
def test_runtime_env(spec: dict[str, Any], name: str, value: Any) -> None:
    assert env(**spec).get(name) == value


def test_api_key_comes_from_the_secret_and_never_appears_in_the_pod() -> None:
    c = container(apiKeySecretRef={"name": "llama-api-key"})
    (api_key,) = [e for e in c["env"] if e["name"] == "API_KEY"]
    # The kubelet resolves the reference; the operator never holds the key, the args never carry it.
    assert api_key == {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "llama-api-key", "key": "API_KEY"}}}
    assert not any("api-key" in a or "API_KEY" in a for a in c["args"])
    assert env(apiKeySecretRef={"name": "s", "key": "token"})["API_KEY"] == {"secretKeyRef": {"name": "s", "key": "token"}}
    assert "API_KEY" not in env()
    # The probes stay on the routes the runtime leaves open with a key set.
    assert {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} <= {"/health", "/livez"}


def test_user_env_overrides_without_duplicates() -> None:
    names = [e["name"] for e in container(env=[{"name": "WARMUP_ENABLED", "value": "false"}])["env"]]
    assert names.count("WARMUP_ENABLED") == 1


def test_fp8_mounts_quant_config_and_measurements() -> None:
    spec = {"precision": "fp8", "quantization": {
        "configMapRef": {"name": "llama-fp8", "key": "maxabs_quant.json"},
        "measurements": {"persistentVolumeClaim": {"claimName": "hqt"}, "mountPath": "/hqt"}}}
    ps = pod_spec(**spec)
    c = ps["containers"][0]
    assert env(**spec)["QUANT_CONFIG"] == "/etc/gaudi-serve/quant/maxabs_quant.json"
    vols = {v["name"]: v for v in ps["volumes"]}
    assert vols["quant-config"]["configMap"]["name"] == "llama-fp8"
    assert vols["quant-measurements"]["persistentVolumeClaim"]["claimName"] == "hqt"
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/gaudi-serve/quant", "/hqt"}


@pytest.mark.parametrize("cache,key", [
    (None, "emptyDir"),
    ({"persistentVolumeClaim": {"claimName": "models"}}, "persistentVolumeClaim"),
    ({"ephemeral": {"size": "200Gi", "storageClassName": "fast"}}, "ephemeral"),
])
def test_model_cache_volume(cache: dict[str, Any] | None, key: str) -> None:
    model = {"id": "m", **({"cache": cache} if cache else {})}
    ps = pod_spec(model=model)
    vol = next(v for v in ps["volumes"] if v["name"] == "model-cache")
    assert key in vol
    if key == "ephemeral":
        claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["resources"]["requests"]["storage"] == "200Gi" and claim["storageClassName"] == "fast"
    if key == "persistentVolumeClaim":
        assert vol["persistentVolumeClaim"]["claimName"] == "models"
    assert {"name": "model-cache", "mountPath": "/data"}.items() <= \
        next(m for m in ps["containers"][0]["volumeMounts"] if m["name"] == "model-cache").items()


PREFETCH = {"id": "meta-llama/Llama-3.1-8B-Instruct", "revision": "v1",
            "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True}}


def test_prefetched_model_is_mounted_read_only_and_served_offline() -> None:
    ps = pod_spec(model=PREFETCH)
    (vol,) = [v for v in ps["volumes"] if v["name"] == "model-cache"]
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert [m for m in ps["containers"][0]["volumeMounts"] if m["name"] == "model-cache"] == [
        {"name": "model-cache", "mountPath": "/data", "readOnly": True}]
    e = env(model=PREFETCH)
    assert e["HF_HUB_OFFLINE"] == "1" and e["HUGGINGFACE_HUB_CACHE"] == "/data/hub" and "RECIPE_CACHE_DIR" not in e
    c = container(model=PREFETCH)
    assert arg(c, "--model-id") == PREFETCH["id"] and arg(c, "--revision") == "v1"  # the hub id, found offline
    assert "HF_HUB_OFFLINE" not in env(model={**PREFETCH, "cache": {"persistentVolumeClaim": {"claimName": "m"}}})


@pytest.mark.parametrize("cache,mounts,recipes", [
    # Prefetched: the model read-only, its claim's recipes/ directory writable.
    ({"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True, "recipes": True},
     [{"name": "model-cache", "mountPath": "/data", "readOnly": True},
      {"name": "model-cache", "mountPath": "/recipe-cache", "subPath": "recipes"}], "/recipe-cache"),
    # A writable claim or an ephemeral volume: the same directory under /data.
    ({"persistentVolumeClaim": {"claimName": "models"}, "recipes": True},
     [{"name": "model-cache", "mountPath": "/data", "readOnly": False}], "/data/recipes"),
    ({"ephemeral": {}, "recipes": True}, [{"name": "model-cache", "mountPath": "/data"}], "/data/recipes"),
])
def test_recipe_cache_on_the_cache_volume(cache: dict[str, Any], mounts: list[dict[str, Any]], recipes: str) -> None:
    model = {"id": "org/m", "cache": cache}
    ps = pod_spec(model=model)
    assert [m for m in ps["containers"][0]["volumeMounts"] if m["name"] == "model-cache"] == mounts
    assert env(model=model)["RECIPE_CACHE_DIR"] == recipes
    (vol,) = [v for v in ps["volumes"] if v["name"] == "model-cache"]
    assert (vol.get("persistentVolumeClaim") or {}).get("readOnly") in (None, False)  # the recipes' mount writes


def test_the_deployment_waits_for_the_download() -> None:
    """Until the model is in the claim the Deployment is left out: not created, and not changed
    (a running one keeps its pods), while the other children are applied as usual."""
    waiting = render(body(model=PREFETCH, replicas=2), downloaded=False)
    done = render(body(model=PREFETCH, replicas=2))
    assert {c["kind"] for c in waiting.children} == {"Service", "PodDisruptionBudget"}
    assert {c["kind"] for c in done.children} == {"Deployment", "Service", "PodDisruptionBudget"}
    assert waiting.held == (("Deployment", "llama"),) and done.held == ()  # held: not deleted either
    assert waiting.template_hash == done.template_hash  # the pods the status counts as current


def test_probes_follow_progress_and_no_budget_grows_with_the_warmup() -> None:
    """Liveness and startup ask /livez (the runtime's stall rule), readiness /health; the startup budget
    covers only the process coming up, whatever the warmup, and the stall window reaches the runtime."""
    def startup_seconds(**spec: Any) -> int:
        p = container(**spec)["startupProbe"]
        return p["failureThreshold"] * p["periodSeconds"]
    c = container()
    assert c["startupProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert startup_seconds() == 300 == parse_spec(body()["spec"]).startup_budget_seconds()
    long_warmup = {"serving": {"maxInputTokens": 16384, "maxTotalTokens": 32768, "maxBatchSize": 256}}
    assert startup_seconds(**long_warmup) == startup_seconds(batching={"warmup": False}) == 300
    assert container(**long_warmup)["livenessProbe"] == c["livenessProbe"]
    assert startup_seconds(probes={"startup": {"budgetSeconds": 120}}) == 120
    assert arg(c, "--warmup-stall-seconds") == "600"
    assert arg(container(probes={"warmupStallSeconds": 45}), "--warmup-stall-seconds") == "45"
    p = container(probes={"startup": {"failureThreshold": 7, "periodSeconds": 20}})["startupProbe"]
    assert (p["failureThreshold"], p["periodSeconds"]) == (7, 20)
    r = container(probes={"readiness": {"periodSeconds": 3, "failureThreshold": 2}})["readinessProbe"]
    assert (r["periodSeconds"], r["failureThreshold"]) == (3, 2)
    lv = container(probes={"liveness": {"periodSeconds": 5, "failureThreshold": 4}})["livenessProbe"]
    assert (lv["periodSeconds"], lv["failureThreshold"], lv["httpGet"]["path"]) == (5, 4, "/livez")


def test_resources_merge_but_cards_come_from_shards() -> None:
    c = container(shards=2, resources={"limits": {"cpu": "16", "memory": "200Gi", GAUDI_RESOURCE: 8},
                                       "requests": {"cpu": "8"}})
    assert c["resources"]["limits"] == {"cpu": "16", "memory": "200Gi", GAUDI_RESOURCE: "2"}
    assert c["resources"]["requests"] == {"cpu": "8", GAUDI_RESOURCE: "2"}


def test_scheduling_fields_and_pod_template_overrides() -> None:
    ps = pod_spec(
        nodeSelector={"habana.ai/gaudi.model": "gaudi3"},
        tolerations=[{"key": "habana.ai/gaudi", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {}}, serviceAccountName="llm",
        imagePullSecrets=[{"name": "regcred"}],
        podTemplate={"metadata": {"labels": {"team": "ml"}},
                     "spec": {"priorityClassName": "high", "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
                              "containers": [{"name": "runtime", "workingDir": "/work"}]}})
    assert ps["nodeSelector"] == {"habana.ai/gaudi.model": "gaudi3"}
    assert ps["tolerations"][0]["key"] == "habana.ai/gaudi"
    assert ps["serviceAccountName"] == "llm" and ps["priorityClassName"] == "high"
    assert ps["securityContext"]["runAsUser"] == 0 and ps["securityContext"]["fsGroup"] == 1000
    assert len(ps["containers"]) == 1 and ps["containers"][0]["workingDir"] == "/work"
    assert ps["containers"][0]["args"][0] == "launch"
    tmpl = children(podTemplate={"metadata": {"labels": {"team": "ml"}}})["Deployment"]["spec"]["template"]
    assert tmpl["metadata"]["labels"]["team"] == "ml"


def test_template_hash_tracks_the_pod_template_only() -> None:
    def h(b: dict[str, Any]) -> str:
        return render(b).children[0]["spec"]["template"]["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    base = body()
    same = copy.deepcopy(base)
    same["status"] = {"phase": "Ready"}
    same["metadata"]["generation"] = 7
    assert h(base) == h(same)
    assert h(base) != h(body(serving={"maxWaitingTokens": 5}))
    assert h(base) == h(body(replicas=3))  # scaling does not roll the pods


def test_service_port_and_type() -> None:
    svc = children(service={"type": "LoadBalancer", "port": 8000})["Service"]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]


OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gaudi-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gaudi-serve-operator"}}}


def network_policy(operator: dict[str, Any] | None = OPERATOR, **spec: Any) -> dict[str, Any] | None:
    rendered = render(body(**spec), operator=operator)
    return next((c for c in rendered.children if c["kind"] == "NetworkPolicy"), None)


def test_network_policy_only_when_asked() -> None:
    assert network_policy() is None
    assert [c["kind"] for c in render(body(networkPolicy={})).of("workload")] == ["Deployment", "Service",
                                                                                  "NetworkPolicy"]


def test_network_policy_admits_the_listed_peers_and_the_operator_on_the_http_port() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
             {"podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]},
                                                   {"key": "canary", "operator": "DoesNotExist"}]}},
             {"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "client"}}}]
    np = network_policy(networkPolicy={"from": peers})
    assert np["metadata"]["name"] == "llama" and np["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    dep = children()["Deployment"]
    assert np["spec"]["podSelector"] == dep["spec"]["selector"]
    assert np["spec"]["policyTypes"] == ["Ingress"]  # outbound stays open: the model download
    assert np["spec"]["ingress"] == [{"from": [*peers, OPERATOR], "ports": [{"protocol": "TCP", "port": 8080}]}]


def test_network_policy_without_peers_admits_only_the_operator_or_nothing() -> None:
    assert network_policy(networkPolicy={})["spec"]["ingress"] == [
        {"from": [OPERATOR], "ports": [{"protocol": "TCP", "port": 8080}]}]
    # An operator that does not know where it runs: no rule at all, never a rule without peers
    # (which would admit every source).
    assert network_policy(None, networkPolicy={})["spec"]["ingress"] == []


def test_operator_peer_from_where_the_operator_runs() -> None:
    from gaudi_operator.render import operator_peer

    assert operator_peer("gaudi-system", "app.kubernetes.io/name=gaudi-serve-operator") == OPERATOR
    assert operator_peer("ops", "") == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    assert operator_peer("", "a=b") is None


FULL = dict(
    replicas=3, shards=8, precision="fp8",
    quantization={"configMapRef": {"name": "q"}, "measurements": {"persistentVolumeClaim": {"claimName": "m"}}},
    model={"id": "m", "revision": "main", "hubTokenSecretRef": {"name": "hf", "key": "token"},
           "cache": {"ephemeral": {"size": "300Gi", "storageClassName": "nvme"}}},
    serving={"maxBatchSize": 32, "maxBatchTotalTokens": 100000}, image="registry/gaudi-serve:1",
    imagePullPolicy="IfNotPresent", imagePullSecrets=[{"name": "regcred"}],
    resources={"limits": {"cpu": "32", "memory": "400Gi", "hugepages-2Mi": "1Gi"}},
    env=[{"name": "LOG_LEVEL", "value": "debug"}, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
    nodeSelector={"node.kubernetes.io/instance-type": "gaudi3"},
    tolerations=[{"key": "habana.ai/gaudi", "operator": "Exists", "effect": "NoSchedule"}],
    affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llama"}}}}]}},
    serviceAccountName="llm", service={"type": "NodePort"},
    apiKeySecretRef={"name": "llama-api-key"},
    networkPolicy={"from": [{"namespaceSelector": {"matchLabels": {"team": "web"}},
                             "podSelector": {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}}]},
)


@pytest.mark.parametrize("spec", [{}, FULL, {"model": {**PREFETCH, "cache": {**PREFETCH["cache"], "recipes": True}}}],
                         ids=["minimal", "full", "prefetch"])
def test_children_validate_against_kubernetes_openapi(spec: dict[str, Any]) -> None:
    for child in render(body(**spec), operator=OPERATOR).children:
        # strict: unknown fields are errors too.
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)


def test_children_round_trip_through_kubernetes_client_models() -> None:
    import kubernetes

    api = kubernetes.client.ApiClient()

    class _Rsp:
        def __init__(self, data: Any) -> None:
            import json
            self.data = json.dumps(data)

    models = {"Deployment": "V1Deployment", "Service": "V1Service", "PodDisruptionBudget": "V1PodDisruptionBudget",
              "NetworkPolicy": "V1NetworkPolicy"}
    rendered = render(body(**FULL), operator=OPERATOR)
    assert {c["kind"] for c in rendered.children} == set(models)
    for child in rendered.children:
        model = api.deserialize(_Rsp(child).data, models[child["kind"]], "application/json")
        assert api.sanitize_for_serialization(model) == child


def test_crd_is_a_valid_customresourcedefinition() -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD.read_text()), K8S_VERSION, strict=True)


def test_bad_manifests_never_reach_render() -> None:
    from gaudi_operator.spec import SpecError
    with pytest.raises(SpecError, match="spec.shards"):
        render(body(shards=3))
