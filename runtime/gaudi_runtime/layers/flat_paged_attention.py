"""Decode attention over the blocks a batch actually uses, laid out flat (Habana's "flat paged attention").

A padded block table makes every row of a decode step as wide as the batch's longest one: with one long
row and many short ones, attention reads and computes rows x widest-row blocks. Here the step instead
lists the T blocks in use, each tagged with its row (`block_groups`) and an additive bias that masks the
positions past the row's length (`block_bias`); T is padded to a bucket of total blocks. Each block is
scored against its row's query on its own, in float32, giving a per-block maximum and sum; a per-block
rescale then turns the per-block softmaxes into the row's softmax:

    rescale = exp(block_max - row_max) / sum over the row's blocks of block_sum * exp(block_max - row_max)

and the rescaled per-block weighted values are summed back into their rows. Habana's bridge computes
that rescale in one fused op (``torch.ops.hpu.block_softmax_adjustment``, passed as `adjust`); without it,
`block_rescale` does the same with plain ops.

`flat_layout` builds the three arrays on the host (numpy, vectorized); `flat_paged_decode` is device
agnostic torch.
"""

from __future__ import annotations

import numpy as np
import torch


def flat_layout(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, rows: int,
                total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flat layout of a decode step -> (block_list ``[total]`` int64, block_groups ``[total]`` int64,
    block_bias ``[total, block_size]`` float32).

    `block_tables` ``[n, W]`` each row's blocks in order; `context_lens` ``[n]`` the tokens each row attends
    to (the current one included); `rows` the step's rows (n real ones, then padding); `total` the
    total-blocks bucket. The blocks in use come row after row; padding blocks point at block 0 (the trash
    block) in group `rows`, a row the step drops. Every block keeps at least position 0 unmasked, padding
    blocks included: a fully masked block's maximum is -inf and its softmax NaN. A row of context 0 has no
    block, and its output is 0.
    """
    n, width = block_tables.shape
    lens = np.asarray(context_lens, dtype=np.int64)
    used = -(-lens // block_size)  # blocks each row reads
    count = int(used.sum())
    if n > rows or count > total or (n and int(used.max()) > width):
        raise ValueError(f"{n} rows using {count} blocks (widest {int(used.max()) if n else 0}) do not fit "
                         f"{rows} rows, {total} blocks and tables {width} wide")
    cols = np.arange(width)
    in_use = cols[None, :] < used[:, None]  # [n, W]
    block_list = np.zeros(total, dtype=np.int64)
    block_list[:count] = block_tables[in_use]
    block_groups = np.full(total, rows, dtype=np.int64)
    block_groups[:count] = np.repeat(np.arange(n), used)
    filled = np.ones(total, dtype=np.int64)  # positions each block holds
    filled[:count] = np.minimum(lens[:, None] - cols[None, :] * block_size, block_size)[in_use]
    block_bias = np.where(np.arange(block_size)[None, :] < filled[:, None], 0.0, -np.inf).astype(np.float32)
    return block_list, block_groups, block_bias


def block_rescale(block_max: torch.Tensor, block_sums: torch.Tensor, block_groups: torch.Tensor,
                  rows: int) -> torch.Tensor:
    """What ``torch.ops.hpu.block_softmax_adjustment`` returns, with plain ops: per block (dimension 0,
    shape of `block_max`), exp(block_max - row_max) over its row's sum of block_sums rescaled alike.
    Group `rows` (padding) is a row of its own."""
    t = block_max.shape[0]
    maxes, sums = block_max.reshape(t, -1), block_sums.reshape(t, -1)
    group_max = maxes.new_full((rows + 1, maxes.shape[1]), float("-inf"))
    group_max.index_reduce_(0, block_groups, maxes, "amax")
    adjustment = (maxes - group_max.index_select(0, block_groups)).exp()
    scaled = sums * adjustment
    group_sums = scaled.new_zeros(rows + 1, scaled.shape[1]).index_add_(0, block_groups, scaled)
    return (adjustment / group_sums.index_select(0, block_groups)).view_as(block_max)


def flat_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_list: torch.Tensor,
                      block_groups: torch.Tensor, block_bias: torch.Tensor, scale: float,
                      adjust=None, softcap: float | None = None) -> torch.Tensor:
    """q ``[B, Hq, D]`` over the caches ``[N, block_size, Hkv, D]`` through `flat_layout`'s arrays ->
    ``[B, Hq, D]`` in q's dtype. Each KV head's G = Hq / Hkv query heads share one score matmul, so K/V
    are never repeated; scores, softmax and the sum over blocks are float32. `adjust` is
    ``torch.ops.hpu.block_softmax_adjustment`` or None (then `block_rescale`). Blocks read from a cache of
    another dtype (float8) are cast to q's; their scales are the caller's (fold them into `scale`).
    `softcap`: scaled scores become ``softcap * tanh(score / softcap)`` before the bias (Gemma 2)."""
    keys, values = k_cache.index_select(0, block_list), v_cache.index_select(0, block_list)  # [T, bs, Hkv, D]
    return flat_blocks_attention(q, keys, values, block_groups, block_bias, scale, adjust, softcap)


def flat_blocks_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_groups: torch.Tensor,
                          block_bias: torch.Tensor, scale: float, adjust=None,
                          softcap: float | None = None) -> torch.Tensor:
    """`flat_paged_decode` over blocks already gathered: keys ``[T, bs, Hkv, D]``, values ``[T, bs, Hkv, Dv]``
    (multi-head latent attention's keys are its latent and rope key, its values the latent alone) ->
    ``[B, Hq, Dv]``."""
    b, hq, d = q.shape
    t, hkv, dv = keys.shape[0], keys.shape[2], values.shape[-1]
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    # Each block's query is its row's; padding blocks (group B) meet a zero query.
    queries = torch.cat([q, q.new_zeros(1, hq, d)]).index_select(0, block_groups).view(t, hkv, hq // hkv, d)
    scores = torch.matmul(queries, keys.permute(0, 2, 3, 1)).float()  # [T, Hkv, G, bs]
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + block_bias.view(t, 1, 1, -1)
    block_max = scores.amax(-1, keepdim=True)  # [T, Hkv, G, 1]
    probs = (scores - block_max).exp()
    block_sums = probs.sum(-1, keepdim=True)
    weighted = torch.matmul(probs.to(values.dtype), values.transpose(1, 2))  # [T, Hkv, G, Dv]
    if adjust is None:
        rescale = block_rescale(block_max, block_sums, block_groups, b)
    else:  # as vLLM calls it: [T, H, 1, 1] float32 maxima and sums
        rescale = adjust(block_max.view(t, hq, 1, 1), block_sums.view(t, hq, 1, 1), block_groups, b)
    out = weighted.float() * rescale.view(t, hkv, -1, 1)
    rows = out.new_zeros(b + 1, hkv, hq // hkv, dv).index_add_(0, block_groups, out)  # row B: padding, dropped
    return rows[:b].view(b, hq, dv).to(q.dtype)
