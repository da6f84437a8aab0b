"""Qwen3-MoE's mixture of experts (gaudi_runtime.layers.moe) against transformers' Qwen3-MoE block.

* routing with ``norm_topk_prob`` on (weights renormalized to 1) and off (the softmax probabilities)
  picks transformers' experts and weights;
* the grouped path (each routed expert once, on its own tokens; CPU and eager CUDA) gives the static
  loop over every expert's output, and transformers', for token counts on both sides of the switch
  between the static paths, in float32 and bfloat16;
* on Gaudi, Habana's fused MoE op (through the recording fake) takes shapes that depend only on the
  token count and gives the same output.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.layers.moe import FusedMoE, expert_params_mapping, grouped_experts, route
from gaudi_runtime.models.loading import load_checkpoint

E, K, H, INTER = 16, 4, 32, 24


def block(norm_topk_prob: bool):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                                      num_experts_per_tok=K, norm_topk_prob=norm_topk_prob, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=32)
    moe = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "softmax_weights"])
def reference(request):
    return block(request.param)


class Holder(nn.Module):
    def __init__(self, renormalize: bool):
        super().__init__()
        self.mlp = FusedMoE(E, K, H, INTER, TPContext(), renormalize=renormalize)


def loaded(ref) -> FusedMoE:
    """Our layer with the block's weights, loaded under Qwen3-MoE's checkpoint names."""
    weights = [("mlp.gate.weight", ref.gate.weight.detach())]
    for e in range(E):
        gate, up = ref.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        weights += [(f"mlp.experts.{e}.gate_proj.weight", gate), (f"mlp.experts.{e}.up_proj.weight", up),
                    (f"mlp.experts.{e}.down_proj.weight", ref.experts.down_proj[e].detach())]
    holder = Holder(ref.gate.norm_topk_prob)
    with torch.no_grad():
        load_checkpoint(holder, weights, expert_params_mapping(E, "gate_proj", "up_proj", "down_proj"))
    return holder.mlp


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed))


def test_routing_matches_transformers_with_and_without_norm_topk_prob(reference):
    x = tokens(64).reshape(-1, H)
    with torch.no_grad():
        logits, ref_weights, ref_ids = reference.gate(x)
        weights, ids = route(logits, K, renormalize=reference.gate.norm_topk_prob)
    ref_ids, order = ref_ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.gather(1, order), rtol=0, atol=0)
    sums = weights.sum(-1)
    if reference.gate.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones(64))
    else:  # the top 4 of 16 softmax probabilities: less than 1
        assert (sums < 1).all()


# 1-3 tokens x top-4 < 16 experts: the static gathered path; 4 and more: the static loop over experts.
@pytest.mark.parametrize("n", [1, 3, 4, 17, 64])
def test_grouped_path_equals_static_paths_and_transformers(reference, n):
    moe = loaded(reference)
    x = tokens(n, seed=n)
    with torch.no_grad():
        static = moe(x)
        moe.kernel = grouped_experts
        grouped = moe(x)
        want = reference(x)
    torch.testing.assert_close(grouped, static, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)


def test_grouped_path_in_bfloat16_equals_the_loop_over_experts(reference):
    moe = loaded(reference).to(torch.bfloat16)
    x = tokens(40, seed=7).reshape(-1, H).to(torch.bfloat16)
    with torch.no_grad():
        weights, ids = route(moe.gate(x), K, moe.renormalize)
        dense = moe._dense(x, weights, ids)
        grouped = grouped_experts(x, weights, ids, moe.w13.weight, moe.w2.weight)
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped, dense, rtol=2e-2, atol=2e-2)


def test_grouped_path_runs_only_the_routed_experts(reference):
    """Cost follows the (token, expert) pairs: 2 tokens touch at most 8 of the 16 experts, and each
    expert's matmuls see only its own tokens."""
    moe = loaded(reference)
    x = tokens(2, seed=11).reshape(-1, H)
    rows_seen = []
    real_linear = torch.nn.functional.linear

    def counting_linear(inp, w, *a):
        rows_seen.append(inp.shape[0])
        return real_linear(inp, w, *a)

    with torch.no_grad():
        weights, ids = route(moe.gate(x), K, moe.renormalize)
        grouped_experts(x, weights, ids, moe.w13.weight, moe.w2.weight, linear=counting_linear)
    experts_used = len(set(ids.flatten().tolist()))
    assert len(rows_seen) == 2 * experts_used <= 2 * 2 * K
    assert sum(rows_seen) == 2 * 2 * K  # every (token, expert) pair once, through both matmuls


def test_hpu_fused_moe_op_has_static_shapes_and_the_same_output(fake_hpu, reference):
    from gaudi_runtime.device.hpu import HpuBackend

    holder = Holder(reference.gate.norm_topk_prob)
    holder.mlp = loaded(reference)
    HpuBackend(torch_device=torch.device("cpu")).prepare_model(holder)
    assert holder.mlp.kernel is not None
    for n in (1, 16):
        x = tokens(n, seed=20 + n)
        with torch.no_grad():
            got = holder.mlp(x)
            holder.mlp.kernel = None
            static = holder.mlp(x)
            holder.mlp.kernel = _hpu_kernel()
        torch.testing.assert_close(got, static, rtol=1e-5, atol=1e-6)
    calls = fake_hpu["mixture_of_experts"]
    assert [c["hidden_states"] for c in calls] == [(1, H), (16, H)]  # the token count, whatever the routing
    assert {c["experts"] for c in calls} == {(0, E - 1)} and {c["activation"] for c in calls} == {"silu"}


def _hpu_kernel():
    from gaudi_runtime.device.hpu import mixture_of_experts

    return mixture_of_experts
