"""charts/gaudi-serve-operator: `helm lint` and `helm template` with default and non-default
values, every rendered object validated, RBAC checked against what the operator calls.

Helm is built from its Go module by hack/helm.sh (cached per machine, outside the work tree).
If it cannot be built, the tests fail: they are never skipped.
"""

from __future__ import annotations

import copy
import filecmp
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gaudi_operator import cli, kube

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gaudi-serve-operator"
K8S_VERSION = "1.37.0"
NAMESPACE = "gaudi-system"

# Custom kinds the chart may render, with the structural check each gets instead of an OpenAPI schema.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("kopf.dev/v1", "KopfPeering"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
}

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    # Namespaced mode, HA with peering, PodMonitor, and every knob changed.
    "namespaced-ha": [
        "--set", "watch.namespaces={ml,prod}",
        "--set", "peering.enabled=true", "--set", "peering.name=gaudi", "--set", "peering.priority=7",
        "--set", "replicaCount=2",
        "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.labels.release=prom",
        "--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.grafanaDashboard.namespace=monitoring",
        "--set", "image.repository=registry.example.com/gaudi-operator", "--set", "image.tag=1.2.3",
        "--set", "image.pullPolicy=Always", "--set", "imagePullSecrets[0].name=regcred",
        "--set", "operator.logLevel=debug", "--set", "operator.logFormat=plain",
        "--set", "operator.resyncSeconds=30", "--set", "operator.extraArgs={--priority=7}",
        "--set", "operator.extraEnv[0].name=HTTPS_PROXY", "--set", "operator.extraEnv[0].value=http://proxy:3128",
        "--set", "health.port=9090", "--set", "health.path=/live",
        "--set", "resources.limits.cpu=1", "--set", "priorityClassName=system-cluster-critical",
        "--set", "nodeSelector.role=control", "--set", "tolerations[0].key=dedicated",
        "--set", "tolerations[0].operator=Exists", "--set", "podAnnotations.a=b",
    ],
    # Cluster-wide with peering, ServiceMonitor, an existing ServiceAccount, name overrides.
    "clusterwide-servicemonitor": [
        "--set", "peering.enabled=true", "--set", "replicaCount=3",
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.interval=30s",
        "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops-sa",
        "--set", "fullnameOverride=gso",
    ],
    # No RBAC and no ServiceAccount from the chart (both managed elsewhere); scaled to zero.
    "no-rbac": ["--set", "rbac.create=false", "--set", "serviceAccount.create=false", "--set", "replicaCount=0"],
}


@pytest.fixture(scope="session")
def helm() -> str:
    """Path to the pinned Helm binary; builds it on first use. Fails (never skips) if it cannot."""
    try:
        out = subprocess.run([str(ROOT / "hack" / "helm.sh")], capture_output=True, text=True, timeout=1500)
    except subprocess.TimeoutExpired:
        pytest.fail("hack/helm.sh did not finish building helm within 25 minutes")
    if out.returncode != 0 or not out.stdout.strip():
        pytest.fail(f"hack/helm.sh could not build helm (exit {out.returncode}):\n{out.stderr[-4000:]}")
    path = out.stdout.strip().splitlines()[-1]
    assert os.access(path, os.X_OK), path
    return path


def _run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    # No kubeconfig: lint and template never contact a cluster.
    env = {**os.environ, "KUBECONFIG": os.devnull, "HELM_CACHE_HOME": "/tmp/gaudi-serve-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/gaudi-serve-helm/config", "HELM_DATA_HOME": "/tmp/gaudi-serve-helm/data"}
    return subprocess.run([helm, *args], capture_output=True, text=True, env=env, timeout=120)


def render(helm: str, values: list[str]) -> list[dict[str, Any]]:
    out = _run(helm, "template", "rel", str(CHART), "--namespace", NAMESPACE, "--include-crds", *values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_helm_version_is_the_pinned_one(helm: str) -> None:
    out = _run(helm, "version", "--short")
    pinned = re.search(r'HELM_VERSION="\$\{HELM_VERSION:-(v[0-9.]+)\}"', (ROOT / "hack" / "helm.sh").read_text())
    assert pinned and out.stdout.startswith(pinned.group(1)), out.stdout


def test_chart_crds_equal_top_level_crds() -> None:
    top, chart = ROOT / "crds", CHART / "crds"
    assert sorted(p.name for p in top.iterdir()) == sorted(p.name for p in chart.iterdir())
    for p in top.iterdir():
        assert filecmp.cmp(p, chart / p.name, shallow=False), f"charts/gaudi-serve-operator/crds/{p.name} differs"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint(helm: str, name: str) -> None:
    out = _run(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *VALUE_SETS[name])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_validate(helm: str, name: str) -> None:
    docs = render(helm, VALUE_SETS[name])
    kinds = {(d["apiVersion"], d["kind"]) for d in docs}
    assert ("apiextensions.k8s.io/v1", "CustomResourceDefinition") in kinds
    assert ("apps/v1", "Deployment") in kinds
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CUSTOM_KINDS:
            _check_custom(doc)
        else:
            kubernetes_validate.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)
        if doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert doc["metadata"].get("namespace"), (doc["kind"], doc["metadata"]["name"])


def _check_custom(doc: dict[str, Any]) -> None:
    meta, spec = doc["metadata"], doc.get("spec") or {}
    assert meta["name"] and meta["labels"]["app.kubernetes.io/part-of"] == "gaudi-serve"
    if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
        # Select exactly what the operator labels its runtime Services and pods with.
        from gaudi_operator.render import APP_NAME, MANAGED_BY

        assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": APP_NAME,
                                                   "app.kubernetes.io/managed-by": MANAGED_BY}
        endpoints = spec["endpoints"] if doc["kind"] == "ServiceMonitor" else spec["podMetricsEndpoints"]
        assert endpoints == [{"port": "http", "path": "/metrics", "interval": endpoints[0]["interval"],
                              "scrapeTimeout": endpoints[0]["scrapeTimeout"]}]
        assert re.fullmatch(r"[0-9]+[smh]", endpoints[0]["interval"])
        assert set(spec["namespaceSelector"]) <= {"any", "matchNames"}
    else:
        assert spec == {}  # Kopf peering objects carry no spec; Kopf writes their status


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep


def test_operator_deployment_defaults(helm: str) -> None:
    dep = _deployment(render(helm, []))
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    args = cli.build_parser().parse_args(c["args"])
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.all_namespaces and args.standalone and not args.namespace and not args.peering
    assert (args.log_level, args.log_format) == ("info", "json")


def test_operator_knows_its_namespace_and_pod_labels(helm: str) -> None:
    """The NetworkPolicies the operator renders admit its pods: it learns who they are from the chart."""
    from gaudi_operator.config import OperatorConfig
    from gaudi_operator.render import operator_peer

    for values in ([], VALUE_SETS["clusterwide-servicemonitor"]):
        dep = _deployment(render(helm, values))
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["GAUDI_OPERATOR_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        config = OperatorConfig.from_env({"GAUDI_OPERATOR_NAMESPACE": NAMESPACE,
                                          "GAUDI_OPERATOR_POD_LABELS": env["GAUDI_OPERATOR_POD_LABELS"]["value"]})
        peer = operator_peer(config.namespace, config.pod_labels)
        assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                        "podSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
        assert peer["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_operator_deployment_namespaced_ha(helm: str) -> None:
    docs = render(helm, VALUE_SETS["namespaced-ha"])
    dep = _deployment(docs)
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example.com/gaudi-operator:1.2.3"
    args = cli.build_parser().parse_args(c["args"])  # the operator's own parser accepts them
    assert args.namespace == ["ml", "prod"] and args.peering == "gaudi" and args.priority == 7
    assert args.liveness == "http://0.0.0.0:9090/live" and c["livenessProbe"]["httpGet"]["path"] == "/live"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["GAUDI_OPERATOR_RESYNC_SECONDS"] == "30" and env["HTTPS_PROXY"] == "http://proxy:3128"
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["ml", "prod"]
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["ml", "prod"]}
    assert pm["metadata"]["labels"]["release"] == "prom"


def _rules(docs: list[dict[str, Any]], kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] == kind and d["metadata"].get("namespace") == namespace
            for r in d["rules"]]


def _allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


# What the operator calls (operator/gaudi_operator/kube.py and Kopf), per resource.
NEEDED = {
    ("gaudiserve.io", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("gaudiserve.io", "inferenceservices/status"): {"patch"},
    ("apps", "deployments"): {"list", "watch", "create", "patch"},
    ("", "services"): {"list", "watch", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"list", "watch", "create", "patch", "delete"},
    ("autoscaling", "horizontalpodautoscalers"): {"list", "watch", "create", "patch", "delete"},
    ("keda.sh", "scaledobjects"): {"list", "watch", "create", "patch", "delete"},
    ("inference.networking.k8s.io", "inferencepools"): {"list", "watch", "create", "patch", "delete"},
    ("gateway.networking.k8s.io", "httproutes"): {"list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch"},
    ("", "pods/log"): {"get"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "events"): {"create"},
}


def test_rbac_covers_every_kind_the_operator_touches() -> None:
    """Every resource kube.py talks to has rules in NEEDED (so the RBAC tests below cover it)."""
    needed = NEEDED.keys() | PICKER_NEEDED.keys()
    for kind, (prefix, plural) in kube._KINDS.items():
        group = "" if prefix.startswith("/api/") else prefix.split("/")[2]
        assert (group, plural) in needed, kind
    bound_only = {("rbac.authorization.k8s.io", "clusterroles")}  # `bind` on the picker's role: never called
    assert len(kube._KINDS) == len({r for r in needed - bound_only if "/" not in r[1]})


def test_rbac_clusterwide_is_least_privilege(helm: str) -> None:
    docs = render(helm, [])
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    rules = _rules(docs, "ClusterRole")
    for (group, resource), verbs in NEEDED.items():
        for verb in verbs:
            assert _allowed(rules, group, resource, verb), (group, resource, verb)
    _assert_nothing_more(rules, NEEDED | {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}})
    bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    dep = _deployment(docs)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
        assert b["roleRef"]["name"] in {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"}


def test_rbac_namespaced_grants_workload_rights_only_in_watched_namespaces(helm: str) -> None:
    docs = render(helm, VALUE_SETS["namespaced-ha"])
    cluster = _rules(docs, "ClusterRole")
    _assert_nothing_more(cluster, {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
                                   ("", "namespaces"): {"list", "watch"}})
    for ns in ("ml", "prod"):
        rules = _rules(docs, "Role", ns)
        for (group, resource), verbs in NEEDED.items():
            for verb in verbs:
                assert _allowed(rules, group, resource, verb), (ns, group, resource, verb)
        _assert_nothing_more(rules, NEEDED | {("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}})
        (rb,) = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == ns]
        assert rb["roleRef"]["kind"] == "Role"
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"} == {"ml", "prod"}


def test_rbac_clusterwide_peering(helm: str) -> None:
    docs = render(helm, VALUE_SETS["clusterwide-servicemonitor"])
    rules = _rules(docs, "ClusterRole")
    assert _allowed(rules, "kopf.dev", "clusterkopfpeerings", "patch")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterKopfPeering"] == ["gaudi-serve"]
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    assert _deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "ops-sa"
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["namespaceSelector"] == {"any": True}


def test_no_rbac(helm: str) -> None:
    docs = render(helm, VALUE_SETS["no-rbac"])
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                                                 "ServiceAccount")]
    assert _deployment(docs)["spec"]["replicas"] == 0


# With gateway.endpointPicker.image: the pickers the operator runs (operator/gaudi_operator/picker.py).
PICKER_NEEDED = {
    ("", "serviceaccounts"): {"list", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"list", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "clusterroles"): {"bind"},
    ("apps", "deployments"): {"delete"},
    ("", "services"): {"delete"},
}


@pytest.mark.parametrize("namespaced", [False, True], ids=["clusterwide", "namespaced"])
def test_a_picker_image_lets_the_operator_run_pickers_and_bind_only_their_role(helm: str, namespaced: bool) -> None:
    values = ["--set", "gateway.endpointPicker.image=registry.example/epp:v1"] + (
        ["--set", "watch.namespaces={ml}"] if namespaced else [])
    docs = render(helm, values)
    (picker_role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-endpoint-picker")]
    assert {(g, r) for rule in picker_role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"), ("inference.networking.x-k8s.io", "inferencemodelrewrites")}
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in picker_role["rules"])
    assert not [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and d["roleRef"]["name"] == picker_role["metadata"]["name"]]  # bound by the operator, per picker
    rules = _rules(docs, "Role", "ml") if namespaced else [
        r for d in docs if d["kind"] == "ClusterRole" and d is not picker_role for r in d["rules"]]
    needed = {k: NEEDED.get(k, set()) | PICKER_NEEDED.get(k, set()) for k in NEEDED.keys() | PICKER_NEEDED.keys()}
    for (group, resource), verbs in needed.items():
        for verb in verbs:
            assert _allowed(rules, group, resource, verb), (group, resource, verb)
    (bind,) = [r for r in rules if "bind" in r["verbs"]]
    assert bind["resourceNames"] == [picker_role["metadata"]["name"]]
    extra = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}, ("", "namespaces"): {"list", "watch"}}
    _assert_nothing_more(rules, needed | extra)
    env = {e["name"]: e.get("value") for e in _deployment(docs)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GAUDI_OPERATOR_EPP_IMAGE"] == "registry.example/epp:v1"
    assert env["GAUDI_OPERATOR_EPP_CLUSTER_ROLE"] == picker_role["metadata"]["name"]
    assert "--kv-cache-usage-percentage-metric=vllm:kv_cache_usage_perc" in env["GAUDI_OPERATOR_EPP_ARGS"].split()
    assert not [d for d in render(helm, []) if d["metadata"]["name"].endswith("-endpoint-picker")]


def _assert_nothing_more(rules: list[dict[str, Any]], allowed: dict[tuple[str, str], set[str]]) -> None:
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"], r
        assert not r.get("nonResourceURLs"), r
        for group in r["apiGroups"]:
            for resource in r["resources"]:
                extra = set(r["verbs"]) - allowed.get((group, resource), set())
                assert not extra, f"{group}/{resource}: {sorted(extra)} is more than the operator needs"


@pytest.mark.parametrize("values,message", [
    (["--set", "replicaCount=2"], "replicaCount"),
    (["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true"], "/metrics"),
    (["--set", "watch.namespaces={Bad_NS}"], "/watch/namespaces/0"),
    (["--set", "operator.logLevel=verbose"], "/operator/logLevel"),
    (["--set", "unknownKey=1"], "unknownKey"),
], ids=["two replicas without peering", "both monitors", "bad namespace", "bad log level", "unknown key"])
def test_values_schema_rejects_bad_values(helm: str, values: list[str], message: str) -> None:
    out = _run(helm, "template", "rel", str(CHART), *values)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_values_schema_is_valid_json_schema_and_admits_defaults() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))
