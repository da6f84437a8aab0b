"""The CPU decode kernel (grouped bmm over the gathered cache) gives SDPA's answer for every batch size and
grouping, including masked-out positions and a padded row with nothing in its cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_attention
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.device.cpu_attention import (
    GROUPED_MAX_KV_HEADS,
    GROUPED_MIN_BATCH,
    GROUPED_MIN_POSITIONS,
    grouped_decode_attention,
)
from gaudi_runtime.layers.attention_backend import AttentionBackend


def gathered(b: int, hkv: int, g: int, length: int, d: int, dtype=torch.float32):
    """q [B, Hkv, G, D] and K/V as the decode path hands them: transposed views of [B, L, Hkv, D]."""
    gen = torch.Generator().manual_seed(b * 100 + hkv * 10 + g)
    q = torch.randn(b, hkv, g, d, generator=gen).to(dtype)
    k = torch.randn(b, length, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, length, hkv, d, generator=gen).to(dtype)
    context = torch.randint(1, length + 1, (b,), generator=gen)
    context[0] = 0  # a padded row: only position 0 is allowed, as the decode path builds its mask
    pos = torch.arange(length)
    mask = ((pos[None] < context[:, None]) | (pos[None] == 0))[:, None, None, :]
    return q, k.transpose(1, 2), v.transpose(1, 2), mask


@pytest.mark.parametrize("b", [1, GROUPED_MIN_BATCH, 40])
@pytest.mark.parametrize("hkv,g", [(1, 8), (4, 2), (8, 1)])  # multi-query, grouped, multi-head
def test_equals_sdpa(b, hkv, g):
    q, k, v, mask = gathered(b, hkv, g, 48, 16)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
    torch.testing.assert_close(grouped_decode_attention(q, k, v, attn_mask=mask, scale=0.2), expected)


def test_bf16_close_to_float32_reference():
    q, k, v, mask = gathered(GROUPED_MIN_BATCH, 4, 2, 64, 32, torch.bfloat16)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    out = grouped_decode_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_non_contiguous_cache_falls_back_to_sdpa():
    q, k, v, mask = gathered(GROUPED_MIN_BATCH, 2, 2, 32, 8)
    k, v = k.contiguous(), v.contiguous()  # [B, Hkv, L, D] storage: no free [B, L, Hkv * D] view
    torch.testing.assert_close(grouped_decode_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_selected_for_cpu_decode_only():
    impl = CpuBackend().attention(True, False)
    assert impl.decode is grouped_decode_attention and "sdpa" in impl.name
    assert type(impl).prefill is AttentionBackend.prefill  # torch SDPA


@pytest.mark.parametrize("b,length", [(GROUPED_MIN_BATCH, 32), (4, GROUPED_MIN_POSITIONS // 4)],
                         ids=["large-batch", "long-context"])
def test_batched_matmuls_serve_large_batches_or_long_contexts_with_few_kv_heads(monkeypatch, b, length):
    """Where it is faster (batch >= 16 or long contexts, at most 4 KV heads) SDPA is not called at all."""
    q, k, v, mask = gathered(b, GROUPED_MAX_KV_HEADS, 2, length, 8)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("SDPA called")

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", no_sdpa)
    torch.testing.assert_close(grouped_decode_attention(q, k, v, attn_mask=mask), expected)
