"""Flat paged decode attention (HPU's decode): the blocks a batch uses laid out flat give the same
attention as each row's softmax over its own context, with Habana's fused rescale or without it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gaudi_runtime.layers.attention import Attention, AttentionMetadata
from gaudi_runtime.layers.flat_paged_attention import flat_layout, flat_paged_decode

INF = float("-inf")


def test_flat_layout_lists_the_blocks_in_use_row_after_row():
    tables = np.array([[5, 9, 2], [7, 6, 0], [3, 4, 8]])
    block_list, block_groups, block_bias = flat_layout(tables, np.array([6, 2, 9]), 4, rows=4, total=8)
    assert block_list.tolist() == [5, 9, 7, 3, 4, 8, 0, 0]  # 2 + 1 + 3 blocks, then padding (block 0)
    assert block_groups.tolist() == [0, 0, 1, 2, 2, 2, 4, 4]  # padding: group 4, past the 4 rows
    assert block_bias.dtype == np.float32
    assert block_bias.tolist() == [[0, 0, 0, 0], [0, 0, INF, INF],  # row 0: 6 tokens
                                   [0, 0, INF, INF],  # row 1: 2 tokens
                                   [0, 0, 0, 0], [0, 0, 0, 0], [0, INF, INF, INF],  # row 2: 9 tokens
                                   [0, INF, INF, INF], [0, INF, INF, INF]]  # padding keeps position 0
    empty = flat_layout(tables[:2], np.array([0, 4]), 4, rows=2, total=2)  # a row of context 0 has no block
    assert empty[0].tolist() == [7, 0] and empty[1].tolist() == [1, 2]


def test_flat_layout_refuses_blocks_past_the_bucket():
    with pytest.raises(ValueError, match="do not fit"):
        flat_layout(np.array([[1, 2, 3]]), np.array([9]), 4, rows=1, total=2)
    with pytest.raises(ValueError, match="do not fit"):
        flat_layout(np.array([[1, 2]]), np.array([9]), 4, rows=1, total=4)  # the table is too narrow


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Each row's softmax over its own first `lens` positions, in float64 (zeros for a row of context 0)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        if n:
            k = k_cache[torch.from_numpy(tables[i])].flatten(0, 1)[:n].double().repeat_interleave(g, 1)
            v = v_cache[torch.from_numpy(tables[i])].flatten(0, 1)[:n].double().repeat_interleave(g, 1)
            probs = (torch.einsum("hd,lhd->hl", q[i].double(), k) * scale).softmax(-1)
            out[i] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def random_batch(seed, hq, hkv, dtype, block_size=4, d=16, rows=6, n=5):
    """n real rows of 1 to 5 blocks (lengths not multiples of the block size, one row of context 0) over
    blocks in random order, `rows` rows in all."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k_cache = torch.randn(64, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(64, block_size, hkv, d, generator=gen).to(dtype)
    tables = rng.permutation(np.arange(1, 64))[: n * 5].reshape(n, 5)
    lens = rng.integers(1, 5 * block_size + 1, size=n)
    lens[:3] = [1, 5 * block_size - 1, 0]
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain-rescale", "fused-rescale"])
def test_flat_decode_equals_each_rows_softmax(fake_hpu, heads, dtype, tol, fused):
    adjust = torch.ops.hpu.block_softmax_adjustment if fused else None
    for seed in range(4):
        q, k_cache, v_cache, tables, lens = random_batch(seed, *heads, dtype)
        rows, total = q.shape[0], 32  # padded rows and padded blocks
        layout = [torch.from_numpy(a) for a in flat_layout(tables, lens, 4, rows, total)]
        out = flat_paged_decode(q, k_cache, v_cache, *layout, 0.25, adjust=adjust)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out).all()  # the row of context 0 and the padded row included
        want = reference(q, k_cache, v_cache, tables, lens, 0.25)
        torch.testing.assert_close(out[: len(lens)].double(), want[: len(lens)], atol=tol, rtol=tol)
    calls = fake_hpu["block_softmax_adjustment"]
    assert len(calls) == (4 if fused else 0)
    assert all(c["batch_size"] == 6 and c["block_max"] == (32, heads[0], 1, 1) for c in calls)


def hpu_attention(use_flash: bool = True):
    """The attention backend the HPU backend chooses (the fake bridge loaded)."""
    from gaudi_runtime.device.hpu import HpuBackend

    return HpuBackend(torch_device=torch.device("cpu")).attention(use_flash, False)


def layer_decode(meta_kind, kv_dtype, backend):
    """One decode step of an attention layer over a paged cache holding three rows of 2 to 9 tokens."""
    torch.manual_seed(0)
    layer = Attention(num_heads=8, num_kv_heads=2, head_dim=16, backend=backend)
    layer.k_scale, layer.v_scale = (0.5, 0.25) if kv_dtype != torch.float32 else (1.0, 1.0)
    cache = tuple(torch.zeros(16, 4, 2, 16, dtype=kv_dtype) for _ in range(2))
    tables, lens = np.array([[3, 7, 1], [9, 0, 0], [4, 5, 12]]), np.array([6, 2, 9])  # with the new token
    for i, n in enumerate(lens):  # every row's earlier tokens
        slots = torch.from_numpy(tables[i, np.arange(n - 1) // 4] * 4 + np.arange(n - 1) % 4)
        k, v = torch.randn(1, n - 1, 2, 16), torch.randn(1, n - 1, 2, 16)
        layer(torch.randn(1, n - 1, 8, 16), k, v, cache, AttentionMetadata(is_prefill=True, slots=slots[None]))
    pos = lens - 1
    slots = torch.from_numpy(tables[np.arange(3), pos // 4] * 4 + pos % 4)[:, None]
    q, k, v = torch.randn(3, 1, 8, 16), torch.randn(3, 1, 2, 16), torch.randn(3, 1, 2, 16)
    if meta_kind == "flat":
        block_list, groups, bias = (torch.from_numpy(a) for a in flat_layout(tables, lens, 4, 3, 8))
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_list=block_list, block_groups=groups,
                                 block_bias=bias)
    else:
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_tables=torch.from_numpy(tables),
                                 context_lens=torch.from_numpy(lens))
    return layer(q, k, v, cache, meta)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8-cache"])
def test_hpu_attention_layer_decodes_over_the_flat_layout_as_over_gathered_blocks(fake_hpu, kv_dtype):
    impl = hpu_attention()
    assert impl.flat_decode is not None and "flat paged" in impl.name
    flat = layer_decode("flat", kv_dtype, impl)
    assert len(fake_hpu["block_softmax_adjustment"]) == 1
    gathered = layer_decode("gathered", kv_dtype, impl)  # FusedSDPA over the gathered blocks
    torch.testing.assert_close(flat, gathered, atol=1e-5, rtol=1e-5)


def test_a_bridge_without_the_fused_op_rescales_with_plain_ops(fake_hpu, monkeypatch, caplog):
    from gaudi_runtime.device import hpu

    with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="gaudi_runtime.device.hpu"):
        patch.setattr(torch.ops, "hpu", object())  # a bridge that registers no such op
        assert hpu.block_softmax_adjustment() is None
        impl = hpu_attention()
    assert sum("block_softmax_adjustment" in r.getMessage() for r in caplog.records) == 2  # once per lookup
    torch.testing.assert_close(layer_decode("flat", torch.float32, impl),
                               layer_decode("gathered", torch.float32, impl))
    assert fake_hpu["block_softmax_adjustment"] == []


def test_the_math_fallback_keeps_the_gather_on_hpu(fake_hpu):
    impl = hpu_attention(use_flash=False)
    assert impl.flat_decode is None
    with pytest.raises(ValueError, match="flat block layout"):
        layer_decode("flat", torch.float32, impl)
