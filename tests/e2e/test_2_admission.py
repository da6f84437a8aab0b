"""Scenario 2: the real API server (schema, defaulting, CEL) accepts every example and rejects
each invalid manifest of tests/unit/test_operator_crd.py with a message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import Cluster, Release
from tests.e2e.control_plane import ROOT
from tests.unit.test_operator_crd import BAD

EXAMPLES = sorted((ROOT / "examples").glob("*.y*ml"))
# Kinds of other projects that examples/ shows how to use, whose CRDs this cluster does not have.
FOREIGN_GROUPS = {"argoproj.io"}


def _served_groups(cluster: Cluster) -> set[str]:
    out = cluster.kubectl("api-versions").stdout.split()
    return {v.rsplit("/", 1)[0] if "/" in v else "" for v in out}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(cluster: Cluster, release: Release, ns: str, path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    served = _served_groups(cluster)
    checked = 0
    for doc in docs:
        group = doc["apiVersion"].rsplit("/", 1)[0] if "/" in doc["apiVersion"] else ""
        if group not in served:
            assert group in FOREIGN_GROUPS, f"{path.name}: {doc['kind']} ({doc['apiVersion']}) is not served"
            continue
        target = doc["metadata"].get("namespace") or ns
        if cluster.kubectl("get", "namespace", target, check=False).returncode != 0:
            cluster.kubectl("create", "namespace", target)
        out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", target, "-f", "-",
                              input=yaml.safe_dump(doc), check=False)
        assert out.returncode == 0, f"{path.name}: {doc['kind']} {doc['metadata']['name']} rejected:\n{out.stderr}"
        checked += 1
    assert checked or all(d["apiVersion"].split("/")[0] in FOREIGN_GROUPS for d in docs)


def _expected(field: str, message: str) -> str:
    """What the API server's answer must contain: the CEL rule's message, else the field's path."""
    if "was unexpected" in message:  # unknown fields: kubectl --validate=strict names them
        return f'unknown field "{field}.{message.split(chr(39))[1]}"'
    return message if message.startswith(("spec.", "metadata.")) else field


@pytest.mark.parametrize("name,obj,field,message", BAD, ids=[b[0] for b in BAD])
def test_invalid_manifest_is_rejected_naming_the_field(cluster: Cluster, release: Release, ns: str, name: str,
                                                       obj: dict, field: str, message: str) -> None:
    doc = {**obj, "metadata": {**obj["metadata"], "namespace": ns, "name": "bad"}}
    out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump(doc),
                          check=False)
    assert out.returncode != 0, f"{name}: accepted by the API server"
    assert _expected(field, message) in out.stderr, out.stderr
