"""The warmup the operator expects is the runtime's own: for every InferenceService in examples/, the
count the operator shows equals the shapes `gaudi-serve launch` on a Gaudi card warms up with the
command line and environment of the rendered pod (prefill + prefill with cached blocks + flat decode),
and the operator gets it without importing torch (its image has no torch).

That the runtime's shards warm exactly `buckets.warmup_plan` is tests/runtime/test_warmup.py's part
(the runner on the recording fake of Habana's modules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gaudi_operator.estimate import expected_warmup_shapes
from gaudi_operator.render import pod_template
from gaudi_operator.spec import parse_spec
from gaudi_runtime import buckets, cli
from gaudi_runtime.config import resolve

ROOT = Path(__file__).resolve().parents[2]
SERVICES = [(path.name, doc) for path in sorted((ROOT / "examples").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc and doc.get("kind") == "InferenceService"]


def runtime_warmup_on_gaudi(container: dict) -> dict[str, int]:
    """What the container's `gaudi-serve launch` warms up on a Gaudi card (`--device auto` finds hpu)."""
    args = cli._parser().parse_args(container["args"])
    assert args.command == "launch" and args.device is None
    args.device = "hpu"
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    cfg = resolve(args, environ, device_count=lambda _: 8)
    assert cfg.device.block_size == 128 and cfg.device.use_flash_attention  # HPU: 128-token blocks, decode over flat blocks
    return {phase: len(shapes) for phase, shapes in buckets.warmup_plan(cfg, flat_decode=True)}


@pytest.mark.parametrize("name,doc", SERVICES, ids=[name for name, _ in SERVICES])
def test_the_operator_expects_the_runtime_warmup_for_every_example(name: str, doc: dict) -> None:
    spec = parse_spec(doc["spec"])
    (container,) = pod_template(doc, spec)["spec"]["containers"]
    phases = runtime_warmup_on_gaudi(container)
    assert min(phases.values()) > 0, phases  # prefix caching is on: every phase has shapes
    assert expected_warmup_shapes(spec) == sum(phases.values())


def test_user_environment_that_changes_buckets_changes_the_estimate() -> None:
    serving = {"maxInputTokens": 4096, "maxTotalTokens": 8192, "maxBatchSize": 64}
    base = {"model": {"id": "m"}, "serving": {**serving, "maxBatchPrefillTokens": 4096}}  # no prompt chunked
    linear = expected_warmup_shapes(parse_spec(base))
    exponential = expected_warmup_shapes(parse_spec({**base, "env": [{"name": "EXPONENTIAL_BUCKETING",
                                                                        "value": "true"}]}))
    no_prefix = expected_warmup_shapes(parse_spec({**base, "env": [{"name": "PREFIX_CACHING", "value": "false"}]}))
    off = expected_warmup_shapes(parse_spec({**base, "batching": {"warmup": False}}))
    assert exponential < linear and no_prefix < linear and off == 0


def test_a_setting_the_runtime_refuses_gives_no_estimate() -> None:
    spec = parse_spec({"model": {"id": "m"}, "env": [{"name": "BATCH_BUCKET_SIZE", "value": "0"}]})
    assert expected_warmup_shapes(spec) is None


def test_the_estimate_needs_no_torch() -> None:
    code = ("import sys; from gaudi_operator.estimate import expected_warmup_shapes; "
            "from gaudi_operator.spec import parse_spec; "
            "assert expected_warmup_shapes(parse_spec({'model': {'id': 'm'}})) > 0; "
            "heavy = sorted(m for m in ('torch', 'grpc', 'transformers', 'tokenizers', 'safetensors') if m in sys.modules); "
            "assert not heavy, heavy")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
