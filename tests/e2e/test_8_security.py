"""Scenario 8b: locking a service down. spec.networkPolicy renders a NetworkPolicy the API server
admits, admitting the listed peers and the operator's own pods (as the chart runs them) on the
HTTP port only; dropping it from the spec removes it. spec.apiKeySecretRef hands the key to the
pod as a Secret reference: the key itself is nowhere the operator writes.

(kwok has no network: that the policy is enforced is the CNI's job; here it is checked that
its selectors select what they should. The key's use by a real runtime is in scenario 6.)
"""

from __future__ import annotations

import base64
import json
import secrets

import pytest

from tests.e2e.conftest import Cluster, Release
from tests.e2e.harness import OperatorProcess, isvc_manifest, wait_for

pytestmark = pytest.mark.simulated  # the local operator, told who it is as the chart tells it


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def test_network_policy_admits_the_listed_peers_and_the_operator(cluster: Cluster, release: Release,
                                                                 operator: OperatorProcess, ns: str,
                                                                 cleanup: list[str]) -> None:
    kube, net = cluster.kube, "guarded"
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
             {"podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["chat-ui"]}]}}]
    cleanup.append(net)
    cluster.kubectl.apply(isvc_manifest(net, ns, shards=1, networkPolicy={"from": peers}))
    wait_for(lambda: kube.status(ns, net).get("phase") == "Ready", 60, "guarded Ready")
    policy = cluster.kubectl.json("get", "networkpolicy", net, "-n", ns)
    (dep,) = kube.deployments(ns, net)
    assert policy["metadata"]["ownerReferences"][0]["name"] == net
    assert policy["spec"]["podSelector"] == dep["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert rule["from"][:2] == peers
    # The last peer is the operator: its namespace and the labels of the chart's operator pods.
    operator_peer = rule["from"][2]
    namespaces = cluster.kubectl.json("get", "namespaces", "-l",
                                      _selector(operator_peer["namespaceSelector"]["matchLabels"]))
    assert [n["metadata"]["name"] for n in namespaces["items"]] == [release.namespace]
    pods = kube.core.list_namespaced_pod(release.namespace,
                                         label_selector=_selector(operator_peer["podSelector"]["matchLabels"]))
    assert pods.items and all(p.metadata.labels["app.kubernetes.io/name"] == "gaudi-serve-operator" for p in pods.items)

    cluster.kubectl("patch", "gisvc", net, "-n", ns, "--type=json", "-p", '[{"op": "remove", "path": "/spec/networkPolicy"}]')
    wait_for(lambda: cluster.kubectl("get", "networkpolicy", net, "-n", ns, check=False).returncode != 0, 60,
             "the NetworkPolicy removed with the spec's")
    assert kube.children(ns, net)["deployments"] == [net]


def test_the_api_key_is_a_secret_reference_and_nothing_more(cluster: Cluster, operator: OperatorProcess, ns: str,
                                                             cleanup: list[str]) -> None:
    kube, name, key = cluster.kube, "keyed", secrets.token_urlsafe(24)
    kube.core.create_namespaced_secret(ns, {"metadata": {"name": "keyed-api-key"}, "type": "Opaque",
                                            "data": {"token": base64.b64encode(key.encode()).decode()}})
    cleanup.append(name)
    cluster.kubectl.apply(isvc_manifest(name, ns, shards=1, apiKeySecretRef={"name": "keyed-api-key", "key": "token"}))
    wait_for(lambda: kube.status(ns, name).get("phase") == "Ready", 60, "keyed Ready")
    (pod,) = kube.live_pods(ns, name)
    (container,) = pod["spec"]["containers"]
    assert {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "keyed-api-key", "key": "token"}}} \
        in container["env"]
    assert not any("api-key" in a for a in container["args"])
    # The key is nowhere the operator writes or logs.
    written = [kube.isvc(ns, name), *kube.deployments(ns, name), pod,
               cluster.kubectl.json("get", "events", "-n", ns), operator.log()]
    assert not [w for w in written if key in (w if isinstance(w, str) else json.dumps(w))]
