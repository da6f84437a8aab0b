"""Multi-head latent attention (DeepSeek-V2/V3): the paged cache holds one compressed latent per token.

Per token and layer the cache keeps the ``kv_lora_rank`` normed latent ``c`` (in the pair's first
tensor) and the roped ``qk_rope_head_dim`` key part ``k_pe`` shared by all heads (in the second),
``[num_blocks, block_size, 1, dim]`` each: (kv_lora_rank + rope) values per token instead of
``2 * heads * head_dim``; that is the point of MLA. Every tensor-parallel rank caches the whole latent
(``kv_a_proj_with_mqa`` is replicated) and owns a slice of the heads (``q_b_proj``, ``kv_b_proj``
column-parallel, ``o_proj`` row-parallel).

Prefill expands keys and values from the latent (``kv_b_proj``: per head ``k_nope`` and ``v``) and
attends causally; a prefill over cached blocks (prefix caching, chunks, speculative verify) gathers
the cached latent of its blocks and expands it the same way. Decode never expands: the query's
``k_nope`` part is mapped into latent space through ``kv_b_proj``'s key rows (absorbed), scores are
taken against the latent and ``k_pe``, and the latent-space output is mapped back through its value
rows. Both compute the same function (``q_nope . (W_k c) == (W_k^T q_nope) . c``).

DeepSeek stores the rope part of q and k interleaved (pairs ``x0, x1``): with ``rope_interleave``
(transformers' default for DeepSeek-V3) it is de-interleaved before the usual rotate-half rotation,
which is what transformers' interleaved rotation computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import FP8_KV_DTYPES, AttentionMetadata, context_prefill_mask, fp8_round_trip
from .flat_paged_attention import flat_blocks_attention
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, TPContext, divide, materialize
from .norm import RMSNorm
from .rotary import RotaryEmbedding


@dataclass(frozen=True)
class MLAShape:
    hidden_size: int
    num_heads: int  # all ranks together
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float
    attention_bias: bool = False
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class HeadsUpProjection(nn.Module):
    """``kv_b_proj``: latent -> per head ``[k_nope; v]``, this rank's heads. Not a ``LinearBase``: decode
    reads the weight head by head (absorbed), so no backend may repack or release it."""

    def __init__(self, kv_lora_rank: int, heads_per_rank: int, per_head: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(heads_per_rank * per_head, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        n = param.shape[0]
        src = loaded.narrow(0, self.tp.rank * n, n)
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"kv_b_proj shape mismatch: parameter {tuple(param.shape)} vs checkpoint slice "
                             f"{tuple(src.shape)}")
        param.data.copy_(materialize(src))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return F.linear(c, self.weight)


def write_latent(cache: tuple[torch.Tensor, torch.Tensor], c: torch.Tensor, k_pe: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Scatter ``c`` ``[B, S, R]`` and ``k_pe`` ``[B, S, P]`` into the pair of latent caches at ``slots``.
    A float8 cache stores them saturated to its range (scale 1: the normed latent is small)."""
    flat = slots.reshape(-1)
    for dst, x in zip(cache, (c, k_pe)):
        d = dst.shape[-1]
        rows = x.reshape(-1, d)
        if dst.dtype in FP8_KV_DTYPES:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            limit = torch.finfo(dst.dtype).max
            rows = rows.float().clamp(-limit, limit).to(dst.dtype)
            dst.view(torch.uint8).view(-1, d).index_copy_(0, flat, rows.view(torch.uint8))
        else:
            dst.view(-1, d).index_copy_(0, flat, rows.to(dst.dtype))


def gather_latent(cache: tuple[torch.Tensor, torch.Tensor], block_tables: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's blocks as contiguous ``c`` ``[B, L, R]`` and ``k_pe`` ``[B, L, P]``."""
    b, flat = block_tables.shape[0], block_tables.reshape(-1)
    return tuple(t.index_select(0, flat).view(b, -1, t.shape[-1]).to(dtype) for t in cache)


def decode_mask(context_lens: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, 1, L]``: the positions each row attends to (position 0 always, so padded rows stay finite)."""
    pos = torch.arange(length, device=context_lens.device)[None, :]
    return ((pos < context_lens[:, None]) | (pos == 0))[:, None, None, :]


class MLAttention(nn.Module):
    """Projections, latent cache and attention of one MLA layer, for one tensor-parallel rank."""

    num_kv_heads = 1  # the latent: one "head" shared by all query heads

    def __init__(self, shape: MLAShape, rotary: RotaryEmbedding, scale: float, tp: TPContext):
        super().__init__()
        self.shape = shape
        self.num_heads = divide(shape.num_heads, tp.size, "num_attention_heads")
        self.scale = scale
        self.rotary = rotary  # shared by all layers
        q_out = shape.num_heads * shape.qk_head_dim
        if shape.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(shape.hidden_size, q_out, bias=False, tp=tp)
        else:
            self.q_a_proj = ReplicatedLinear(shape.hidden_size, shape.q_lora_rank, bias=shape.attention_bias, tp=tp)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, shape.norm_eps)
            self.q_b_proj = ColumnParallelLinear(shape.q_lora_rank, q_out, bias=False, tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(shape.hidden_size, shape.kv_lora_rank + shape.qk_rope_head_dim,
                                                   bias=shape.attention_bias, tp=tp)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, shape.norm_eps)
        self.kv_b_proj = HeadsUpProjection(shape.kv_lora_rank, self.num_heads,
                                           shape.qk_nope_head_dim + shape.v_head_dim, tp)
        self.o_proj = RowParallelLinear(shape.num_heads * shape.v_head_dim, shape.hidden_size,
                                        bias=shape.attention_bias, tp=tp)

    @property
    def kv_token_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of the pair of caches per token: the latent, then the rope key part."""
        return (1, self.shape.kv_lora_rank), (1, self.shape.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        b, s = x.shape[:2]
        q_nope, q_pe, c, k_pe = self._project(x, positions)
        if kv_cache is not None:
            write_latent(kv_cache, c, k_pe, meta.slots)
            if kv_cache[0].dtype in FP8_KV_DTYPES:  # attend to what the cache holds, as decode will
                c, k_pe = fp8_round_trip(c, kv_cache[0].dtype, 1.0), fp8_round_trip(k_pe, kv_cache[1].dtype, 1.0)
        if meta.is_prefill:
            if meta.block_tables is not None:
                cached_c, cached_pe = gather_latent(kv_cache, meta.block_tables, c.dtype)
                length = cached_c.shape[1]
                if meta.context_mask is None:
                    meta.context_mask = context_prefill_mask(meta.context_lens, length, s, x.dtype)
                out = self._expanded(q_nope, q_pe, torch.cat([cached_c, c], 1), torch.cat([cached_pe, k_pe], 1),
                                     meta.context_mask)
            else:
                out = self._expanded(q_nope, q_pe, c, k_pe, None)
        else:
            if kv_cache is None:
                raise ValueError("decode needs a KV cache")
            out = self._absorbed(q_nope, q_pe, kv_cache, meta)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.shape.v_head_dim))

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """-> q_nope ``[B, S, H, N]``, roped q_pe ``[B, S, H, P]``, normed latent c ``[B, S, R]``, roped
        k_pe ``[B, S, P]``."""
        sh = self.shape
        b, s = x.shape[:2]
        q = self.q_proj(x) if sh.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, s, self.num_heads, sh.qk_head_dim).split([sh.qk_nope_head_dim, sh.qk_rope_head_dim],
                                                                           dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([sh.kv_lora_rank, sh.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        k_pe = k_pe.reshape(b, s, 1, sh.qk_rope_head_dim)
        if sh.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        return q_nope, q_pe, c, k_pe.reshape(b, s, sh.qk_rope_head_dim)

    def _expanded(self, q_nope, q_pe, c, k_pe, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with keys and values expanded from the latent ``c`` ``[B, L, R]`` (causal without a
        mask) -> ``[B, S, H, V]``."""
        sh = self.shape
        b, length = c.shape[:2]
        kv = self.kv_b_proj(c).view(b, length, self.num_heads, sh.qk_nope_head_dim + sh.v_head_dim)
        k_nope, v = kv.split([sh.qk_nope_head_dim, sh.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(b, length, self.num_heads, sh.qk_rope_head_dim)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out.transpose(1, 2)

    def _absorbed(self, q_nope, q_pe, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per row over the cached latent, without expanding it -> ``[B, 1, H, V]``: the
        query's nope part mapped into latent space, attention with keys (latent, rope key) and values
        (latent) shared by all heads, the latent output mapped back through the value rows."""
        sh = self.shape
        w = self.kv_b_proj.weight.view(self.num_heads, sh.qk_nope_head_dim + sh.v_head_dim, sh.kv_lora_rank)
        w_k, w_v = w.split([sh.qk_nope_head_dim, sh.v_head_dim], dim=1)  # [H, N, R], [H, V, R]
        q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope[:, 0], w_k), q_pe[:, 0]], -1)  # [B, H, R + P]
        if meta.block_list is not None:  # the blocks in use, laid out flat (HPU): static shapes per bucket
            c, pe = (t.index_select(0, meta.block_list) for t in kv_cache)  # [T, bs, 1, R], [T, bs, 1, P]
            out_latent = flat_blocks_attention(q, torch.cat([c, pe], -1), c, meta.block_groups, meta.block_bias,
                                               self.scale)
        else:
            c, pe = gather_latent(kv_cache, meta.block_tables, q.dtype)
            if meta.decode_mask is None:
                meta.decode_mask = decode_mask(meta.context_lens, c.shape[1])
            scores = torch.matmul(q, torch.cat([c, pe], -1).transpose(1, 2)).float() * self.scale  # [B, H, L]
            probs = torch.softmax(scores.masked_fill(~meta.decode_mask[:, 0], float("-inf")), dim=-1)
            out_latent = torch.matmul(probs.to(c.dtype), c)  # [B, H, R]
        return torch.einsum("bhr,hvr->bhv", out_latent.to(w_v.dtype), w_v)[:, None]


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...)`` -> ``(x0, x2, ..., x1, x3, ...)`` along the last dimension."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


__all__ = ["HeadsUpProjection", "MLAShape", "MLAttention", "decode_mask", "gather_latent", "write_latent"]
