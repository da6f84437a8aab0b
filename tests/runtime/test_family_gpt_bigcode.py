"""Starcoder (GPTBigCode) served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight GPTBigCode has what sets Starcoder apart: multi-query attention (one KV
head, replicated on both ranks with 2 shards) from a fused ``c_attn`` (q: hidden, k and v: one
head each), learned absolute positions (``wpe``, no rotary), LayerNorms, biases on every linear
layer, a gelu-tanh MLP and an LM head tied to ``wte``. Norm weights and biases get random values
(transformers initializes them to 1 and 0). Variants transformers also accepts (per-head q/k/v
without multi-query, unscaled attention, other GELU formulas) are checked in process.
"""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.tools.tiny_model import make_config, make_tiny_model, randomize_vectors
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve
from tests.runtime.forward_parity import assert_prefill_logits_match, write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("starcoder"), "starcoder")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"starcoder-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


@pytest.mark.parametrize("overrides", [
    dict(multi_query=False),
    dict(scale_attn_weights=False, activation_function="gelu_new"),
    dict(activation_function="gelu", tie_word_embeddings=False),
], ids=["per-head-qkv", "unscaled-attention-gelu-new", "exact-gelu-untied-head"])
def test_variants_match_transformers(overrides, tmp_path):
    cfg = make_config("starcoder", vocab_size=128, **overrides)
    assert_prefill_logits_match(write_model(cfg, tmp_path / "model"))


def test_context_is_the_position_table(model_dir):
    """n_positions (1024) bounds what the model serves; positions past it (bucket padding) stay in the table."""
    from gaudi_runtime.layers.attention import AttentionMetadata
    from gaudi_runtime.models import load_model

    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    assert model.max_position_embeddings == 1024
    assert model.num_kv_heads == 1
    assert model.lm_head.weight is model.transformer.wte.weight
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(1, 2, dtype=torch.long))
    hidden = model(torch.tensor([[5, 6]]), torch.tensor([[1023, 1100]]), None, meta)
    assert torch.isfinite(hidden).all()


def test_unknown_activation_is_refused_naming_it():
    from gaudi_runtime.models.gpt_bigcode import GPTBigCodeConfig

    cfg = {"vocab_size": 16, "n_embd": 8, "n_layer": 1, "n_head": 2, "activation_function": "mish"}
    with pytest.raises(ValueError, match="unsupported GPTBigCode activation_function 'mish'"):
        GPTBigCodeConfig.from_dict(cfg, "GPTBigCodeForCausalLM")
