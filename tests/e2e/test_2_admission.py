"""Scenario 2: the real API server (schema, defaulting, CEL) accepts every example and rejects
each invalid manifest of tests/unit/test_operator_crd.py with a message naming the field; any
spec it admits renders children it accepts; a child it refuses shows in the status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis_jsonschema import from_schema

from gaudi_operator import kube, prefetch_job
from gaudi_operator.components import render
from gaudi_operator.spec import parse_spec
from tests.e2e.conftest import Cluster, Release
from tests.e2e.control_plane import ROOT
from tests.e2e.harness import GROUP, PLURAL, VERSION, condition, isvc_manifest, wait_for
from tests.unit import test_operator_any_spec as any_spec
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
    bad_name = obj["metadata"]["name"] if message.startswith("metadata.") else "bad"  # (unless the name is the point)
    doc = {**obj, "metadata": {**obj["metadata"], "namespace": ns, "name": bad_name}}
    out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump(doc),
                          check=False)
    assert out.returncode != 0, f"{name}: accepted by the API server"
    assert _expected(field, message) in out.stderr, out.stderr


def _dry_run(cluster: Cluster, method: str, path: str, body: Any, content_type: str) -> tuple[int, Any]:
    """A server-side dry run: the API server's whole validation (and defaulting), nothing stored."""
    api = cluster.kube.client
    query = [("dryRun", "All")] + ([("fieldManager", "e2e"), ("force", "true")] if "apply" in content_type else [])
    m, url, headers, body_, post = api.param_serialize(method, path, query_params=query, body=body,
                                                       auth_settings=["BearerToken"],
                                                       header_params={"Content-Type": content_type,
                                                                      "Accept": "application/json"})
    rsp = api.call_api(m, url, headers, body_, post, _request_timeout=30)
    return rsp.status, json.loads(rsp.read() or b"null")


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(spec=from_schema(any_spec.SPEC_SCHEMA).map(any_spec._typed_only))
def test_any_spec_the_api_server_admits_renders_children_it_accepts(cluster: Cluster, release: Release, ns: str,
                                                                     spec: dict[str, Any]) -> None:
    """The property of tests/unit/test_operator_any_spec.py against the real API server: its own
    schema, CEL and defaulting decide what is admitted; every child of an admitted spec, applied as
    the operator applies it, passes the API server's full validation of that kind."""
    if not any_spec._fits_json_numbers(spec):
        return
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
           "metadata": {"name": "any", "namespace": ns}, "spec": spec}
    code, stored = _dry_run(cluster, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}", obj,
                            "application/json")
    event("refused at admission" if code >= 300 else "admitted")
    assert (code >= 300) == (any_spec._admitted(spec) is None), (code, stored)  # the unit tests' emulation agrees
    if code >= 300:
        assert code == 422 and "spec" in stored["message"], stored
        return
    stored["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"  # a dry run assigns none
    spec_ = parse_spec(stored["spec"])
    for child in render(stored, spec_).children:
        path = kube._path(child["kind"], ns, child["metadata"]["name"])
        code, answer = _dry_run(cluster, "PATCH", path, kube.apply_body(child), "application/apply-patch+yaml")
        assert code < 300, (child["kind"], answer.get("message"), spec)
    job = prefetch_job.render_job(stored, spec_)  # created as rendered, never applied
    if job is not None:
        code, answer = _dry_run(cluster, "POST", kube._path("Job", ns), job, "application/json")
        assert code < 300, ("Job", answer.get("message"), spec)


def test_a_child_the_api_server_refuses_shows_in_the_status(cluster: Cluster, operator, ns: str,
                                                            cleanup: list[str]) -> None:
    """Content the CRD hands through verbatim (here podTemplate.spec) is checked in the child: the
    API server's refusal, naming the field, becomes the status instead of silent retries."""
    cleanup.append("refused")
    cluster.kubectl.apply(isvc_manifest("refused", ns, shards=1,
                                        podTemplate={"spec": {"priorityClassName": "Not A Name"}}))
    status = wait_for(lambda: (s := cluster.kube.status(ns, "refused")).get("phase") == "Failed" and s, 60,
                      "status Failed")
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.template.spec.priorityClassName" in degraded["message"] and "Not A Name" in degraded["message"]
    cluster.kubectl("patch", "gisvc", "refused", "-n", ns, "--type=json",
                    "-p", '[{"op": "remove", "path": "/spec/podTemplate"}]')
    wait_for(lambda: cluster.kube.status(ns, "refused").get("phase") == "Ready", 60, "Ready once fixed")
