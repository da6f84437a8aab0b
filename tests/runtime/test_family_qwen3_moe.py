"""Qwen3-MoE served through HTTP equals transformers' greedy output.

The tiny random-weight Qwen3-MoE has 16 experts, 4 per token with ``norm_topk_prob``, Qwen3's q/k
norms, and a dense layer (layer 0, by ``mlp_only_layers``) before a sparse one. On CPU each routed
expert runs on its own tokens (``layers/moe.grouped_experts``). Served with 1 and 2 shards (each
shard holding its slice of every expert: tests/unit/test_operator_memory.py counts a rank's bytes), and
with 2 shards under prefix caching, chunked prefill (prompts over ``--max-batch-prefill-tokens``) and
n-gram speculation (``--speculate 3``) at once.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import (
    PROMPTS,
    check_concurrent_requests,
    check_single_requests,
    generate_ids,
    serve,
)
from tests.runtime.launched import SMALL_ARGS, get_json, greedy_reference
from tests.runtime.prefix_checks import check_conversations


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"qwen3moe-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_chunked_prefill_prefix_caching_and_speculation(model_dir, tmp_path):
    """Long prompts are prefilled in chunks between decode steps, conversations hit the prefix cache,
    and drafts are verified by the experts: still transformers' tokens."""
    args = (*SMALL_ARGS, "--max-batch-prefill-tokens", "16", "--prefix-caching", "true", "--speculate", "3")
    srv = serve(model_dir, tmp_path, 2, args=args)
    long_prompts = [PROMPTS[1] + " " + PROMPTS[4], "the cat the cat the cat the cat the cat the cat the cat the cat"]
    try:
        async def run():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(generate_ids(s, srv.url, p, 16) for p in long_prompts))

        for prompt, ids in zip(long_prompts, asyncio.run(run())):
            assert ids == greedy_reference(model_dir, prompt, 16), prompt
        check_conversations(srv, conversations=3, turns=3)
        info = get_json(srv.url + "/info")[1]
        assert info["prefill_chunks"] > 0 and info["speculate"] == 3
    finally:
        srv.stop()


def test_dense_and_sparse_layers_from_config():
    """mlp_only_layers and decoder_sparse_step choose the dense layers, as transformers does."""
    from gaudi_runtime.models.qwen3_moe import Qwen3MoeConfig

    base = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 6,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    cfg = Qwen3MoeConfig.from_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
                                   "Qwen3MoeForCausalLM")
    assert cfg.sparse_layers == (False, True, False, False, False, True)
    assert not cfg.norm_topk_prob  # transformers' default for Qwen3-MoE
    assert Qwen3MoeConfig.from_dict(base, "Qwen3MoeForCausalLM").sparse_layers == (True,) * 6
    with pytest.raises(ValueError, match="decoder_sparse_step 0"):
        Qwen3MoeConfig.from_dict({**base, "decoder_sparse_step": 0}, "Qwen3MoeForCausalLM")


def test_hpu_graphs_run_habanas_moe_op_and_give_the_cpu_tokens(fake_hpu, model_dir):
    """On Gaudi (the recording fake) every sparse layer goes through Habana's fused MoE op, whose shapes
    depend only on the token count: serving replays the graphs warmup captured, and the tokens are the
    CPU path's (each expert on its own tokens)."""
    import torch

    from gaudi_runtime.device.cpu import CpuBackend
    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.shard.runner import ModelRunner
    from tests.runtime.test_hpu_paged_decode import config, generate

    cfg = config(model_dir)
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    fake_hpu["mixture_of_experts"].clear()
    on_hpu = generate(hpu)
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0  # serving compiled nothing
    calls = fake_hpu["mixture_of_experts"]
    assert calls and {c["experts"] for c in calls} == {(0, 15)}
    assert generate(ModelRunner(cfg, str(model_dir), CpuBackend())) == on_hpu
