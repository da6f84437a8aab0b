"""Qwen3 (dense) served through HTTP equals transformers' greedy output, with 1 and 2 shards.

The tiny random-weight Qwen3 has what sets Qwen3 apart from Llama and Qwen2: an RMSNorm over each
head of q and k before the rotary embedding (with random weights, so a norm skipped or applied after
rope shows), a head_dim (32) that is not hidden / heads (16), biases on q, k, v and o
(``attention_bias``) and an LM head tied to the embeddings.
"""

from __future__ import annotations

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors, save_tokenizer
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"qwen3-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_config_fields():
    """attention_bias puts biases on o_proj too; a sliding window counts only with use_sliding_window."""
    from gaudi_runtime.models.qwen3 import Qwen3Config

    base = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 64,
            "max_position_embeddings": 256}
    plain = Qwen3Config.from_dict(base, "Qwen3ForCausalLM")
    assert not plain.qkv_bias and not plain.o_bias and plain.context_length == 256
    biased = Qwen3Config.from_dict({**base, "attention_bias": True, "use_sliding_window": True},
                                   "Qwen3ForCausalLM")
    assert biased.qkv_bias and biased.o_bias and biased.context_length == 64


def test_tiny_tokenizer_thinks_in_its_own_tokens(tmp_path):
    """<think> and </think> are single tokens that decode back to themselves, and the chat template
    writes an empty thinking section when the request turns thinking off."""
    tok, _ = save_tokenizer(tmp_path, "qwen3")
    ids = tok("<think>a</think>").input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<think>") and ids[-1] == tok.convert_tokens_to_ids("</think>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nyes"},
                {"role": "user", "content": "and?"}]
    thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<think>" not in thinking and thinking.endswith("<|im_start|>assistant\n")
    quiet = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
