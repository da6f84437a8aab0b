"""A prefill over cached blocks on CPU (new tokens against the gathered context, then causally against
each other) in bfloat16 gives float32 SDPA's answer within bfloat16's precision for every grouping,
ragged contexts and padded rows, and hands float32 and shapes too large for it back to SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu, cpu_attention
from gaudi_runtime.device.base import Backend
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.device.cpu_attention import (
    CpuAttention,
    chunked_causal_attention,
    grouped_context_attention,
)
from gaudi_runtime.layers.attention import Attention, AttentionMetadata, context_prefill_mask

BLOCK = 4


def context_prefill_case(b: int, hkv: int, g: int, s: int, blocks: int, d: int, dtype=torch.float32):
    """q [B, Hq, S, D], k/v [B, Hkv, L + S, D] (transposed views, as the layer hands them) and the additive
    mask the layer builds: row 0 is a padded row with no context, the others hold ragged contexts."""
    gen = torch.Generator().manual_seed(b * 1000 + hkv * 100 + g * 10 + s)
    length = blocks * BLOCK
    q = torch.randn(b, s, hkv * g, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, length + s, hkv, d, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, length + s, hkv, d, generator=gen).to(dtype).transpose(1, 2)
    context = torch.randint(1, blocks + 1, (b,), generator=gen) * BLOCK
    context[0] = 0
    return q, k, v, context_prefill_mask(context, length, s, dtype)


def sdpa(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask,
                                          scale=scale)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("hkv,g", [(1, 8), (4, 2), (8, 1)])  # multi-query, grouped, multi-head
def test_equals_sdpa_in_float32_on_bf16_inputs(b, hkv, g):
    q, k, v, mask = context_prefill_case(b, hkv, g, s=7, blocks=5, d=16, dtype=torch.bfloat16)
    expected = sdpa(q.float(), k.float(), v.float(), mask.float(), 0.2)
    out = grouped_context_attention(q, k, v, mask, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_long_contexts_close_to_float32_reference():
    q, k, v, mask = context_prefill_case(2, 4, 2, s=24, blocks=64, d=32, dtype=torch.bfloat16)
    expected = sdpa(q.float(), k.float(), v.float(), mask.float(), 32 ** -0.5)
    torch.testing.assert_close(grouped_context_attention(q, k, v, mask, 32 ** -0.5).float(), expected,
                               atol=2e-2, rtol=2e-2)


def test_float32_is_left_to_sdpa():
    assert grouped_context_attention(*context_prefill_case(1, 2, 2, s=4, blocks=2, d=8), 0.3) is None


def test_scores_beyond_the_cap_are_left_to_sdpa(monkeypatch):
    q, k, v, mask = context_prefill_case(2, 2, 2, s=8, blocks=4, d=8, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_attention, "GROUPED_CONTEXT_MAX_SCORES", q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] - 1)
    assert grouped_context_attention(q, k, v, mask, 0.3) is None


@pytest.mark.parametrize("cap", [None, 0], ids=["matmuls", "over-the-cap"])
def test_a_layer_reading_cached_blocks_answers_as_sdpa_does(monkeypatch, cap):
    """Through the layer: cached blocks gathered from a paged cache, new K/V written and attended to."""
    hkv, g, d, s = 2, 3, 8, 5
    layer = Attention(hkv * g, hkv, d)
    gen = torch.Generator().manual_seed(7)
    caches = [torch.randn(10, BLOCK, hkv, d, generator=gen).bfloat16() for _ in range(2)]
    q, k, v = (torch.randn(2, s, n, d, generator=gen).bfloat16() for n in (hkv * g, hkv, hkv))
    tables = torch.tensor([[3, 5, 1], [7, 0, 0]])
    context_lens = torch.tensor([3 * BLOCK, BLOCK])
    slots = torch.stack([8 * BLOCK + torch.arange(s), 2 * BLOCK + torch.arange(s)])

    def run(context_prefill):
        layer.backend = CpuAttention()
        layer.backend.context_prefill = context_prefill
        kv = tuple(c.clone() for c in caches)
        meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=tables, context_lens=context_lens)
        return layer(q, k, v, kv, meta)

    calls = []

    def counted(*args):
        out = grouped_context_attention(*args)
        calls.append(out is not None)
        return out

    if cap is not None:
        monkeypatch.setattr(cpu_attention, "GROUPED_CONTEXT_MAX_SCORES", cap)
    torch.testing.assert_close(run(counted).float(), run(None).float(), atol=2e-2, rtol=2e-2)
    assert calls == [cap is None]  # the matmuls answered, or handed the shape back to SDPA


@pytest.mark.parametrize("native", [True, False])
def test_the_matmul_prefills_are_selected_for_cpu_with_native_bf16_only(monkeypatch, native):
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    expected = (grouped_context_attention, chunked_causal_attention) if native else (None, None)
    eager = Backend(torch.device("cpu"))  # what CUDA runs: the base's attention
    for backend, flash in ((CpuBackend(), True), (eager, True), (CpuBackend(), False)):
        impl = backend.attention(flash, False)
        chosen = (impl.context_prefill, impl.causal_prefill)
        assert chosen == (expected if (type(backend), flash) == (CpuBackend, True) else (None, None))
