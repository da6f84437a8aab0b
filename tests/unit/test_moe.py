"""The mixture-of-experts layer (gaudi_runtime.layers.moe) against transformers' Mixtral block.

* routing: softmax, top-2, renormalized — the same experts and weights as transformers;
* both compute paths (gathered experts for few tokens, a loop over experts otherwise) give
  transformers' output in fp32 up to matmul rounding, for token counts on either side of the switch;
* loading the Mixtral checkpoint layout (``experts.{e}.w1/w2/w3``), whole or as two
  tensor-parallel ranks whose partial outputs sum to the whole; a missing expert is named.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.layers.moe import FusedMoE, expert_params_mapping, route
from gaudi_runtime.models.loading import load_checkpoint

E, K, H, INTER = 8, 2, 32, 48


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                     num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=32)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def checkpoint(block) -> list[tuple[str, torch.Tensor]]:
    """The block's weights under the names Mixtral checkpoints use."""
    out = [("block_sparse_moe.gate.weight", block.gate.weight.detach())]
    for e in range(E):
        gate, up = block.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        out += [(f"block_sparse_moe.experts.{e}.w1.weight", gate),
                (f"block_sparse_moe.experts.{e}.w3.weight", up),
                (f"block_sparse_moe.experts.{e}.w2.weight", block.experts.down_proj[e].detach())]
    return out


class Holder(nn.Module):
    def __init__(self, tp: TPContext):
        super().__init__()
        self.block_sparse_moe = FusedMoE(E, K, H, INTER, tp)


@dataclasses.dataclass(frozen=True)
class SummedLater(TPContext):
    """A rank of a 2-way group whose all-reduce the test does by hand."""

    def all_reduce(self, x):
        return x


def loaded(block, tp: TPContext = TPContext()) -> FusedMoE:
    holder = Holder(tp)
    with torch.no_grad():
        load_checkpoint(holder, checkpoint(block), expert_params_mapping(E))
    return holder.block_sparse_moe


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed))


def test_routing_picks_transformers_experts_and_weights(reference):
    x = tokens(64).reshape(-1, H)
    with torch.no_grad():
        logits, ref_weights, ref_ids = reference.gate(x)
        weights, ids = route(logits, K)
    ref_ids, order = ref_ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.gather(1, order), rtol=0, atol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    assert (ids[:, 0] < ids[:, 1]).all()


def test_route_without_renormalization_keeps_softmax_probabilities():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, probs[:, [2, 3]])


# 1-3 tokens x top-2 < 8 experts: gathered path; 4 and more: loop over the experts.
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64])
def test_output_equals_transformers(reference, n):
    moe = loaded(reference)
    x = tokens(n, seed=n)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference(x), rtol=1e-5, atol=1e-5)


def test_paths_agree_and_a_token_does_not_depend_on_its_batch(reference):
    moe = loaded(reference)
    x = tokens(16, seed=5).reshape(-1, H)
    with torch.no_grad():
        weights, ids = route(moe.gate(x), K)
        dense = moe._dense(x, weights, ids)
        gathered = moe._gathered(x, weights, ids)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(16)])
    torch.testing.assert_close(dense, gathered, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone, dense, rtol=1e-5, atol=1e-6)


def test_two_tensor_parallel_ranks_sum_to_the_whole(reference):
    ranks = [loaded(reference, SummedLater(rank=r, size=2)) for r in range(2)]
    assert ranks[0].w13.weight.shape == (E, INTER, H)  # 2 * INTER / 2 rows per expert
    assert ranks[0].w2.weight.shape == (E, H, INTER // 2)
    x = tokens(9, seed=3)
    with torch.no_grad():
        total = ranks[0](x) + ranks[1](x)
        torch.testing.assert_close(total, reference(x), rtol=1e-5, atol=1e-6)


def test_missing_expert_weight_is_named(reference):
    weights = [(n, t) for n, t in checkpoint(reference) if n != "block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(ValueError, match=r"w13\.weight:\(5, 'up'\)"):
        load_checkpoint(Holder(TPContext()), weights, expert_params_mapping(E))


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        FusedMoE(8, 9, H, INTER)


def _moe_kernel():
    from gaudi_runtime.device import cpu_moe

    kernel = cpu_moe.kernel()
    if kernel is None:
        pytest.fail("the experts kernel did not build here: is there a C compiler (cc or $CC)?")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens", [1, 5, 32, 160])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "per-expert"])
def test_the_cpu_experts_path_gives_transformers_output(reference, dtype, n_tokens, one_call):
    """The CPU backend's experts path gives transformers' block output: with the one-call kernel for steps
    of few rows per expert (grouped_experts past them: 160 tokens here), and without it, each expert's few
    decode rows through the few-row C kernel."""
    from gaudi_runtime.device import cpu_gemv
    from gaudi_runtime.device.cpu import experts_kernel

    gemv = cpu_gemv.kernel()
    if gemv is None:
        pytest.fail("the few-row kernel did not build here: is there a C compiler (cc or $CC)?")
    moe = loaded(reference)
    moe.kernel = experts_kernel(gemv, _moe_kernel() if one_call else None)
    x = tokens(n_tokens, seed=11)
    with torch.no_grad():
        want = reference(x)
        moe.to(dtype)
        got = moe(x.to(dtype)).float()
    # bfloat16: a few of 160 tokens' outputs (values up to ~4) are off by up to 0.12 on either path.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.15)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_experts_in_one_call_do_not_depend_on_the_rest_of_the_step(reference, dtype):
    """A token's output from the one-call kernel has the same bits alone as among other tokens routed to
    the same experts; and equals the per-expert torch path within the dtype's rounding."""
    from gaudi_runtime.layers.moe import grouped_experts

    kernel = _moe_kernel()
    moe = loaded(reference).to(dtype)
    x = tokens(7, seed=5).reshape(-1, H).to(dtype)
    with torch.no_grad():
        weights, ids = moe.route(x)
        w13, w2 = moe.w13.experts(dtype), moe.w2.experts(dtype)
        together = kernel(x, weights, ids, w13, w2)
        alone = torch.cat([kernel(x[i:i + 1], weights[i:i + 1], ids[i:i + 1], w13, w2) for i in range(7)])
        torch_path = grouped_experts(x, weights, ids, w13, w2)
    assert torch.equal(together, alone)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(together.float(), torch_path.float(), **tol)
