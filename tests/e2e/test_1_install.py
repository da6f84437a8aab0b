"""Scenario 1: `helm install` of the chart into a real API server, and the operator running as
the chart's ServiceAccount (its RBAC is checked against what it did in tests/e2e/test_8_rbac.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import RELEASE, Cluster, Release
from tests.e2e.harness import Kubectl, OperatorProcess, wait_for


def test_helm_install_applies_crd_rbac_and_operator_deployment(cluster: Cluster, release: Release) -> None:
    status = cluster.run_helm("status", RELEASE, "--namespace", release.namespace, "-o", "json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["info"]["status"] == "deployed"

    crd = cluster.kubectl.json("get", "crd", "inferenceservices.gaudiserve.io")
    conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conds["Established"] == "True" and conds["NamesAccepted"] == "True", conds
    assert crd["status"]["acceptedNames"]["shortNames"] == ["gisvc"]

    kinds = {(d["kind"], d["metadata"]["name"]) for d in release.manifest}
    for kind, name in kinds:
        args = ["get", kind.lower(), name] + ([] if kind.startswith("Cluster") else ["-n", release.namespace])
        cluster.kubectl(*args)  # every rendered object exists in the cluster

    dep_name = next(name for kind, name in kinds if kind == "Deployment")
    dep = wait_for(lambda: (d := cluster.kubectl.json("get", "deployment", dep_name, "-n", release.namespace))
                   and d["status"].get("availableReplicas") == 1 and d, 60, "the operator Deployment available")
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == release.service_account
    pods = cluster.kubectl.json("get", "pods", "-n", release.namespace)["items"]
    assert [p["spec"]["nodeName"] for p in pods], "the operator pod was not scheduled"


@pytest.mark.simulated
def test_operator_runs_as_the_charts_service_account(cluster: Cluster, release: Release,
                                                     operator: OperatorProcess) -> None:
    as_operator = Kubectl(cluster.kubectl.binary, operator.kubeconfig)
    who = as_operator.json("auth", "whoami")
    assert who["status"]["userInfo"]["username"] == \
        f"system:serviceaccount:{release.namespace}:{release.service_account}"
    # It holds the chart's rights and nothing of the admin's.
    def can(*args: str) -> str:
        return as_operator("auth", "can-i", *args, check=False).stdout.strip()
    assert can("patch", "inferenceservices.gaudiserve.io", "--subresource=status", "-A") == "yes"
    assert can("delete", "nodes") == "no"
    assert can("get", "secrets", "-A") == "no"
