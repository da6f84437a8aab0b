"""Float8 layers: per-channel weights, per-tensor inputs, sharded slices, tied heads, and the float8 KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.layers.attention import Attention, AttentionMetadata
from gaudi_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gaudi_runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPContext
from gaudi_runtime.quant.apply import quantize_model
from gaudi_runtime.quant.config import parse_quant_config
from gaudi_runtime.quant.fp8_linear import FP8, fp8_matmul, fp8_to, is_fp8, quantize_per_channel, to_fp8
from tests.unit.test_quant_config import tiny_llama


@dataclass(frozen=True)
class PartialTP(TPContext):
    """A rank of a 2-way group whose all-reduce is left to the test (it sums the ranks' partials)."""

    def all_reduce(self, x):
        return x


def cos(a, b) -> float:
    return float(F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0))


def test_per_channel_weights_round_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # channels of very different ranges
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8 and q.element_size() == 1 and scale.shape == (64,)
    back = q.float() * scale[:, None]
    # 3 mantissa bits: relative error <= 2^-4 for normal numbers; each channel uses its own range.
    assert ((back - w).abs() <= w.abs() / 16 + scale[:, None] * 2**-9).all()
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)


def test_column_parallel_slice_quantizes_like_the_full_weight():
    torch.manual_seed(1)
    full = torch.randn(32, 16)
    fq, fs = quantize_per_channel(full)
    for rank in range(2):
        layer = ColumnParallelLinear(16, 32, tp=TPContext(rank, 2))
        layer.weight_loader(layer.weight, full)
        to_fp8(layer, torch.float32)
        rows = slice(16 * rank, 16 * (rank + 1))
        assert torch.equal(layer.qweight.view(torch.uint8), fq[rows].view(torch.uint8))
        assert torch.equal(layer.weight_scale, fs[rows])


def test_row_parallel_ranks_sum_to_the_full_product_with_bias_once():
    torch.manual_seed(2)
    full, bias, x = torch.randn(24, 32), torch.randn(24), torch.randn(5, 32)
    parts = []
    for rank in range(2):
        layer = RowParallelLinear(32, 24, bias=True, tp=PartialTP(rank, 2))
        layer.weight_loader(layer.weight, full)
        layer.weight_loader(layer.bias, bias)
        to_fp8(layer, torch.float32)
        assert is_fp8(layer) and layer.qweight.shape == (24, 16)  # this rank's input slice only
        parts.append(layer(x[:, 16 * rank:16 * (rank + 1)]))
    ref = F.linear(x, full, bias)
    assert cos(parts[0] + parts[1], ref) > 0.998
    assert cos(parts[1], F.linear(x[:, 16:], full[:, 16:])) > 0.998  # rank 1 adds no bias


def test_static_input_scale_is_used_and_saturates_beyond_the_measured_range():
    torch.manual_seed(3)
    w, x = torch.randn(8, 16), torch.randn(4, 16)
    q, s = quantize_per_channel(w)
    dynamic = fp8_matmul(x, q, s, None)
    measured = torch.tensor(float(x.abs().max()) / 448)
    assert torch.allclose(fp8_matmul(x, q, s, measured), dynamic)
    too_small = torch.tensor(float(x.abs().max()) / 448 / 4)  # calibrated on 4x smaller inputs
    clipped = fp8_matmul(x, q, s, too_small)
    assert torch.allclose(clipped, F.linear(x.clamp(-x.abs().max() / 4, x.abs().max() / 4), q.float() * s[:, None]),
                          rtol=0.1, atol=0.1)
    assert not torch.allclose(clipped, dynamic, atol=0.1)


def test_dequantized_weight_stays_readable_for_code_that_uses_it():
    layer = QKVParallelLinear(16, 4, 4, 2)
    layer.weight.data.normal_()
    before = layer.weight.detach().clone()
    to_fp8(layer, torch.bfloat16)
    assert "weight" not in dict(layer.named_parameters())
    assert layer.weight.dtype == torch.bfloat16 and cos(layer.weight, before) > 0.999
    assert layer.num_heads == 4 and layer.q_size == 16  # attributes the model reads survive the swap


def test_embedding_and_tied_head_share_one_float8_table():
    model = tiny_llama(tie_word_embeddings=True)
    ids = torch.tensor([[1, 5, 7, 95]])
    ref = model.model.embed_tokens(ids)
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    quantize_model(model, parse_quant_config({}), torch.float32)
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, VocabParallelEmbedding) and isinstance(head, ParallelLMHead)
    assert emb.qweight is head.qweight and emb.weight_scale is head.weight_scale
    assert cos(emb(ids), ref) > 0.999
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held < 0.3 * bytes_before  # fp32 -> fp8 (+ scales), the tied table counted once


def _decode_out(cache_dtype, k_scale=1.0, v_scale=1.0):
    torch.manual_seed(4)
    attn = Attention(4, 2, 8)
    attn.k_scale, attn.v_scale = k_scale, v_scale
    blocks, bs = 6, 4
    cache = (torch.zeros(blocks, bs, 2, 8, dtype=cache_dtype), torch.zeros(blocks, bs, 2, 8, dtype=cache_dtype))
    k, v = torch.randn(1, 7, 2, 8) * 3, torch.randn(1, 7, 2, 8) * 3
    q = torch.randn(1, 7, 4, 8)
    slots = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])  # blocks 1 and 2
    attn(q, k, v, cache, AttentionMetadata(is_prefill=True, slots=slots))
    q1, k1, v1 = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    meta = AttentionMetadata(is_prefill=False, slots=torch.tensor([[11]]), block_tables=torch.tensor([[1, 2]]),
                             context_lens=torch.tensor([8]))
    return attn(q1, k1, v1, cache, meta), cache


@pytest.mark.parametrize("scale", [1.0, 0.02])
def test_float8_kv_cache_holds_one_byte_per_value_and_attends_like_the_full_cache(scale):
    ref, _ = _decode_out(torch.float32)
    out, cache = _decode_out(torch.float8_e4m3fn, scale, scale)
    assert cache[0].dtype == torch.float8_e4m3fn and cache[0].element_size() == 1
    assert cos(out, ref) > 0.995
    stored = cache[0][1].float() * scale
    assert stored.abs().max() > 1.0  # real keys landed in block 1, scaled back correctly


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_cpu_upcast_is_exact_for_every_float8_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = ~torch.isnan(codes.float())
    assert torch.equal(fp8_to(codes, dtype)[finite], codes.to(dtype)[finite])
