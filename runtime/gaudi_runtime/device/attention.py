"""The attention backend every device shares: the explicit math (USE_FLASH_ATTENTION=false).

torch SDPA is the interface's own behaviour (``layers/attention_backend.AttentionBackend``); the CPU's
kernels are in ``cpu_attention.py``, Habana's FusedSDPA in ``hpu.py``.
"""

from __future__ import annotations

import torch

from gaudi_runtime.layers.attention_backend import AttentionBackend


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(QK^T * scale) V spelled out; softmax in float32 as transformers' eager."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
                                    .tril().logical_not(), float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:  # additive
        scores = scores + attn_mask
    return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)


class MathAttention(AttentionBackend):
    """Every step through `math_attention`, K/V repeated per query head, on any device."""

    name = "math"
    prefill_gqa = False
    prefill = staticmethod(math_attention)
    decode = staticmethod(math_attention)
