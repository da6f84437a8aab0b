"""Multi-head latent attention and DeepSeek-V3's grouped router, as layers.

* decode with the absorbed projections (over gathered blocks, and over the flat layout HPU uses) gives
  the output of attention with keys and values expanded from the same latent;
* the cache a layer writes holds the latent and the rope key only;
* `grouped_route` chooses and weights experts as a plain per-token reading of the rule does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.layers.flat_paged_attention import flat_layout
from gaudi_runtime.layers.kv_cache import allocate_cache, cache_bytes_per_block
from gaudi_runtime.layers.mla import MLAShape, MLAttention
from gaudi_runtime.layers.moe import grouped_route
from gaudi_runtime.layers.rotary import RotaryEmbedding

SHAPE = MLAShape(hidden_size=48, num_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=12, norm_eps=1e-6)
BLOCK = 4


def _layer(shape: MLAShape = SHAPE) -> MLAttention:
    torch.manual_seed(0)
    layer = MLAttention(shape, RotaryEmbedding(shape.qk_rope_head_dim, 128), scale=0.3, tp=_tp())
    for p in layer.parameters():
        p.data = torch.randn(p.shape) * 0.3
    return layer


def _tp():
    from gaudi_runtime.layers.linear import TPContext

    return TPContext()


def _prefill(layer, x, cache, blocks):
    s = x.shape[1]
    slots = torch.tensor([[blocks[j // BLOCK] * BLOCK + j % BLOCK for j in range(s)]])
    return layer(x, torch.arange(s)[None], cache, AttentionMetadata(is_prefill=True, slots=slots))


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("flat", [False, True], ids=["gathered", "flat"])
def test_absorbed_decode_equals_expanded_attention(q_lora_rank, flat):
    shape = MLAShape(**{**SHAPE.__dict__, "q_lora_rank": q_lora_rank})
    layer = _layer(shape)
    x = torch.randn(1, 11, shape.hidden_size)
    blocks = [5, 2, 7]
    cache = allocate_cache(1, 9, BLOCK, layer.kv_token_shapes, torch.float32, "cpu")[0]
    with torch.no_grad():
        expanded = _prefill(layer, x, tuple(torch.zeros_like(t) for t in cache), blocks)[0, -1]
        _prefill(layer, x[:, :10], cache, blocks)
        slot = torch.tensor([[blocks[10 // BLOCK] * BLOCK + 10 % BLOCK], [0]])  # a padding row too
        meta = AttentionMetadata(is_prefill=False, slots=slot, block_tables=torch.tensor([blocks, [0, 0, 0]]),
                                 context_lens=torch.tensor([11, 0]))
        if flat:
            lists = flat_layout(np.array([blocks]), np.array([11]), BLOCK, rows=2, total=6)
            meta.block_list, meta.block_groups, meta.block_bias = (torch.from_numpy(a) for a in lists)
        x_dec = torch.cat([x[:, 10:], torch.zeros(1, 1, shape.hidden_size)])
        absorbed = layer(x_dec, torch.tensor([[10], [0]]), cache, meta)
    assert torch.isfinite(absorbed).all()
    torch.testing.assert_close(absorbed[0, 0], expanded, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_the_latent_and_the_rope_key_only():
    layer = _layer()
    assert layer.kv_token_shapes == ((1, 32), (1, 8))
    # per token and layer: 32 + 8 values, where keys and values of 4 heads would be 2 * 4 * 24
    assert cache_bytes_per_block(3, BLOCK, layer.kv_token_shapes, torch.bfloat16) == 3 * BLOCK * 40 * 2
    cache = allocate_cache(1, 4, BLOCK, layer.kv_token_shapes, torch.float32, "cpu")[0]
    with torch.no_grad():
        _prefill(layer, torch.randn(1, 3, SHAPE.hidden_size), cache, [2])
    assert [tuple(t.shape) for t in cache] == [(4, BLOCK, 1, 32), (4, BLOCK, 1, 8)]
    assert cache[0][2, :3].abs().sum() > 0 and cache[0][1].abs().sum() == 0


def _route_reference(logits, bias, top_k, n_group, topk_group, renormalize, factor):
    """The rule read token by token, with Python lists."""
    weights, ids = [], []
    per_group = logits.shape[1] // n_group
    for scores in torch.sigmoid(logits).tolist():
        choice = [s + b for s, b in zip(scores, bias.tolist())]
        groups = [sum(sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -groups[g])[:topk_group]
        candidates = [e for e in range(len(choice)) if e // per_group in kept]
        chosen = sorted(sorted(candidates, key=lambda e: -choice[e])[:top_k])
        w = [scores[e] for e in chosen]
        total = sum(w) if renormalize else 1.0
        weights.append([v / total * factor for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize("n_group,topk_group,top_k,renormalize", [(4, 2, 2, True), (2, 1, 3, False), (1, 1, 2, True)])
def test_grouped_route_matches_a_plain_reading_of_the_rule(n_group, topk_group, top_k, renormalize):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g)
    bias = torch.randn(8, generator=g) * 0.5
    weights, ids = grouped_route(logits, bias, top_k, n_group, topk_group, renormalize, 2.5)
    want_w, want_ids = _route_reference(logits, bias, top_k, n_group, topk_group, renormalize, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    # The bias chooses: without it some tokens get other experts; it never weights (weights are plain scores).
    _, unbiased = grouped_route(logits, torch.zeros(8), top_k, n_group, topk_group, renormalize, 2.5)
    assert not torch.equal(unbiased, ids)


def test_a_float8_latent_cache_gives_prefill_and_decode_the_same_latent():
    """Prefill attends to the latent as the float8 cache holds it, so a token decoded over the cache
    equals the same token computed in a prefill."""
    layer = _layer()
    x = torch.randn(1, 7, SHAPE.hidden_size)
    blocks = [3, 1]
    cache = allocate_cache(1, 5, BLOCK, layer.kv_token_shapes, torch.float8_e4m3fn, "cpu")[0]
    with torch.no_grad():
        whole = _prefill(layer, x, tuple(torch.zeros_like(t) for t in cache), blocks)[0, -1]
        _prefill(layer, x[:, :6], cache, blocks)
        meta = AttentionMetadata(is_prefill=False, slots=torch.tensor([[blocks[1] * BLOCK + 2]]),
                                 block_tables=torch.tensor([blocks]), context_lens=torch.tensor([7]))
        decoded = layer(x[:, 6:], torch.tensor([[6]]), cache, meta)[0, 0]
    torch.testing.assert_close(decoded, whole, atol=1e-5, rtol=1e-5)
