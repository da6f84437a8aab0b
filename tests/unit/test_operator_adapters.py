"""spec.model.adapters through the operator (pure parts): the pods' --lora-adapters as the runtime's own
parser reads it, the download Job fetching the hub adapters, and what the status says: the adapters the
ready pods serve, and an adapter that failed to download or load, named with why."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from gaudi_operator import prefetch_job
from gaudi_operator.components import render
from gaudi_operator.prefetch_job import Download
from gaudi_operator.render import TEMPLATE_HASH_LABEL, pod_template
from gaudi_operator.spec import parse_spec
from gaudi_operator.status import Observed, compute_status, status_patch
from gaudi_runtime import cli, download_events
from gaudi_runtime.adapters import AdapterError, check_adapter
from gaudi_runtime.config import resolve

K8S_VERSION = "1.37.0"
NOW = "2026-01-01T00:00:00Z"
ADAPTERS = [{"name": "sql", "source": "org/llama-sql-lora", "revision": "v2"},
            {"name": "chat", "source": "org/llama-chat-lora"},
            {"name": "local", "source": "/data/adapters/local-lora"}]
MODEL = {"id": "org/llama", "cache": {"persistentVolumeClaim": {"claimName": "models"}, "prefetch": True},
         "adapters": ADAPTERS}


def body(model: dict[str, Any] | None = None, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    b = {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 2},
         "spec": {"model": model or MODEL, "replicas": 1, **spec}}
    if status is not None:
        b["status"] = status
    return b


def container(b: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_template(b, parse_spec(b["spec"]))["spec"]["containers"]
    return c


# ---- the pods -----------------------------------------------------------------------------------

def test_the_runtime_reads_the_adapters_the_spec_names() -> None:
    """The rendered command line, read by `gaudi-serve launch`'s own parser, serves each adapter under its
    name, from its hub id at its revision or from its path on the claim, in the spec's order."""
    c = container(body())
    args = cli._parser().parse_args(c["args"])
    environ = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    cfg = resolve(args, environ, device_count=lambda _: 1)
    assert [(a.name, a.source, a.revision) for a in cfg.adapters.lora_adapters] == [
        ("sql", "org/llama-sql-lora", "v2"), ("chat", "org/llama-chat-lora", None),
        ("local", "/data/adapters/local-lora", None)]
    assert environ["HF_HUB_OFFLINE"] == "1"  # prefetched: the hub adapters come from the claim's hub cache too
    assert {"name": "model-cache", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]


def test_no_adapters_no_flag_and_the_same_template() -> None:
    """An InferenceService written before adapters existed renders the same pods (no rollout on upgrade)."""
    plain = {k: v for k, v in MODEL.items() if k != "adapters"}
    assert "--lora-adapters" not in container(body(plain))["args"]
    assert pod_template(body(plain), parse_spec(body(plain)["spec"])) == \
        pod_template(body({**plain, "adapters": []}), parse_spec(body({**plain, "adapters": []})["spec"]))


def test_changing_the_adapters_rolls_the_pods() -> None:
    def template_hash(adapters: list[dict[str, Any]]) -> str:
        b = body({**MODEL, "adapters": adapters})
        return pod_template(b, parse_spec(b["spec"]))["metadata"]["labels"][TEMPLATE_HASH_LABEL]
    assert template_hash(ADAPTERS) != template_hash(ADAPTERS[:2])
    assert template_hash(ADAPTERS) != template_hash([{**ADAPTERS[0], "revision": "v3"}, *ADAPTERS[1:]])


# ---- the download Job ---------------------------------------------------------------------------

def job(model: dict[str, Any]) -> dict[str, Any]:
    b = body(model)
    rendered = prefetch_job.render_job(b, parse_spec(b["spec"]))
    assert rendered is not None
    return rendered


def test_the_download_job_fetches_the_hub_adapters_into_the_same_cache() -> None:
    j = job(MODEL)
    (c,) = j["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["download", "--model-id", "org/llama",
                         "--lora-adapters", "sql=org/llama-sql-lora@v2,chat=org/llama-chat-lora",  # not the path
                         "--huggingface-hub-cache", "/data/hub", "--progress", "json"]
    assert j["metadata"]["annotations"]["gaudiserve.io/adapters"] == "sql=org/llama-sql-lora@v2,chat=org/llama-chat-lora"
    kubernetes_validate.validate(copy.deepcopy(j), K8S_VERSION, strict=True)


def test_one_job_per_model_and_hub_adapters() -> None:
    """Services that want other adapters get a Job of their own (a Job's template never changes, so a
    shared one would not fetch them); the same set in another order, or another path, shares it; without
    adapters the name is the one it was before adapters existed."""
    name = lambda model: job(model)["metadata"]["name"]  # noqa: E731
    base = name(MODEL)
    assert name({**MODEL, "adapters": [ADAPTERS[1], ADAPTERS[0]]}) == base
    assert name({**MODEL, "adapters": [*ADAPTERS[:2], {"name": "local", "source": "/data/other"}]}) == base
    assert name({**MODEL, "adapters": ADAPTERS[1:]}) != base
    assert name({**MODEL, "adapters": [{**ADAPTERS[0], "revision": "v3"}, *ADAPTERS[1:]]}) != base
    plain = {k: v for k, v in MODEL.items() if k != "adapters"}
    assert name(plain) == name({**plain, "adapters": [ADAPTERS[2]]}) == \
        prefetch_job.job_name(prefetch_job.hashlib.sha256("\0".join(("ml", "org/llama", "", "models")).encode())
                              .hexdigest()[:12])


def events(*written: tuple[str, tuple[Any, ...]]) -> str:
    """Lines of `gaudi-serve download --progress json`, by the runtime's own reporter."""
    out = io.StringIO()
    reporter = download_events.JsonLines(out)
    for kind, args in written:
        getattr(reporter, kind)(*args)
    return out.getvalue()


def failed_download(tail: str, code: int = 4) -> Download:
    j = job(MODEL) | {"status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True"}]}}
    pod = {"metadata": {"name": "dl-a", "creationTimestamp": NOW}, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "download", "state": {"terminated": {"exitCode": code, "message": tail}}}]}}
    return prefetch_job.observe(j, [pod], None)


def test_a_hub_adapter_that_fails_to_download_is_named_with_why() -> None:
    message = "adapter 'sql' (org/llama-sql-lora): revision v2 not found"
    d = failed_download(events(("progress", (0, 10, None)), ("error", ("not_found", message, "sql"))))
    assert (d.state, d.reason, d.adapter) == ("Failed", "not_found", "sql")
    assert d.as_status()["adapter"] == "sql"
    b = body()
    spec = parse_spec(b["spec"])
    st = compute_status(b, spec, render(b, spec, downloaded=False), Observed(None, [], download=d), now=NOW)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (st["phase"], degraded["reason"]) == ("Failed", "AdapterFailed")
    assert "LoRA adapter 'sql' (org/llama-sql-lora@v2)" in degraded["message"]
    assert "check its source and revision in spec.model.adapters" in degraded["message"]
    assert message in degraded["message"]
    downloaded = next(c for c in st["conditions"] if c["type"] == "Downloaded")
    assert downloaded["reason"] == "NotFound" and "with 2 LoRA adapter(s)" in downloaded["message"]
    assert st["download"]["adapter"] == "sql" and "adapters" not in st


def test_the_models_own_failure_is_not_an_adapters() -> None:
    d = failed_download(events(("error", ("not_found", "no such repository org/llama"))))
    assert d.adapter is None
    b = body()
    spec = parse_spec(b["spec"])
    st = compute_status(b, spec, render(b, spec, downloaded=False), Observed(None, [], download=d), now=NOW)
    assert next(c for c in st["conditions"] if c["type"] == "Degraded")["reason"] == "ModelDownloadFailed"


# ---- the pods' status ---------------------------------------------------------------------------

def pod(name: str, template: str, ready: bool, last: dict[str, Any] | None = None) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": 3 if last else 0,
                          "state": {"running": {}} if not last else {"waiting": {"reason": "CrashLoopBackOff"}}}
    if last:
        cs["lastState"] = {"terminated": last}
    return {"metadata": {"name": name, "labels": {TEMPLATE_HASH_LABEL: template}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}],
                       "containerStatuses": [cs]}}


def status_of(b: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    spec = parse_spec(b["spec"])
    done = Download("gaudi-serve-download-x", "Complete", 10, 10)
    return compute_status(b, spec, render(b, spec), Observed(None, pods, download=done), now=NOW)


def current_hash(b: dict[str, Any]) -> str:
    return pod_template(b, parse_spec(b["spec"]))["metadata"]["labels"][TEMPLATE_HASH_LABEL]


def test_status_lists_the_adapters_once_a_pod_of_the_current_template_serves() -> None:
    b = body()
    current = current_hash(b)
    assert "adapters" not in status_of(b, [pod("a", current, ready=False)])  # loading: nothing served yet
    st = status_of(b, [pod("a", current, ready=True)])
    assert st["adapters"] == [{"name": "sql", "source": "org/llama-sql-lora", "revision": "v2"},
                              {"name": "chat", "source": "org/llama-chat-lora"},
                              {"name": "local", "source": "/data/adapters/local-lora"}]
    # A new set rolls out: while only the old pod is ready, the status keeps saying what it serves.
    changed = body({**MODEL, "adapters": ADAPTERS[:1]}, status=st)
    rolling = status_of(changed, [pod("a", current, ready=True), pod("b", current_hash(changed), ready=False)])
    assert rolling["adapters"] == st["adapters"]
    done = status_of(changed, [pod("b", current_hash(changed), ready=True)])
    assert [a["name"] for a in done["adapters"]] == ["sql"]
    # Adapters dropped: the key goes away once the new pods serve.
    plain = body({k: v for k, v in MODEL.items() if k != "adapters"}, status=done)
    after = status_of(plain, [pod("c", current_hash(plain), ready=True)])
    assert "adapters" not in after and status_patch(done, after)["adapters"] is None


def runtime_error_line(tmp_path: Path) -> str:
    """What `gaudi-serve launch` prints when an adapter fails its check (cli: `error: <ConfigError>`)."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(AdapterError) as exc:
        check_adapter("chat", tmp_path, {"architectures": ["LlamaForCausalLM"]}, 16)
    return f"error: --lora-adapters: {exc.value}"


def test_an_adapter_that_fails_to_load_names_it_and_why(tmp_path: Path) -> None:
    line = runtime_error_line(tmp_path)
    b = body()
    crashed = pod("a", current_hash(b), ready=False,
                  last={"exitCode": 2, "reason": "Error", "message": f"INFO loading\n{line}\n"})
    st = status_of(b, [crashed])
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (st["phase"], degraded["reason"]) == ("Failed", "AdapterFailed")
    assert "pod a: LoRA adapter 'chat' (spec.model.adapters) failed to load" in degraded["message"]
    assert "use_dora is not supported yet" in degraded["message"]


def test_an_adapter_download_failure_in_the_pod_names_the_adapter() -> None:
    """Without prefetch the runtime fetches the adapters itself: the launcher's download error names it."""
    b = body({"id": "org/llama", "adapters": ADAPTERS[:2]})
    line = ("ERROR launcher --model-id org/llama: download failed (not_found): adapter 'sql' "
            "(org/llama-sql-lora): 404 Client Error: Revision Not Found")
    crashed = pod("a", current_hash(b), ready=False, last={"exitCode": 4, "reason": "Error", "message": line})
    spec = parse_spec(b["spec"])
    st = compute_status(b, spec, render(b, spec), Observed(None, [crashed]), now=NOW)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "AdapterFailed" and "LoRA adapter 'sql'" in degraded["message"]
    assert "Revision Not Found" in degraded["message"]
