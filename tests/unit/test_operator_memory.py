"""The operator's memory estimate (gaudi_operator.memory.model_memory) from config.json alone.

* a mixture-of-experts model counts every expert's weights, not the few a token activates: the
  estimate's parameters are the checkpoint's, tensor for tensor, for tiny Qwen3-MoE and Mixtral
  models, and Qwen3-30B-A3B's config gives its 30.5B (not its 3.3B active);
* per shard it is the parameters the runtime's rank holds once loaded;
* the KV cache per token follows the KV heads each rank keeps, or for latent attention (DeepSeek-V3)
  the latent every rank keeps whole.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gaudi_operator.memory import model_memory
from gaudi_runtime.tools.tiny_model import make_tiny_model

# Qwen3-30B-A3B's config.json (the fields the estimate reads).
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen3", "deepseek_v3"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def checkpoint_parameters(model_dir) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def test_parameters_are_the_checkpoints_every_expert_included(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert model_memory(cfg, dtype_bytes=4).parameters == checkpoint_parameters(model_dir)


@pytest.mark.parametrize("shards", [1, 2])
def test_bytes_per_shard_are_what_a_loaded_rank_holds(model_dir, shards):
    from gaudi_runtime.models import load_model

    cfg = json.loads((model_dir / "config.json").read_text())
    rank0 = load_model(str(model_dir), torch.float32, torch.device("cpu"), tp_rank=0, tp_size=shards)
    held = sum(p.numel() * p.element_size() for p in rank0.parameters())  # tied ones once
    assert model_memory(cfg, dtype_bytes=4, shards=shards).weight_bytes_per_shard == held


def test_qwen3_30b_a3b_holds_all_its_experts():
    one = model_memory(QWEN3_30B_A3B, dtype_bytes=2)
    assert 30.3e9 < one.parameters < 30.7e9  # the model card's 30.5B, not the 3.3B active per token
    eight = model_memory(QWEN3_30B_A3B, dtype_bytes=2, shards=8)
    assert one.weight_bytes_per_shard / 8 < eight.weight_bytes_per_shard < one.weight_bytes_per_shard / 7
    # 4 KV heads on 8 ranks: each rank keeps one whole head of 128 per layer, for k and v.
    assert eight.kv_bytes_per_token_per_shard == 2 * 48 * 128 * 2
    assert one.kv_bytes_per_token_per_shard == 2 * 48 * 4 * 128 * 2
    assert model_memory(QWEN3_30B_A3B, 2, 8, kv_dtype_bytes=1).kv_bytes_per_token_per_shard == 2 * 48 * 128


DEEPSEEK_V3 = dict(  # DeepSeek-V3 / R1's config.json, the fields the estimate reads
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, tie_word_embeddings=False)


def test_memory_estimate_counts_every_expert_and_the_latent_kv_cache() -> None:
    bf16 = model_memory(DEEPSEEK_V3, 2, shards=8)
    # DeepSeek's published size: 671B parameters (without the multi-token-prediction layer), all experts.
    assert abs(bf16.parameters - 671e9) < 0.5e9
    # The cache holds the 512-wide latent and the 64-wide rope key per layer, whole on every card, not
    # keys and values of 128 heads (which would be 2 * 61 * 16 * 192 * 2 bytes per card at 8 cards).
    assert bf16.kv_bytes_per_token_per_shard == 61 * (512 + 64) * 2
    fp8 = model_memory(DEEPSEEK_V3, 1, shards=8, kv_dtype_bytes=2)
    assert fp8.weight_bytes_per_shard * 2 == bf16.weight_bytes_per_shard
    assert fp8.total_per_shard(1000) == fp8.weight_bytes_per_shard + 1000 * 61 * 576 * 2
    # One more dense layer instead of a mixture of 256 experts (and a shared one): 10.9B parameters fewer.
    fewer = model_memory({**DEEPSEEK_V3, "first_k_dense_replace": 4}, 2, shards=8)
    assert 10.8e9 < (bf16.parameters - fewer.parameters) < 11.0e9


def test_memory_estimate_of_a_grouped_query_model_shards_its_kv_heads() -> None:
    llama8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8)
    one, eight = model_memory(llama8b, 2, 1), model_memory(llama8b, 2, 8)
    assert abs(one.parameters - 8.03e9) < 0.05e9
    assert one.kv_bytes_per_token_per_shard == 2 * 32 * 8 * 128 * 2 == 8 * eight.kv_bytes_per_token_per_shard


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("small") / "dense", "llama", size="small")


@pytest.mark.parametrize("write", ["gptq4", "gptq8", "awq", "fp8_block"])
def test_a_prequantized_checkpoint_counts_its_packed_bytes(tmp_path, small_llama, write):
    """GPTQ, AWQ and FP8 checkpoints stay packed in the runtime's memory: the estimate is their tensors'
    bytes (within the g_idx and per-row scales it leaves out; block scales as the runtime expands them to
    rows), a fraction of the dense model's."""
    from tests.runtime.prequantized import write_awq, write_block_fp8, write_gptq

    dense = small_llama
    writers = {"gptq4": lambda d: write_gptq(d, bits=4, group=64),
               "gptq8": lambda d: write_gptq(d, bits=8, group=64),
               "awq": lambda d: write_awq(d, group=64),
               "fp8_block": lambda d: write_block_fp8(d, block=(64, 64))}
    import shutil

    model_dir = writers[write](Path(shutil.copytree(dense, tmp_path / "quantized")))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(n).get_shape()) * f.get_tensor(n).element_size() for n in f.keys())
        # Block scales are held one per weight row (and block of columns), as the runtime slices them.
        stored += sum(4 * (math.prod(f.get_slice(n[:-len("_scale_inv")]).get_shape()) // 64 - math.prod(
            f.get_slice(n).get_shape())) for n in f.keys() if n.endswith(".weight_scale_inv"))
    cfg = json.loads((model_dir / "config.json").read_text())
    estimate = model_memory(cfg, dtype_bytes=4).weight_bytes_per_shard
    assert abs(estimate - stored) / stored < 0.03, (estimate, stored)
    assert estimate < 0.6 * model_memory(json.loads((dense / "config.json").read_text()), dtype_bytes=4).weight_bytes_per_shard


BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_block_fp8_moe_checkpoints_count_float8_experts_and_their_scales() -> None:
    """DeepSeek-R1 and Qwen3-30B-A3B as published in block FP8: every expert and MLA projection one byte a
    weight plus a float32 scale per row and 128 columns, as the runtime holds them. R1 fits one node of
    eight 128 GB Gaudi 3 cards (examples/deepseek-r1-fp8.yaml); Qwen3-30B-A3B-FP8 one 96 GB Gaudi 2."""
    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"

    def kv_budget(name: str) -> int:
        return yaml.safe_load((examples / name).read_text())["spec"]["serving"]["maxBatchTotalTokens"]

    r1 = model_memory({**DEEPSEEK_V3, "quantization_config": BLOCK_FP8}, 2, shards=8)
    bf16 = model_memory(DEEPSEEK_V3, 2, shards=8)
    assert 0.5 < r1.weight_bytes_per_shard / bf16.weight_bytes_per_shard < 0.53
    assert r1.kv_bytes_per_token_per_shard == 61 * (512 + 64) * 2  # the latent, as in bf16
    assert r1.weight_bytes_per_shard > 0.9 * 96e9  # eight Gaudi 2 cards would hold the weights and little else
    # The example's KV budget and the weights leave a Gaudi 3 card room for graphs and activations.
    assert r1.total_per_shard(kv_budget("deepseek-r1-fp8.yaml")) < 0.85 * 128e9
    qwen = model_memory({**QWEN3_30B_A3B, "quantization_config": BLOCK_FP8}, 2, shards=1)
    assert 31e9 < qwen.weight_bytes_per_shard < 33e9
    assert qwen.total_per_shard(kv_budget("qwen3-30b-a3b-fp8.yaml")) < 0.85 * 96e9
