"""A causal prefill on CPU run as matmuls in chunks of queries gives float32 attention's answer within
bfloat16's precision for every grouping, prompt lengths on and off the chunk size, and batches; it hands
float32 back to SDPA; and a layer uses it where its attention backend offers it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_attention
from gaudi_runtime.device.cpu_attention import CpuAttention, chunked_causal_attention
from gaudi_runtime.layers.attention import Attention, AttentionMetadata


def causal_case(b: int, hkv: int, g: int, s: int, d: int, dtype=torch.bfloat16):
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] as transposed views, as the layer hands them."""
    gen = torch.Generator().manual_seed(b * 1000 + hkv * 100 + g * 10 + s)
    q, k, v = (torch.randn(b, s, n, d, generator=gen).to(dtype).transpose(1, 2) for n in (hkv * g, hkv, hkv))
    return q, k, v


def reference(q, k, v, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                          v.float().repeat_interleave(g, 1), is_causal=True, scale=scale)


@pytest.mark.parametrize("s", [1, 7, 16, 17, 40])  # within one chunk, on its edge, across several
@pytest.mark.parametrize("hkv,g", [(1, 8), (2, 2), (4, 1)])  # multi-query, grouped, multi-head
def test_equals_float32_attention_on_bf16_inputs(monkeypatch, s, hkv, g):
    monkeypatch.setattr(cpu_attention, "CAUSAL_CHUNK", 16)
    q, k, v = causal_case(2, hkv, g, s, 16)
    out = chunked_causal_attention(q, k, v, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k, v, 0.3), atol=2e-2, rtol=2e-2)


def test_long_prompt_at_the_default_chunk_close_to_float32():
    q, k, v = causal_case(1, 4, 2, 300, 64)
    torch.testing.assert_close(chunked_causal_attention(q, k, v, 64 ** -0.5).float(),
                               reference(q, k, v, 64 ** -0.5), atol=2e-2, rtol=2e-2)


def test_a_query_never_sees_a_later_key(monkeypatch):
    """Changing the keys and values after position p leaves every output up to p as it was."""
    monkeypatch.setattr(cpu_attention, "CAUSAL_CHUNK", 8)
    q, k, v = causal_case(1, 2, 2, 20, 8)
    before = chunked_causal_attention(q, k, v, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 11:] += 3
    v2[:, :, 11:] -= 3
    after = chunked_causal_attention(q, k2, v2, 0.5)
    assert torch.equal(before[:, :, :11], after[:, :, :11])
    assert not torch.equal(before[:, :, 11:], after[:, :, 11:])


def test_float32_is_left_to_sdpa():
    assert chunked_causal_attention(*causal_case(1, 2, 2, 5, 8, torch.float32), 0.3) is None


def test_a_layer_prefills_through_it_where_installed(monkeypatch):
    """Through the layer (no cache): the installed kernel's answer, as SDPA's within bfloat16's precision."""
    hkv, g, d, s = 2, 3, 8, 21
    monkeypatch.setattr(cpu_attention, "CAUSAL_CHUNK", 8)
    layer = Attention(hkv * g, hkv, d)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, n, d, generator=gen).bfloat16() for n in (hkv * g, hkv, hkv))
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(2, s, dtype=torch.long))
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return chunked_causal_attention(*args)

    backend = CpuAttention()
    backend.causal_prefill = counted
    layer.backend = backend
    out = layer(q, k, v, None, meta)
    assert calls == [(2, hkv * g, s, d)]
    expected = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layer.scale).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected.reshape(2, s, -1), atol=2e-2, rtol=2e-2)
