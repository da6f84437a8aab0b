"""An attention layer with a sliding window and/or a soft cap (Gemma 2/3's local and global layers) gives a
plain masked softmax's answer on every path: a prefill, a prefill over cached blocks (prefix caching,
chunked prefill), and decode through the CPU's paged C kernel, the gathered blocks, the flat layout
(HPU's, through the recording fake) - on rows shorter and longer than the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gaudi_runtime.device import cpu_paged_attention
from gaudi_runtime.device.cpu_attention import CpuAttention
from gaudi_runtime.layers.attention import Attention, AttentionMetadata
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.attention_window import flat_window_bias
from gaudi_runtime.layers.flat_paged_attention import flat_layout, flat_paged_decode

HQ, HKV, D, BS = 8, 2, 16, 4
LENGTHS = [3, 11, 23, 40, 1]  # shorter than the window of 8, longer, many windows long, one token
BANDS = [(8, None), (8, 5.0), (None, 5.0), (1, None)]
BAND_IDS = ["window", "window+softcap", "softcap", "window-1"]


def reference(q, keys, values, positions, window, softcap, scale):
    """q ``[S, Hq, D]`` at `positions` over the row's keys/values ``[n, Hkv, D]``: float32 softmax over the
    positions each query sees (causal, inside the window), scores soft-capped."""
    out = []
    for qi, p in zip(q, positions):
        k = keys.float().repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
        v = values.float().repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("hd,nhd->hn", qi.float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        j = torch.arange(k.shape[0])
        seen = (j <= p) & ((p - j < window) if window is not None else True)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


class Rows:
    """Random keys, values and queries for each row, and a paged cache with blocks in shuffled order."""

    def __init__(self, lengths, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.keys = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
        self.values = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
        self.queries = [torch.randn(n, HQ, D, generator=gen) * 2 for n in lengths]
        width = max(-(-n // BS) for n in lengths) + 1
        order = (torch.randperm(len(lengths) * width, generator=gen) + 1).numpy()
        self.tables = order.reshape(len(lengths), width)
        self.cache = tuple(torch.zeros(len(lengths) * width + 1, BS, HKV, D) for _ in range(2))

    def slots(self, row, positions):
        positions = np.asarray(positions, dtype=np.int64)
        return torch.from_numpy(self.tables[row, positions // BS] * BS + positions % BS)

    def batch(self, rows, start, stop):
        """Right-padded q/k/v ``[B, S, H, D]`` and slots of positions start[r] .. stop[r] - 1 of each row."""
        s = max(b - a for a, b in zip(start, stop))
        q, k, v = torch.zeros(len(rows), s, HQ, D), torch.zeros(len(rows), s, HKV, D), torch.zeros(len(rows), s, HKV, D)
        slots = torch.zeros(len(rows), s, dtype=torch.long)
        for i, (r, a, b) in enumerate(zip(rows, start, stop)):
            q[i, :b - a], k[i, :b - a], v[i, :b - a] = self.queries[r][a:b], self.keys[r][a:b], self.values[r][a:b]
            slots[i, :b - a] = self.slots(r, range(a, b))
        return q, k, v, slots

    def expected(self, row, positions, layer):
        return reference(self.queries[row][positions], self.keys[row], self.values[row], positions,
                         layer.window, layer.softcap, layer.scale)


def hpu_backend():
    """The attention the HPU backend chooses (FusedSDPA, flat decode), over the recording fake bridge."""
    from gaudi_runtime.device.hpu import HpuBackend

    return HpuBackend(torch_device=torch.device("cpu")).attention(True, False)


def prefill_backend(name, request):
    if name == "hpu":
        request.getfixturevalue("fake_hpu")
        return hpu_backend()
    return CpuAttention() if name == "cpu" else None


def make_layer(band, backend=None):
    window, softcap = band
    return Attention(HQ, HKV, D, scale=0.3, backend=backend, window=window, softcap=softcap)


@pytest.mark.parametrize("band", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("backend", ["sdpa", "hpu"])
def test_prefill_sees_only_its_window(band, backend, request):
    rows, layer = Rows(LENGTHS), make_layer(band, prefill_backend(backend, request))
    q, k, v, slots = rows.batch(range(len(LENGTHS)), [0] * len(LENGTHS), LENGTHS)
    out = layer(q, k, v, rows.cache, AttentionMetadata(is_prefill=True, slots=slots)).view(*q.shape)
    for r, n in enumerate(LENGTHS):
        torch.testing.assert_close(out[r, :n], rows.expected(r, list(range(n)), layer), atol=1e-5, rtol=1e-5)
    if backend == "hpu" and layer.softcap is None:  # FusedSDPA under the window's mask, not its causal mode
        assert [c["is_causal"] for c in request.getfixturevalue("fake_hpu")["fused_sdpa"]] == [False]


@pytest.mark.parametrize("band", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("backend", ["sdpa", "cpu", "hpu"])
def test_prefill_over_cached_blocks_sees_only_its_window(band, backend, request):
    """The first tokens of each row are cached (not a whole number of blocks: a chunk's end); the rest
    attend to them through the block table, then to each other."""
    rows = Rows(LENGTHS)
    layer = make_layer(band, prefill_backend(backend, request))
    cached = [n // 2 for n in LENGTHS]
    q, k, v, slots = rows.batch(range(len(LENGTHS)), [0] * len(LENGTHS), cached)
    layer(q, k, v, rows.cache, AttentionMetadata(is_prefill=True, slots=slots))
    q, k, v, slots = rows.batch(range(len(LENGTHS)), cached, LENGTHS)
    width = max(-(-c // BS) for c in cached)
    meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=torch.from_numpy(rows.tables[:, :width]),
                             context_lens=torch.tensor(cached))
    out = layer(q, k, v, rows.cache, meta).view(*q.shape)
    for r, (c, n) in enumerate(zip(cached, LENGTHS)):
        torch.testing.assert_close(out[r, :n - c], rows.expected(r, list(range(c, n)), layer), atol=1e-5, rtol=1e-5)


def decode_step(rows: Rows, layer: Attention, flat: bool):
    """Each row's last token decoded over its cache (the others written by a prefill first)."""
    history = [n - 1 for n in rows.lengths]
    q, k, v, slots = rows.batch(range(len(rows.lengths)), [0] * len(history), history)
    layer(q, k, v, rows.cache, AttentionMetadata(is_prefill=True, slots=slots))
    q, k, v, slots = rows.batch(range(len(rows.lengths)), history, rows.lengths)
    lens = np.array(rows.lengths)
    if flat:
        arrays = flat_layout(rows.tables, lens, BS, len(lens), 32)
        block_list, groups, bias = (torch.from_numpy(a) for a in arrays)
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_list=block_list, block_groups=groups,
                                 block_bias=bias)
    else:
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_tables=torch.from_numpy(rows.tables),
                                 context_lens=torch.from_numpy(lens))
    return layer(q, k, v, rows.cache, meta).view(len(lens), HQ, D)


def check_decode(out, rows, layer):
    for r, n in enumerate(rows.lengths):
        torch.testing.assert_close(out[r], rows.expected(r, [n - 1], layer)[0], atol=1e-5, rtol=1e-5)


class FlatBackend(AttentionBackend):
    flat_decode = staticmethod(flat_paged_decode)


@pytest.mark.parametrize("band", BANDS, ids=BAND_IDS)
@pytest.mark.parametrize("path", ["paged-kernel", "gathered", "flat"])
def test_decode_sees_only_its_window(band, path):
    if path == "paged-kernel":
        kernel = cpu_paged_attention.kernel()
        assert kernel is not None, "the paged C kernel did not build here"
        backend = CpuAttention(kernel)
    else:
        backend = FlatBackend() if path == "flat" else AttentionBackend()
    rows = Rows(LENGTHS)
    check_decode(decode_step(rows, make_layer(band, backend), flat=path == "flat"), rows, make_layer(band))


@pytest.mark.parametrize("band", BANDS, ids=BAND_IDS)
def test_hpu_flat_decode_masks_what_is_out_of_the_window(fake_hpu, band):
    """Through the recording fake: Habana's fused rescale receives blocks wholly outside the window."""
    backend = hpu_backend()
    rows = Rows(LENGTHS)
    check_decode(decode_step(rows, make_layer(band, backend), flat=True), rows, make_layer(band))
    assert len(fake_hpu["block_softmax_adjustment"]) == 1


def test_flat_window_bias_masks_positions_before_each_rows_window():
    tables, lens = np.array([[3, 7, 1], [9, 0, 0], [4, 5, 12]]), np.array([6, 2, 9])
    _, groups, bias = (torch.from_numpy(a) for a in flat_layout(tables, lens, 4, 4, 8))
    windowed = flat_window_bias(groups, bias, 4, window=3)
    seen = (windowed == 0).int().tolist()
    # row 0 (6 tokens): positions 3..5; row 1 (2): 0..1; row 2 (9): 6..8; padding blocks keep position 0
    assert seen[:6] == [[0, 0, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]]
    assert seen[6:] == [[1, 0, 0, 0]] * 2
    assert bool(torch.isfinite(windowed.amax(-1)).all())  # no block without a finite maximum
