"""Gemma served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight Gemma has what sets Gemma apart from Llama: a head_dim (32) that is not
hidden / heads (16), RMSNorm scaling by 1 + weight, embeddings scaled by sqrt(hidden), a GeGLU
(gelu-tanh) MLP and an LM head tied to the embeddings. Norm weights get random values (transformers
initializes Gemma's to 0, under which a norm scaling by weight instead of 1 + weight would give
no output at all, and one ignoring weight would pass).
"""

from __future__ import annotations

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma"), "gemma")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"gemma-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_config_activation_names():
    """Gemma's original configs say `gelu` and mean the tanh approximation; other activations are refused."""
    from gaudi_runtime.models.gemma import GemmaConfig

    base = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    cfg = GemmaConfig.from_dict({**base, "hidden_act": "gelu"}, "GemmaForCausalLM")
    assert cfg.head_dim == 8 and cfg.tie_word_embeddings  # Gemma's default: tied head
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        GemmaConfig.from_dict({**base, "hidden_act": "relu"}, "GemmaForCausalLM")
