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


DEEPSEEK_V3 = dict(  # DeepSeek-V3 / R1's config.json, the fields the estimate reads
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, tie_word_embeddings=False)


def test_memory_estimate_counts_every_expert_and_the_latent_kv_cache() -> None:
    from gaudi_operator.estimate import model_memory

    bf16 = model_memory(DEEPSEEK_V3, "bfloat16", shards=8)
    # DeepSeek's published size: 671B parameters (without the multi-token-prediction layer), all experts.
    assert abs(bf16.weight_bytes_per_card * 8 / 2 - 671e9) < 0.5e9
    # The cache holds the 512-wide latent and the 64-wide rope key per layer, whole on every card, not
    # keys and values of 128 heads (which would be 2 * 61 * 16 * 192 * 2 bytes per card at 8 cards).
    assert bf16.kv_bytes_per_token_per_card == 61 * (512 + 64) * 2
    fp8 = model_memory(DEEPSEEK_V3, "fp8", shards=8, kv_cache_dtype="bfloat16")
    assert fp8.weight_bytes_per_card * 2 == bf16.weight_bytes_per_card
    assert fp8.total_per_card(1000) == fp8.weight_bytes_per_card + 1000 * 61 * 576 * 2
    # One more dense layer instead of a mixture of 256 experts (and a shared one): 10.9B parameters fewer.
    fewer = model_memory({**DEEPSEEK_V3, "first_k_dense_replace": 4}, "bfloat16", shards=8)
    assert 10.8e9 < (bf16.weight_bytes_per_card - fewer.weight_bytes_per_card) * 8 / 2 < 11.0e9


def test_memory_estimate_of_a_grouped_query_model_shards_its_kv_heads() -> None:
    from gaudi_operator.estimate import model_memory

    llama8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8)
    one, eight = model_memory(llama8b, "bfloat16", 1), model_memory(llama8b, "bfloat16", 8)
    assert abs(one.weight_bytes_per_card / 2 - 8.03e9) < 0.05e9
    assert one.kv_bytes_per_token_per_card == 2 * 32 * 8 * 128 * 2 == 8 * eight.kv_bytes_per_token_per_card


def test_memory_estimate_equals_a_tiny_deepseek_checkpoint(tmp_path) -> None:
    """Every tensor of a checkpoint transformers writes is counted (the estimate reads no weights)."""
    import json
    import math

    from safetensors import safe_open

    from gaudi_operator.estimate import model_memory
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    d = make_tiny_model(tmp_path, "deepseek_v3")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert model_memory(json.loads((d / "config.json").read_text()), "float32", 1).weight_bytes_per_card == 4 * params
