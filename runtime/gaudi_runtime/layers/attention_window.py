"""Sliding-window (local) attention and attention-logit soft-capping, for the `Attention` layers that have them.

A layer with a window of W attends from position i to the positions j with ``i - W < j <= i`` (the
current token and the W - 1 before it, as transformers' sliding-window mask), so that Gemma 2/3's local
layers read at most W cached positions while their global layers read the whole sequence. A soft cap c
replaces each scaled score s by ``c * tanh(s / c)`` before the softmax (Gemma 2), which torch SDPA cannot
do: such layers run `explicit_attention` instead.

The masks here are pure functions of the step's metadata; the layer builds each once per forward pass
and keeps it in ``AttentionMetadata.window_cache`` for the other layers with the same window. A window
of None means no window (the layer only soft-caps).
"""

from __future__ import annotations

import torch

# Out-of-window positions of the flat decode's blocks: finite, so that a block with no position in the
# window still has a finite maximum (its rescale then comes out 0), where -inf would make its softmax NaN.
OUT_OF_WINDOW = -1e30


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether query positions see key positions (broadcast): causal, and inside the window."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        allowed.logical_not(), float("-inf"))


def causal_window_mask(s: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[1, 1, S, S]`` mask of a prefill without cached blocks (each row from position 0)."""
    pos = torch.arange(s, device=device)
    return additive(in_window(pos[:, None], pos[None, :], window), dtype)[None, None]


def context_window_mask(context_lens: torch.Tensor, length: int, s: int, window: int | None,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B, 1, S, L + S]`` mask of a prefill over cached blocks: the keys are each row's ``length``
    gathered positions (the first ``context_lens`` of them real), then its S new tokens at positions
    ``context_lens + i``; `context_prefill_mask`'s layout with the window applied."""
    device = context_lens.device
    ctx = context_lens[:, None]
    new = ctx + torch.arange(s, device=device)[None, :]  # [B, S] the new tokens' positions
    cached = torch.arange(length, device=device)[None, :].expand(ctx.shape[0], length)
    k_pos = torch.cat([cached, new], dim=1)  # [B, L + S]
    real = torch.cat([cached < ctx, torch.ones_like(new, dtype=torch.bool)], dim=1)
    allowed = in_window(new[:, :, None], k_pos[:, None, :], window) & real[:, None, :]
    return additive(allowed, dtype)[:, None]


def window_starts(context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """The first position each decoding row attends to (its context includes the current token)."""
    return (context_lens - window).clamp_min(0)


def decode_window_mask(context_lens: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """Bool ``[B, 1, 1, L]``: the gathered positions each decoding row attends to. A padded row (context 0)
    keeps position 0, so that its output is finite."""
    pos = torch.arange(length, device=context_lens.device)[None, :]
    ctx = context_lens[:, None]
    allowed = pos < ctx
    if window is not None:
        allowed = allowed & (pos >= ctx - window)
    return (allowed | ((pos == 0) & (ctx == 0)))[:, None, None, :]


def flat_window_bias(block_groups: torch.Tensor, block_bias: torch.Tensor, rows: int, window: int) -> torch.Tensor:
    """`flat_paged_attention.flat_layout`'s ``block_bias`` ``[T, bs]`` with the positions before each row's
    window masked too. The layout lists each row's blocks in order, row after row, so a block's place in
    its row and the row's length follow from `block_groups` and the unmasked positions of the bias (static
    shapes, no host sync)."""
    t, bs = block_bias.shape
    groups = block_groups.long()
    filled = (block_bias == 0).sum(-1)  # positions each block holds
    lengths = torch.zeros(rows + 1, dtype=filled.dtype, device=filled.device).index_add_(0, groups, filled)
    used = torch.zeros(rows + 1, dtype=filled.dtype, device=filled.device).index_add_(
        0, groups, torch.ones_like(filled))
    first = used.cumsum(0) - used  # each row's first block in the list
    place = torch.arange(t, device=groups.device) - first.index_select(0, groups)
    pos = place[:, None] * bs + torch.arange(bs, device=groups.device)[None, :]  # [T, bs]
    start = (lengths - window).index_select(0, groups)[:, None]
    return block_bias + torch.where(pos >= start, 0.0, OUT_OF_WINDOW).to(block_bias.dtype)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       softcap: float | None) -> torch.Tensor:
    """q ``[B, Hq, S, D]`` over k/v ``[B, Hkv, L, D]`` (Hq a multiple of Hkv; K/V never repeated) under `mask`
    (additive, or bool where True attends; broadcast to ``[B, 1, S, L]``) -> ``[B, Hq, S, D]``. Scores and
    softmax in float32, as transformers' eager attention: scaled, soft-capped, masked."""
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, g * s, d), k.transpose(-1, -2)).float() * scale
    scores = scores.view(b, hkv, g, s, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = mask.reshape(mask.shape[0], 1, 1, mask.shape[-2], length)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    else:
        scores = scores + mask.float()
    probs = scores.softmax(-1).to(v.dtype).view(b, hkv, g * s, length)
    return torch.matmul(probs, v).view(b, hq, s, d)
