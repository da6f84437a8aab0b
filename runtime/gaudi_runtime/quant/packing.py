"""GPTQ's bit packing, and sorting a layer's packed columns by group (imports nothing of the runtime, so
device kernels may use it)."""

from __future__ import annotations

import torch
from torch import nn


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., n]`` -> ``[..., n * 32 / bits]`` values, lowest bits first (uint8)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).flatten(-2)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` small ints -> int32 ``[..., n * bits / 32]``, consecutive values lowest bits first."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per) & ((1 << bits) - 1)
    word = (v << (bits * torch.arange(per))).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def sort_groups(m: nn.Module) -> bool:
    """Reorder the packed columns of each fused projection whose groups are not runs of columns (desc_act)
    so that they are, keeping the order in ``m.perms`` (stored column k is input column ``perm[k]``): a
    kernel then takes the input columns in that order. Returns whether anything moved."""
    perms: list = []
    for seg, (start, size) in enumerate(m.segments):
        g = m.g_idx[seg].long()
        if not bool((g[1:] < g[:-1]).any()):
            perms.append(None)
            continue
        perm = torch.argsort(g, stable=True)
        rows = slice(start, start + size)
        m.qweight.data[rows] = pack(unpack(m.qweight.data[rows], m.bits)[:, perm], m.bits)
        m.g_idx[seg] = g[perm].to(m.g_idx.dtype)
        perms.append(perm)
    if any(p is not None for p in perms):
        m.perms = perms
        return True
    return False
