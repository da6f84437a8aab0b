"""Starcoder2 served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight Starcoder2 has LayerNorms with bias, biases on q/k/v/o and on the
GELU-tanh MLP (c_fc, c_proj), grouped-query attention with RoPE, a sliding window (which caps
the context the runtime serves) and a tied LM head. Norm weights and biases get random values
(transformers initializes them to 1 and 0, under which an unloaded bias would go unnoticed).
"""

from __future__ import annotations

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("starcoder2"), "starcoder2")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"starcoder2-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_context_is_capped_at_the_sliding_window(model_dir):
    """Window 2048 < max_position_embeddings 4096: the model reports 2048, so no sequence outgrows the window."""
    import torch

    from gaudi_runtime.models import load_model

    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    assert model.max_position_embeddings == 2048
    assert model.lm_head.weight is model.model.embed_tokens.weight
