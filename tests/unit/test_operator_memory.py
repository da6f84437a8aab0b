"""The operator's memory estimate (gaudi_operator.estimate.model_memory) from config.json alone.

* a mixture-of-experts model counts every expert's weights, not the few a token activates: the
  estimate's parameters are the checkpoint's, tensor for tensor, for tiny Qwen3-MoE and Mixtral
  models, and Qwen3-30B-A3B's config gives its 30.5B (not its 3.3B active);
* per shard it is the parameters the runtime's rank holds once loaded;
* the KV cache per token follows the KV heads each rank keeps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from gaudi_operator.estimate import model_memory
from gaudi_runtime.tools.tiny_model import make_tiny_model

# Qwen3-30B-A3B's config.json (the fields the estimate reads).
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen3"])
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
