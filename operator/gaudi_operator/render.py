"""The workload's objects (pure: no I/O, no clock): the Deployment and its pod template, the
Service, the PodDisruptionBudget and the NetworkPolicy, each a plain dict ready for server-side
apply, and the labels every child carries.

Only the fields the operator owns are set, so other field managers (HPA through the scale
subresource, GitOps tools, admission webhooks) keep theirs. Which objects an InferenceService has,
and who owns them, is the components' (components/): `components.render` is the whole render.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from .kv_offload import disk_volume, offload_env, offload_resources
from .spec import (
    API_KEY_ENV,
    PRESTOP_SECONDS,
    RUNTIME_PORT,
    InferenceServiceSpec,
    LabelSelector,
    NetworkPolicyPeer,
    lora_adapters_flag,
)

APP_NAME = "gaudi-serve"
MANAGED_BY = "gaudi-serve-operator"
ISVC_LABEL = "gaudiserve.io/inference-service"
TEMPLATE_HASH_LABEL = "gaudiserve.io/template-hash"
CONTAINER = "runtime"
GAUDI_RESOURCE = "habana.ai/gaudi"
DATA_DIR = "/data"
# Habana's compiled graph recipes (spec.model.cache.recipes): the claim's recipes/ directory, mounted
# writable here when the claim itself is mounted read-only (prefetch); else /data/recipes.
RECIPE_DIR = "/recipe-cache"
RECIPE_SUBPATH = "recipes"
QUANT_DIR = "/etc/gaudi-serve/quant"
# The label the API server puts on every namespace, holding its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

__all__ = [
    "CONTAINER", "GAUDI_RESOURCE", "ISVC_LABEL", "MANAGED_BY", "TEMPLATE_HASH_LABEL", "labels", "operator_peer",
    "pod_template", "render_deployment", "render_network_policy", "render_pdb", "render_service", "selector_labels",
    "selector_string", "service_url",
]


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        ISVC_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, ISVC_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def service_url(name: str, namespace: str, spec: InferenceServiceSpec, cluster_domain: str) -> str:
    port = "" if spec.service.port == 80 else f":{spec.service.port}"
    return f"http://{name}.{namespace}.svc.{cluster_domain}{port}"


def _metadata(body: dict[str, Any]) -> dict[str, Any]:
    """Children are named like their InferenceService and live in its namespace."""
    meta = body["metadata"]
    return {"name": meta["name"], "namespace": meta["namespace"], "labels": labels(meta["name"])}


def _bool(v: bool) -> str:
    return "true" if v else "false"


def runtime_args(spec: InferenceServiceSpec) -> list[str]:
    s = spec.serving
    args = ["launch", "--model-id", spec.model.id]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.adapters:
        # Hub ids resolve in the hub cache as the model's does (offline from the claim with prefetch),
        # paths on the claim as they are; the runtime refuses to start unless every one loads.
        args += ["--lora-adapters", lora_adapters_flag(spec.model.adapters)]
    args += [
        "--hostname", "0.0.0.0",
        "--port", str(RUNTIME_PORT),
        "--dtype", "bfloat16",
        "--max-input-tokens", str(s.max_input_tokens),
        "--max-total-tokens", str(s.max_total_tokens),
    ]
    if s.max_batch_size is not None:
        args += ["--max-batch-size", str(s.max_batch_size)]
    if s.max_batch_prefill_tokens is not None:
        args += ["--max-batch-prefill-tokens", str(s.max_batch_prefill_tokens)]
    if s.max_batch_total_tokens is not None:
        args += ["--max-batch-total-tokens", str(s.max_batch_total_tokens)]
    args += [
        "--max-concurrent-requests", str(s.max_concurrent_requests),
        "--max-waiting-tokens", str(s.max_waiting_tokens),
        "--waiting-served-ratio", f"{s.waiting_served_ratio:g}",
        "--sharded", _bool(spec.shards > 1),
        "--num-shard", str(spec.shards),
        "--shutdown-grace-seconds", str(spec.shutdown_grace_seconds()),
        "--warmup-stall-seconds", str(spec.probes.warmup_stall_seconds),
    ]
    return args


def runtime_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    b = spec.batching
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": DATA_DIR},
        {"name": "HUGGINGFACE_HUB_CACHE", "value": f"{DATA_DIR}/hub"},
        {"name": "BATCH_BUCKET_SIZE", "value": str(b.batch_bucket_size)},
        {"name": "PREFILL_BATCH_BUCKET_SIZE", "value": str(b.prefill_batch_bucket_size)},
        {"name": "PAD_SEQUENCE_TO_MULTIPLE_OF", "value": str(b.pad_sequence_to_multiple_of)},
        {"name": "ENABLE_HPU_GRAPH", "value": _bool(b.hpu_graphs)},
        {"name": "LIMIT_HPU_GRAPH", "value": _bool(b.limit_hpu_graphs)},
        {"name": "WARMUP_ENABLED", "value": _bool(b.warmup)},
    ]
    if spec.shards > 1:
        # Needed by HCCL collectives inside HPU graphs with tensor parallelism.
        env.append({"name": "PT_HPU_ENABLE_LAZY_COLLECTIVES", "value": "true"})
    if spec.model.prefetched:
        # The download Job filled the claim: the replicas never call the hub.
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if spec.model.cache and spec.model.cache.recipes:
        recipes = RECIPE_DIR if spec.model.prefetched else f"{DATA_DIR}/{RECIPE_SUBPATH}"
        env.append({"name": "RECIPE_CACHE_DIR", "value": recipes})
    if spec.precision == "fp8" and spec.quantization and spec.quantization.config_map_ref:
        env.append({"name": "QUANT_CONFIG", "value": f"{QUANT_DIR}/{spec.quantization.config_map_ref.key}"})
    env += offload_env(spec)
    # Secrets reach the runtime only as references the kubelet resolves: their values never pass
    # through the operator, the pod's args or the status.
    if spec.model.hub_token_secret_ref:
        ref = spec.model.hub_token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if spec.api_key_secret_ref:
        ref = spec.api_key_secret_ref
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    # The user's variables win over ours, by name; order is kept otherwise.
    user = {e["name"]: e for e in spec.env if "name" in e}
    env = [user.pop(e["name"], e) if e["name"] in user else e for e in env]
    env += [e for e in spec.env if e.get("name") in user]
    return env


def _volumes(spec: InferenceServiceSpec, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    cache = spec.model.cache
    if cache and cache.persistent_volume_claim and cache.prefetch:
        # The model read-only (the download Job wrote it); only the recipes' and the KV disk tier's
        # directories writable.
        kv_on_claim = bool(spec.offload and spec.offload.disk and spec.offload.disk.volume == "modelCache")
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": cache.persistent_volume_claim.claim_name, "readOnly": not (cache.recipes or kv_on_claim)}})
        mounts.append({"name": "model-cache", "mountPath": DATA_DIR, "readOnly": True})
        if cache.recipes:
            mounts.append({"name": "model-cache", "mountPath": RECIPE_DIR, "subPath": RECIPE_SUBPATH})
    elif cache and cache.persistent_volume_claim:
        pvc = cache.persistent_volume_claim
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}})
        mounts.append({"name": "model-cache", "mountPath": DATA_DIR, "readOnly": pvc.read_only})
    elif cache and cache.ephemeral:
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": cache.ephemeral.size}},
        }
        if cache.ephemeral.storage_class_name:
            claim["storageClassName"] = cache.ephemeral.storage_class_name
        volumes.append({"name": "model-cache", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": labels(name)}, "spec": claim}}})
        mounts.append({"name": "model-cache", "mountPath": DATA_DIR})
    else:
        volumes.append({"name": "model-cache", "emptyDir": {}})
        mounts.append({"name": "model-cache", "mountPath": DATA_DIR})
    q = spec.quantization
    if spec.precision == "fp8" and q and q.config_map_ref:
        volumes.append({"name": "quant-config", "configMap": {"name": q.config_map_ref.name}})
        mounts.append({"name": "quant-config", "mountPath": QUANT_DIR, "readOnly": True})
    if spec.precision == "fp8" and q and q.measurements:
        m = q.measurements
        volumes.append({"name": "quant-measurements", "persistentVolumeClaim": {
            "claimName": m.persistent_volume_claim.claim_name, "readOnly": m.persistent_volume_claim.read_only}})
        mounts.append({"name": "quant-measurements", "mountPath": m.mount_path,
                       "readOnly": m.persistent_volume_claim.read_only})
    kv_volumes, kv_mounts = disk_volume(spec, "model-cache")
    return volumes + kv_volumes, mounts + kv_mounts


def _probe(path: str, period: int | None, timeout: int | None, failures: int | None, default_failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period or 10,
        "timeoutSeconds": timeout or 5,
        "failureThreshold": failures or default_failures,
    }


def probes(spec: InferenceServiceSpec) -> dict[str, dict[str, Any]]:
    """No probe bounds how long a start may take, only how long it may make no progress.

    /livez answers as soon as the process has bound its port (before the model download) and fails
    only once nothing progressed for spec.probes.warmupStallSeconds (the runtime's own stall rule,
    which also makes the runtime exit with the reason) or the shards failed: the startupProbe covers the
    process coming up, the livenessProbe the rest of the pod's life. /health gates the Service.
    """
    st, rd, lv = spec.probes.startup, spec.probes.readiness, spec.probes.liveness
    period = st.period_seconds or 10
    startup_failures = st.failure_threshold or -(-spec.startup_budget_seconds() // period)
    return {
        "startupProbe": _probe("/livez", period, st.timeout_seconds, startup_failures, startup_failures),
        "readinessProbe": _probe("/health", rd.period_seconds, rd.timeout_seconds, rd.failure_threshold, 3),
        "livenessProbe": _probe("/livez", lv.period_seconds, lv.timeout_seconds, lv.failure_threshold, 3),
    }


def _resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    limits = {k: v for k, v in (spec.resources.get("limits") or {}).items() if k != GAUDI_RESOURCE}
    requests = {k: v for k, v in (spec.resources.get("requests") or {}).items() if k != GAUDI_RESOURCE}
    limits[GAUDI_RESOURCE] = str(spec.shards)  # quantities are strings
    requests[GAUDI_RESOURCE] = str(spec.shards)  # extended resources: requests must equal limits
    offload_resources(spec, requests, limits)
    return {"limits": limits, "requests": requests}


def deep_merge(base: Any, over: Any) -> Any:
    """Merge `over` into `base`: dicts recursively, lists of named dicts by name, the rest replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = deep_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(over, list)
            and all(isinstance(i, dict) and "name" in i for i in base + over)):
        out_list = list(base)
        index = {item["name"]: i for i, item in enumerate(out_list)}
        for item in over:
            if item["name"] in index:
                out_list[index[item["name"]]] = deep_merge(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(over)


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def pod_template(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    volumes, mounts = _volumes(spec, name)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["gaudi-serve"],
        "args": runtime_args(spec),
        "env": runtime_env(spec),
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["SYS_NICE"], "drop": ["ALL"]},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Removed from the Service's endpoints before SIGTERM starts the runtime's drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}},
        **probes(spec),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "hostIPC": True,
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": spec.serving.drain_seconds,
        "securityContext": {
            # Non-root: the runtime image runs as uid 1000; override through podTemplate.spec if a
            # node's device permissions need root.
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(spec.tolerations)
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = copy.deepcopy(spec.image_pull_secrets)
    if spec.pod_template.spec:
        pod_spec = deep_merge(pod_spec, spec.pod_template.spec)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(RUNTIME_PORT),
        "prometheus.io/path": "/metrics",
        **spec.pod_template.metadata.annotations,
    }
    pod_labels = {**spec.pod_template.metadata.labels, **labels(name)}
    template = {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}
    template["metadata"]["labels"][TEMPLATE_HASH_LABEL] = template_hash(template)
    return template


def render_deployment(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(body),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # Cards are scarce: never surge (a surge pod would wait for free cards), replace one at a time.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 5,
            # The controller's deadline knows nothing of warmup: status.py trusts a starting pod's own progress.
            "progressDeadlineSeconds": spec.startup_budget_seconds() + spec.probes.warmup_stall_seconds,
            "template": pod_template(body, spec),
        },
    }


def render_service(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body),
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http",
                       "protocol": "TCP", "appProtocol": "http"}],
        },
    }


def render_pdb(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(body),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def operator_peer(namespace: str, pod_labels: str) -> dict[str, Any] | None:
    """The NetworkPolicy peer of the operator's own pods (its warmup poll), from where it runs.

    `pod_labels` is a `k=v,k=v` selector (the chart passes its Deployment's selector labels);
    without it, every pod of the operator's namespace. None when the namespace is unknown
    (an operator outside the cluster).
    """
    if not namespace:
        return None
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}
    match = dict(kv.strip().split("=", 1) for kv in pod_labels.split(",") if "=" in kv)
    if match:
        peer["podSelector"] = {"matchLabels": match}
    return peer


def _selector(sel: LabelSelector) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sel.match_labels:
        out["matchLabels"] = dict(sel.match_labels)
    if sel.match_expressions:
        out["matchExpressions"] = [{"key": r.key, "operator": r.operator, **({"values": list(r.values)} if r.values else {})}
                                   for r in sel.match_expressions]
    return out  # {}: everything (every namespace, or every pod of the namespace)


def _peer(peer: NetworkPolicyPeer) -> dict[str, Any]:
    return {key: _selector(sel) for key, sel in (("namespaceSelector", peer.namespace_selector),
                                                   ("podSelector", peer.pod_selector)) if sel is not None}


def render_network_policy(body: dict[str, Any], spec: InferenceServiceSpec,
                          operator: dict[str, Any] | None) -> dict[str, Any]:
    """Ingress to the pods' HTTP port only from the listed peers and the operator (egress is left open:
    the runtime downloads its model)."""
    name = body["metadata"]["name"]
    assert spec.network_policy is not None
    peers = [_peer(p) for p in spec.network_policy.from_] + ([copy.deepcopy(operator)] if operator else [])
    # A rule without peers would admit every source: no peer at all means no rule (nothing admitted).
    ingress = [{"from": peers, "ports": [{"protocol": "TCP", "port": RUNTIME_PORT}]}] if peers else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(body),
        "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }
