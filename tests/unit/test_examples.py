"""examples/: every manifest is valid, every validated TGI-Gaudi configuration is there, the
references between manifests resolve, the serving limits are ones the runtime accepts, and the
Argo CD health check (Lua) maps the operator's real status to the right health.

* InferenceServices: our CRD's openAPIV3Schema and CEL rules (the same admission emulation as
  test_operator_crd.py), then the operator's own parser; their rendered children and every
  built-in kind validate against the Kubernetes 1.37 OpenAPI schemas (kubernetes-validate, strict).
* The Lua health check runs in real Lua interpreters (Lua 5.1, the dialect of Argo CD's
  gopher-lua, and Lua 5.4) through `lupa`, on statuses computed by gaudi_operator.status.
* docs/configuration.md equals the output of hack/gen-config-doc.py (the spec fields come from the
  same CRD schema these examples are admitted by; the runtime flags from gaudi_runtime.config).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import lupa.lua51
import lupa.lua54
import pytest
import yaml

from gaudi_operator.components import render
from gaudi_operator.prefetch_job import Download
from gaudi_operator.render import TEMPLATE_HASH_LABEL, pod_template
from gaudi_operator.spec import parse_spec
from gaudi_operator.status import Observed, compute_status, invalid_spec_status
from gaudi_runtime import config as runtime_config
from tests.unit.test_operator_crd import admit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
K8S_VERSION = "1.37.0"
# Kinds that are not built into Kubernetes and how each is checked instead.
CUSTOM_KINDS = {("gaudiserve.io/v1alpha1", "InferenceService"), ("argoproj.io/v1alpha1", "Application")}

# TGI-Gaudi's validated table: (title, cards) -> precisions with a configuration in examples/.
VALIDATED = {
    ("Llama2-7B", 1): {"BF16", "FP8"},
    ("Llama2-70B", 8): {"BF16", "FP8"},
    ("Llama3-8B", 1): {"BF16", "FP8"},
    ("Llama3.1-8B", 1): {"BF16", "FP8"},
    ("Llama3.1-70B", 8): {"BF16", "FP8"},
    ("CodeLlama-13B", 1): {"BF16", "FP8"},
    ("Mistral-7B", 1): {"BF16", "FP8"},
    ("Mixtral-8x7B", 8): {"BF16", "FP8"},
    ("Falcon-180B", 8): {"BF16"},
    ("Qwen2-72B", 8): {"BF16"},
    ("Starcoder2-3B", 1): {"BF16"},
    ("Starcoder2-15B", 1): {"BF16"},
    ("Starcoder", 1): {"BF16"},
    ("Gemma-7B", 1): {"BF16"},
    # Beyond TGI-Gaudi's table: families teams serve in 2026 (issue 44).
    ("Gemma2-9B", 1): {"BF16"},
    ("Gemma3-1B", 1): {"BF16"},
    ("Llava-v1.6-Mistral-7B", 1): {"BF16", "FP8"},
    # Families teams serve in 2026 that TGI-Gaudi's table predates (issue 44), on its 1-card recipe.
    ("Phi-4", 1): {"BF16"},
    ("Granite-3-8B", 1): {"BF16"},
    ("Qwen3-8B", 1): {"BF16"},
    ("Qwen3-30B-A3B", 1): {"BF16"},
    # Block-FP8 checkpoints as published, read as stored (bf16 activations).
    ("Qwen3-30B-A3B-FP8", 1): {"BF16"},
    ("DeepSeek-R1-FP8", 8): {"BF16"},
}


def _load() -> dict[str, list[dict[str, Any]]]:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/ is empty"
    return {f.name: [d for d in yaml.safe_load_all(f.read_text()) if d] for f in files}


FILES = _load()
DOCS = [(name, i, doc) for name, docs in FILES.items() for i, doc in enumerate(docs)]
ISVCS = [(name, doc) for name, _, doc in DOCS if doc.get("kind") == "InferenceService"]
PREREQ = {(d["kind"], d["metadata"]["name"]): d for d in FILES["00-prerequisites.yaml"]}


def _is_custom(doc: dict[str, Any]) -> bool:
    return (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_KINDS


@pytest.mark.parametrize("name,index,doc", DOCS, ids=[f"{n}#{i}" for n, i, _ in DOCS])
def test_builtin_kinds_validate_against_kubernetes(name: str, index: int, doc: dict[str, Any]) -> None:
    if _is_custom(doc):
        return  # checked by the tests below
    group = doc["apiVersion"].rpartition("/")[0]
    assert "." not in group or group.endswith(".k8s.io"), f"{name}: unexpected kind {doc['apiVersion']} {doc['kind']}"
    kubernetes_validate.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", ISVCS, ids=[n for n, _ in ISVCS])
def test_inference_services_are_admitted_and_render_valid_children(name: str, doc: dict[str, Any]) -> None:
    defaulted, errors = admit(doc)
    assert errors == [], (name, errors)
    spec = parse_spec(defaulted["spec"])
    body = copy.deepcopy(defaulted)
    body["metadata"].update(namespace="ml", uid="00000000-0000-0000-0000-000000000000", generation=1)
    for child in render(body, spec).children:
        if child["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's kind: admitted by its own CRD, generated from KEDA's sources, in tests/e2e
        if child["apiVersion"].startswith(("inference.networking.k8s.io/", "gateway.networking.k8s.io/")):
            continue  # CRDs, not built in: admitted by theirs in tests/e2e (scenario 8a), the pool also by
            # tests/unit/test_operator_gateway.py
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)
    assert name == f"{doc['metadata']['name']}.yaml", "one InferenceService per file, named after it"


@pytest.mark.parametrize("name,doc", ISVCS, ids=[n for n, _ in ISVCS])
def test_serving_limits_are_accepted_by_the_runtime(name: str, doc: dict[str, Any]) -> None:
    """The flags and env the operator renders for the example pass the runtime's own config checks."""
    defaulted, _ = admit(doc)
    body = copy.deepcopy(defaulted)
    body["metadata"].update(namespace="ml", uid="u")
    container = pod_template(body, parse_spec(defaulted["spec"]))["spec"]["containers"][0]
    assert container["args"][0] == "launch"
    parser = argparse.ArgumentParser()
    runtime_config.add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    cfg = runtime_config.resolve(args, environ)
    if "REASONING_PARSER" in environ:  # a thinking model's example: the runtime splits its thinking out
        assert cfg.structured_output.reasoning_parser == environ["REASONING_PARSER"]
    serving = doc["spec"]["serving"]
    assert (cfg.limits.max_input_tokens, cfg.limits.max_total_tokens) == (serving["maxInputTokens"], serving["maxTotalTokens"])
    assert cfg.scheduling.max_batch_prefill_tokens == serving["maxBatchPrefillTokens"]
    assert cfg.device.num_shard == doc["spec"]["shards"]
    # TGI-Gaudi's sizing rules: prefill tokens hold whole prompts; the KV budget holds the batch.
    assert serving["maxBatchPrefillTokens"] % serving["maxInputTokens"] == 0
    if "maxBatchTotalTokens" in serving and "maxBatchSize" in serving:
        assert serving["maxBatchTotalTokens"] >= serving["maxBatchSize"] * serving["maxTotalTokens"]
    batching = doc["spec"]["batching"]
    assert cfg.device.batch_bucket_size == batching["batchBucketSize"]
    assert serving.get("maxBatchSize", cfg.device.batch_bucket_size) % batching["batchBucketSize"] == 0


def test_every_validated_configuration_has_an_example() -> None:
    found: dict[tuple[str, int], set[str]] = {}
    for name, doc in ISVCS:
        title, precision, cards, _unit = doc["metadata"]["annotations"]["gaudiserve.io/validated-config"].rsplit(" ", 3)
        assert precision == doc["spec"]["precision"].upper(), name
        assert int(cards) == doc["spec"]["shards"], name
        assert name == f"{doc['metadata']['name']}.yaml"
        found.setdefault((title, int(cards)), set()).add(precision)
    assert found == VALIDATED


def test_runtime_support_annotation_matches_the_runtime_registry() -> None:
    from gaudi_runtime.models.registry import SUPPORTED_ARCHITECTURES

    for name, doc in ISVCS:
        ann = doc["metadata"]["annotations"]
        expected = "supported" if ann["gaudiserve.io/architecture"] in SUPPORTED_ARCHITECTURES else "planned"
        assert ann["gaudiserve.io/runtime-support"] == expected, name


@pytest.mark.parametrize("name,doc", ISVCS, ids=[n for n, _ in ISVCS])
def test_references_resolve(name: str, doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    token = spec["model"]["hubTokenSecretRef"]
    secret = PREREQ[("Secret", token["name"])]
    assert token["key"] in secret["stringData"]
    assert ("PersistentVolumeClaim", spec["model"]["cache"]["persistentVolumeClaim"]["claimName"]) in PREREQ
    same_file = {(d["kind"], d["metadata"]["name"]): d for d in FILES[name]}
    if "apiKeySecretRef" in spec:
        key = spec["apiKeySecretRef"]
        assert key.get("key", "API_KEY") in {**PREREQ, **same_file}[("Secret", key["name"])]["stringData"]
    if spec["precision"] != "fp8":
        assert "quantization" not in spec
        return
    q = spec["quantization"]
    cm = same_file[("ConfigMap", q["configMapRef"]["name"])]
    quant = json.loads(cm["data"][q["configMapRef"]["key"]])
    assert quant["mode"] == "QUANTIZE" and quant["method"] == "HOOKS"
    assert ("PersistentVolumeClaim", q["measurements"]["persistentVolumeClaim"]["claimName"]) in PREREQ
    # The measurement statistics INC reads live on the measurements volume.
    assert quant["dump_stats_path"].startswith(q["measurements"]["mountPath"] + "/")


def test_argocd_application() -> None:
    app = FILES["argocd-application.yaml"][0]
    assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
    spec = app["spec"]
    assert spec["source"]["repoURL"] and spec["source"]["path"] and spec["destination"]["namespace"]
    assert "ServerSideApply=true" in spec["syncPolicy"]["syncOptions"]


# ---- the Lua health check ---------------------------------------------------------------

HEALTH_KEY = "resource.customizations.health.gaudiserve.io_InferenceService"
LUA = FILES["argocd-health-inferenceservice.yaml"][0]["data"][HEALTH_KEY]
NOW = "2026-01-01T00:00:00Z"


def _body(replicas: int = 1, generation: int = 2) -> dict[str, Any]:
    return {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": generation},
            "spec": {"model": {"id": "m"}, "replicas": replicas, "shards": 8}}


CURRENT = pod_template(_body(), parse_spec(_body()["spec"]))["metadata"]["labels"][TEMPLATE_HASH_LABEL]


def _pod(name: str, *, ready: bool = False, running: bool = True, hash_: str = CURRENT,
         waiting: dict[str, Any] | None = None, last: dict[str, Any] | None = None,
         scheduled: dict[str, Any] | None = None) -> dict[str, Any]:
    state = {"waiting": waiting} if waiting else ({"running": {}} if running else {"waiting": {"reason": "ContainerCreating"}})
    cs: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": 6 if last else 0, "state": state}
    if last:
        cs["lastState"] = {"terminated": last}
    conds = [scheduled or {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)}]
    status: dict[str, Any] = {"phase": "Running", "podIP": "10.0.0.1", "conditions": conds, "containerStatuses": [cs]}
    if scheduled:
        status = {"phase": "Pending", "conditions": [scheduled]}
    return {"metadata": {"name": name, "labels": {TEMPLATE_HASH_LABEL: hash_}}, "status": status}


def _observed(body: dict[str, Any], pods: list[dict[str, Any]], warmup: dict[str, Any] | None = None,
              **kw: Any) -> dict[str, Any]:
    if kw.get("spec_error"):
        return body | {"status": invalid_spec_status(body, kw["spec_error"], now=NOW)}
    spec = parse_spec(body["spec"])
    observed = Observed(None, pods, warmup or {}, download=kw.get("download"))
    return body | {"status": compute_status(body, spec, render(body, spec), observed, now=NOW)}


def _prefetched(replicas: int = 1) -> dict[str, Any]:
    body = _body(replicas)
    body["spec"]["model"] = {"id": "org/m", "cache": {"persistentVolumeClaim": {"claimName": "c"}, "prefetch": True}}
    return body


JOB = "gaudi-serve-download-1"


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient habana.ai/gaudi."}
HEALTH_CASES = [
    ("no status yet", _body(), "Progressing", "Waiting for the gaudi-serve operator"),
    ("stale status", _observed(_body(), [_pod("a", ready=True)]) | {"metadata": _body(generation=3)["metadata"]},
     "Progressing", "generation 3"),
    ("pending", _observed(_body(), []), "Progressing", "Pending"),
    ("loading weights", _observed(_body(), [_pod("a")]), "Progressing", "Loading"),
    ("warming up", _observed(_body(), [_pod("a")], {"a": {"done": 12, "total": 40}}),
     "Progressing", "WarmingUp: 0/1 replicas ready; warmup 12/40 shapes"),
    ("ready", _observed(_body(2), [_pod("a", ready=True), _pod("b", ready=True)]), "Healthy", "AllReplicasReady"),
    ("rolling out while serving", _observed(_body(2), [_pod("a", ready=True, hash_="old"),
                                                       _pod("b", ready=True), _pod("c", ready=True)]),
     "Progressing", "RollingOut"),
    ("unschedulable", _observed(_body(), [_pod("a", scheduled=UNSCHEDULABLE)]), "Degraded", "Unschedulable"),
    ("crash loop", _observed(_body(), [_pod("a", waiting={"reason": "CrashLoopBackOff", "message": "back-off"},
                                            last={"exitCode": 1, "reason": "Error",
                                                  "message": "RuntimeError: boom"})]),
     "Degraded", "CrashLoopBackOff"),
    ("warmup out of memory", _observed(_body(), [_pod("a", waiting={"reason": "CrashLoopBackOff"},
                                                      last={"exitCode": 1, "reason": "Error",
                                                            "message": "warmup failed: out of memory at bucket 64"})]),
     "Degraded", "WarmupOutOfMemory"),
    ("invalid spec", _observed(_body(), [], spec_error="spec.shards: must be one of 1, 2, 4 or 8"),
     "Degraded", "InvalidSpec"),
    ("downloading", _observed(_prefetched(), [], download=Download(JOB, "Downloading", 10**9, 4 * 10**9)),
     "Progressing", "Downloading: 0/1 replicas ready; download 1.0/4.0 GB"),
    ("a new revision downloading while the old serves",
     _observed(_prefetched(), [_pod("a", ready=True, hash_="old")], download=Download(JOB, "Pending")),
     "Progressing", "Downloading"),
    ("download refused", _observed(_prefetched(), [], download=Download(JOB, "Failed", reason="unauthorized")),
     "Degraded", "ModelDownloadFailed"),
    ("scaled to zero", _observed(_body(0), []), "Healthy", "Scaled to zero"),
    ("scaling to zero", _observed(_body(0), [_pod("a", ready=True)]), "Progressing", ""),
]


@pytest.mark.parametrize("lua_module", [lupa.lua51, lupa.lua54], ids=["lua5.1", "lua5.4"])
@pytest.mark.parametrize("case,obj,health,fragment", HEALTH_CASES, ids=[c[0] for c in HEALTH_CASES])
def test_argocd_health_check(lua_module: Any, case: str, obj: dict[str, Any], health: str, fragment: str) -> None:
    lua = lua_module.LuaRuntime(unpack_returned_tuples=True)
    # Argo CD hands the object to the script as the global `obj` (JSON decoded into Lua tables).
    lua.globals().obj = lua.table_from(json.loads(json.dumps(obj)), recursive=True)
    hs = lua.execute(LUA)
    assert (hs["status"], case) == (health, case), hs["message"]
    assert fragment in hs["message"], hs["message"]


# ---- docs/configuration.md is generated, not written -------------------------------------


def test_configuration_reference_is_up_to_date() -> None:
    """docs/configuration.md equals hack/gen-config-doc.py's output (CRD schema + runtime config)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "hack" / "gen-config-doc.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.generate()
    assert (ROOT / "docs" / "configuration.md").read_text() == text, \
        "docs/configuration.md is stale: run python hack/gen-config-doc.py --write"
    for flag, env, *_ in runtime_config.FLAGS:
        assert f"`{flag}`" in text and f"`{env or flag[2:].replace('-', '_').upper()}`" in text
    for env, *_ in runtime_config.ENV_ONLY:
        assert f"`{env}`" in text
    for field in ("spec.serving.maxBatchTotalTokens", "spec.batching.padSequenceToMultipleOf",
                  "spec.quantization.measurements.mountPath", "spec.probes.startup.budgetSeconds",
                  "spec.env[].name", "status.conditions[].reason"):
        assert f"`{field}`" in text, field
