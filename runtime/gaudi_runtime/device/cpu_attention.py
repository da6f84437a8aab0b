"""Attention on a CPU: the kernels of the CPU's attention backend, and the backend that holds them.

Decode reads the paged cache in place with a C kernel (``cpu_paged_attention.py``, CPU_PAGED_ATTENTION);
where it cannot (a float8 cache, no compiler), over the gathered blocks with `grouped_decode_attention`,
faster there than SDPA for that shape. On a CPU that multiplies bfloat16 in hardware, a causal prefill
runs as matmuls over chunks of queries (`chunked_causal_attention`) and a prefill over cached blocks as two
matmuls (`grouped_context_attention`); elsewhere both take SDPA. docs/performance.md has the measurements.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from gaudi_runtime.layers.attention_backend import AttentionBackend

# `grouped_decode_attention` runs as two batched matmuls from this batch size up ...
GROUPED_MIN_BATCH = 16
# ... or from this many gathered positions over the batch (a few long conversations: the prefix cache
# makes their turns cheap to prefill, and then their decode steps are what is left).
GROUPED_MIN_POSITIONS = 16 * 256
# Each query head's row spans every KV head's slice, so the matmuls do Hkv times the useful work;
# past a few KV heads that outgrows what SDPA loses on this shape.
GROUPED_MAX_KV_HEADS = 4


@lru_cache(maxsize=8)
def _head_blocks(hkv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, Hkv, 1, Hkv, 1]`` identity: spreads each query head over only its own KV head's slice."""
    return torch.eye(hkv, dtype=dtype, device=device).view(1, hkv, 1, hkv, 1)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Decode attention on CPU as two batched matmuls straight over the gathered cache.

    q ``[B, Hkv, G, D]``; k/v ``[B, Hkv, L, D]`` as transposed views of the gathered ``[B, L, Hkv, D]``
    blocks; attn_mask ``[B, 1, 1, L]`` bool. CPU SDPA runs this shape (a query length of G per head, a
    mask) as B x Hkv tiny problems and copies the transposed K/V; here each row's heads are flattened
    into one ``[L, Hkv * D]`` matrix and every query head gets a block-diagonal row that only meets its
    own KV head, so one ``bmm`` scores all heads without copying K or V (the zero blocks cost Hkv x the
    flops of a memory-bound op). It wins from batch GROUPED_MIN_BATCH up, or from GROUPED_MIN_POSITIONS
    gathered positions (docs/performance.md has the measurements); smaller work, and models with more than
    GROUPED_MAX_KV_HEADS KV heads, keep SDPA.
    """
    b, hkv, g, d = q.shape
    keys, values = k.transpose(1, 2), v.transpose(1, 2)  # back to the gathered [B, L, Hkv, D]
    small = b < GROUPED_MIN_BATCH and b * keys.shape[1] < GROUPED_MIN_POSITIONS
    if small or hkv > GROUPED_MAX_KV_HEADS or not (keys.is_contiguous() and values.is_contiguous()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    length = keys.shape[1]
    q_rows = (q.unsqueeze(3) * _head_blocks(hkv, q.dtype, q.device)).view(b, hkv * g, hkv * d)  # [B, Hq, Hkv * D]
    scores = torch.bmm(q_rows, keys.view(b, length, hkv * d).transpose(1, 2)).float()  # [B, Hq, L]
    scores.mul_(d ** -0.5 if scale is None else scale)
    scores.masked_fill_(attn_mask.view(b, 1, length).logical_not(), float("-inf"))
    probs = scores.softmax(-1).to(values.dtype)
    out = torch.bmm(probs, values.view(b, length, hkv * d)).view(b, hkv, g, hkv, d)
    # Row (kv head h, group member j) keeps its own head's block h.
    return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, Hkv, G, D]




# Score elements (batch x query heads x new tokens x keys) up to which a prefill over cached blocks
# runs as two matmuls: their scores are materialised (64 MiB in bfloat16 at the cap, twice that while
# the softmax writes its probabilities). Larger ones take SDPA.
GROUPED_CONTEXT_MAX_SCORES = 32 * 1024 * 1024


def grouped_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
                              scale: float) -> torch.Tensor | None:
    """Prefill over cached blocks on CPU: the new tokens against the gathered context and themselves.

    q ``[B, Hq, S, D]``; k/v ``[B, Hkv, L, D]``; attn_mask ``[B, 1, S, L]`` additive. CPU's flash
    kernel runs a few hundred queries over a long masked key axis at about half the speed of two
    oneDNN matmuls (docs/performance.md), so each KV group's query heads are stacked along the query
    axis (K/V are never repeated), scored in one matmul, softmaxed as transformers' eager attention
    does (float32 inside, rounded to bfloat16; reading and writing bfloat16 halves the softmax's
    memory traffic against a float32 copy of the scores), and applied in another. That holds for
    bfloat16 on a CPU that multiplies it in hardware (`CpuBackend.attention` checks); in float32 the
    flash kernel is the faster one. None for other dtypes and when the scores would exceed
    GROUPED_CONTEXT_MAX_SCORES: the caller then runs SDPA, which never materialises them.
    """
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if q.dtype != torch.bfloat16 or b * hq * s * length > GROUPED_CONTEXT_MAX_SCORES:
        return None
    g = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, g * s, d), k.transpose(-1, -2))  # [B, Hkv, G * S, L]
    scores = scores.view(b, hkv, g, s, length).mul_(scale).add_(attn_mask.view(b, 1, 1, s, length))
    probs = scores.softmax(-1).view(b, hkv, g * s, length)
    return torch.matmul(probs, v).view(b, hq, s, d)


# Queries per chunk of a causal prefill run as matmuls: each chunk's scores ([B, Hq, chunk, keys] in
# bfloat16; a few MiB for the reference model's 1,536-token prompts) stay in the last-level cache between
# the two matmuls and the softmax, and the keys past the chunk's last query are never scored
# (docs/performance.md, "A causal prefill in chunks").
CAUSAL_CHUNK = 128


@lru_cache(maxsize=4)
def _causal_block(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[c, c]`` mask of a chunk's queries over its own keys: 0 on and below the diagonal."""
    upper = torch.ones(c, c, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(c, c, dtype=dtype, device=device).masked_fill_(upper, float("-inf"))


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """A causal prefill on CPU as two matmuls per chunk of CAUSAL_CHUNK queries.

    q ``[B, Hq, S, D]``; k/v ``[B, Hkv, S, D]`` (views, not repeated per query head). A chunk's queries
    score every key up to its last one; the chunk's own keys get the causal mask. As transformers' eager
    attention, scores are bfloat16 products scaled, the softmax runs in float32 and is rounded to
    bfloat16, and the values' matmul accumulates in float32. CPU's flash kernel takes about half as
    long again here: its bfloat16 products go through MKL, which on some CPUs widens them to float32
    sgemm, where oneDNN's matmuls multiply bfloat16 in hardware (`CpuBackend.attention` checks). None for
    other dtypes: the caller runs SDPA.
    """
    if q.dtype != torch.bfloat16:
        return None
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = q.new_empty(b, hkv, g, s, d)
    grouped = q.view(b, hkv, g, s, d)
    for start in range(0, s, CAUSAL_CHUNK):
        end = min(s, start + CAUSAL_CHUNK)
        c = end - start
        scores = torch.matmul(grouped[:, :, :, start:end].reshape(b, hkv, g * c, d), k[:, :, :end].transpose(-1, -2))
        scores = scores.view(b, hkv, g, c, end).mul_(scale)
        scores[..., start:].add_(_causal_block(c, scores.dtype, scores.device))
        probs = torch.softmax(scores, -1).view(b, hkv, g * c, end)
        out[:, :, :, start:end] = torch.matmul(probs, v[:, :, :end]).view(b, hkv, g, c, d)
    return out.view(b, hq, s, d)


class CpuAttention(AttentionBackend):
    """torch SDPA for prefill, `grouped_decode_attention` over the gathered blocks; `paged_decode`, the C kernel
    that reads the cache in place (None: decode gathers); with `bf16_matmuls` (a CPU that multiplies bfloat16
    in hardware: ``cpu_gemm.native_bf16``) the matmul prefills."""

    decode = staticmethod(grouped_decode_attention)

    def __init__(self, paged_decode=None, bf16_matmuls: bool = False):
        self.paged_decode = paged_decode
        self.name = "sdpa (decode: paged C kernel)" if paged_decode is not None else "sdpa (decode: grouped bmm)"
        if bf16_matmuls:
            self.context_prefill = grouped_context_attention
            self.causal_prefill = chunked_causal_attention


class InvariantCpuAttention(CpuAttention):
    """The batch-invariant mode's attention: the paged C kernel (`paged`) for every query token, decode's and
    prefill's alike. It sums each query's positions in one order, by position alone (not by block, batch or
    thread), so a token's attention does not depend on how it reached the step."""

    def __init__(self, paged):
        super().__init__(paged)
        self.every_query = paged
        self.name = "paged C kernel for every query (batch-invariant)"
