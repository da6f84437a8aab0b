"""Paged attention on plain torch ops (SDPA), batched, without host syncs.

Prefill: right-padded ``[B, S]`` batch; K/V of every token are written into
its slot; attention is causal within each row (pads come after real tokens, so
real tokens never see them); on a CPU with native bfloat16 it runs as matmuls
over chunks of queries (`chunked_causal_attention`), elsewhere as SDPA. A prefill
whose prompts start with cached blocks
(prefix caching) attends over those blocks, gathered through ``block_tables``
(the first ``context_lens`` positions of each row), then causally over its own
new tokens; the gather follows this layer's write, so a row may read blocks
another row of the same batch has just filled. On a CPU with native bfloat16
that attention runs as two matmuls (`grouped_context_attention`), elsewhere as
SDPA with a mask.

With a float8 cache, prefill attends to the K/V values the cache holds (rounded
to float8 and back), as decode and a prefill reading them later do, so that a
prompt's output does not depend on which of its blocks were cached.

Decode (``S == 1``): the new K/V are written, then each sequence attends over
its first ``context_lens`` cached positions. On a CPU with a bfloat16 or
float32 cache, a C kernel reads them in place through ``block_tables``
(``device/cpu_paged_attention.py``): no copy, no mask, no work past a row's own
length. On HPU, the runner lays out the blocks each row uses flat
(``block_list``, ``block_groups``, ``block_bias``) and decode attends block by
block (`flat_paged_attention.py`), so no row pays for the batch's widest one.
Elsewhere (other devices, a float8 cache on CPU, no C compiler, the math
fallback) the blocks are gathered through ``block_tables`` into a contiguous
copy with positions ``>= context_lens`` masked; grouped-query attention then
folds the query heads of one KV group into the query-length axis, so K/V are
never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import nn

from gaudi_runtime.layers.flat_paged_attention import flat_paged_decode

FP8_KV_DTYPES = (torch.float8_e4m3fn,)  # --kv-cache-dtype fp8_e4m3fn


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(QK^T * scale) V spelled out (USE_FLASH_ATTENTION=false); softmax in float32 as transformers' eager."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
                                    .tril().logical_not(), float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:  # additive
        scores = scores + attn_mask
    return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)


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


def context_prefill_mask(context_lens: torch.Tensor, length: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B, 1, S, L + S]`` mask of a prefill over cached blocks: each row's first
    ``context_lens`` gathered positions of ``length``, then its new tokens causally (0 or -inf: CPU SDPA
    runs a float mask faster than a boolean one)."""
    b, device = context_lens.shape[0], context_lens.device
    cached = torch.arange(length, device=device)[None, :] < context_lens[:, None]  # [B, L]
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    allowed = torch.cat([cached[:, None, :].expand(b, s, length), causal.expand(b, s, s)], dim=-1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
        allowed.logical_not(), float("-inf"))[:, None]


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
    bfloat16 on a CPU that multiplies it in hardware (`select_attention` checks); in float32 the
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
    sgemm, where oneDNN's matmuls multiply bfloat16 in hardware (`select_attention` checks). None for
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


@dataclass
class AttentionImpl:
    """The kernels every Attention layer of this process calls (q, k, v, attn_mask, is_causal, scale)."""

    name: str
    prefill: object
    decode: object
    # Whether `prefill` takes torch SDPA's enable_gqa (K/V with fewer heads than Q, not repeated).
    prefill_gqa: bool = False
    # (q, k_cache, v_cache, block_tables, context_lens, scale) -> [B, Hq, D] read from the paged cache in
    # place, or None for tensors it does not take (which then go through the gather and `decode`).
    paged_decode: object | None = None
    # (q [B, Hq, S, D], k/v [B, Hkv, L, D], additive mask, scale) -> [B, Hq, S, D] for a prefill over
    # cached blocks, or None for shapes it does not take (which then go through `prefill`).
    context_prefill: object | None = None
    # (q [B, Hq, S, D], k/v [B, Hkv, S, D], scale) -> [B, Hq, S, D] for a causal prefill (no cached
    # blocks), or None for tensors it does not take (which then go through `prefill`).
    causal_prefill: object | None = None
    # (q [B, Hq, D], k_cache, v_cache, block_list, block_groups, block_bias, scale) -> [B, Hq, D] over the
    # flat layout of `flat_paged_attention`: decode steps whose metadata carries it (the runner builds it
    # where this is set and the backend asks for it).
    flat_decode: object | None = None


IMPL = AttentionImpl("sdpa", F.scaled_dot_product_attention, F.scaled_dot_product_attention, True)


def select_attention(use_flash: bool, recompute: bool, device: str, cpu_paged: bool = True) -> AttentionImpl:
    """USE_FLASH_ATTENTION / FLASH_ATTENTION_RECOMPUTE: Habana's FusedSDPA on HPU (recompute applies to the
    first token), torch SDPA elsewhere; or the explicit math. On CPU, decode reads the paged cache in place
    with the C kernel (CPU_PAGED_ATTENTION, `cpu_paged`; compiled here, so a missing compiler is found and
    warned about at start), else over the gathered blocks with `grouped_decode_attention`, which is faster
    there than SDPA for that shape. On HPU, decode attends over the flat layout of the blocks in use
    (`flat_paged_decode`, with Habana's fused softmax rescale where the bridge has it). Set once per shard
    process, before the model runs."""
    if not use_flash:
        impl = AttentionImpl("math", math_attention, math_attention)
    elif device == "hpu":
        from gaudi_runtime.device.hpu import block_softmax_adjustment, fused_sdpa

        flat = partial(flat_paged_decode, adjust=block_softmax_adjustment())
        impl = AttentionImpl("fused_sdpa (decode: flat paged)", fused_sdpa(recompute), fused_sdpa(False),
                             flat_decode=flat)
    elif device == "cpu":
        from gaudi_runtime.device.cpu_gemm import native_bf16
        from gaudi_runtime.device.cpu_paged_attention import kernel

        paged = kernel() if cpu_paged else None
        name = "sdpa (decode: paged C kernel)" if paged else "sdpa (decode: grouped bmm)"
        matmuls = native_bf16()
        impl = AttentionImpl(name, F.scaled_dot_product_attention, grouped_decode_attention, True, paged,
                             grouped_context_attention if matmuls else None,
                             chunked_causal_attention if matmuls else None)
    else:
        impl = AttentionImpl("sdpa", F.scaled_dot_product_attention, F.scaled_dot_product_attention, True)
    IMPL.name, IMPL.prefill, IMPL.decode = impl.name, impl.prefill, impl.decode
    IMPL.prefill_gqa, IMPL.paged_decode = impl.prefill_gqa, impl.paged_decode
    IMPL.context_prefill, IMPL.causal_prefill = impl.context_prefill, impl.causal_prefill
    IMPL.flat_decode = impl.flat_decode
    return IMPL


def attention_in_use(impl: AttentionImpl, kv_dtype: torch.dtype) -> str:
    """`impl`'s name as it runs over a cache of `kv_dtype` (for /info and the log): a float8 cache is never
    read in place."""
    if impl.paged_decode is not None and kv_dtype in FP8_KV_DTYPES:
        return "sdpa (decode: grouped bmm; the float8 cache is gathered)"
    return impl.name


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slots: torch.LongTensor  # [B, S] flat slot per input token; padding -> 0 (trash block 0)
    # decode: [B, nb], padded with 0; prefill: the cached blocks each row starts with (None: no row has any)
    block_tables: torch.LongTensor | None = None
    # decode: [B], including the current token; prefill: [B] the cached tokens before each row's first
    context_lens: torch.LongTensor | None = None
    # decode: which gathered positions each row attends to, [B, 1, 1, L]; the first layer builds it
    # and the others reuse it (one forward pass, one metadata object).
    decode_mask: torch.Tensor | None = None
    # prefill with cached blocks: `context_prefill_mask`, built by the first layer, reused by the others
    context_mask: torch.Tensor | None = None
    # decode over the flat layout (`flat_paged_attention.flat_layout`), in place of block_tables and
    # context_lens: the blocks in use [T], each one's row [T] (padding: the row count), its bias [T, bs]
    block_list: torch.LongTensor | None = None
    block_groups: torch.LongTensor | None = None
    block_bias: torch.Tensor | None = None


def fp8_round_trip(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a float8 cache stores it and attention reads it back (`write_kv`, then ``* scale``)."""
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype).to(x.dtype) * scale


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter ``k, v`` ``[B, S, H, D]`` into the caches at flat ``slots`` ``[B, S]``.

    A float8 cache stores ``k / k_scale`` (and ``v / v_scale``), saturated to the format's range."""
    h, d = k_cache.shape[-2:]
    flat = slots.reshape(-1)
    if k_cache.dtype in FP8_KV_DTYPES:
        # index_copy_ has no float8 kernel on CPU: copy the bytes through a uint8 view.
        for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            limit = torch.finfo(cache.dtype).max
            q = (x.reshape(-1, h, d).float() / scale).clamp(-limit, limit).to(cache.dtype)
            cache.view(torch.uint8).view(-1, h, d).index_copy_(0, flat, q.view(torch.uint8))
        return
    k_cache.view(-1, h, d).index_copy_(0, flat, k.reshape(-1, h, d).to(k_cache.dtype))
    v_cache.view(-1, h, d).index_copy_(0, flat, v.reshape(-1, h, d).to(v_cache.dtype))


class Attention(nn.Module):
    k_scale = 1.0  # per-tensor scales of a float8 KV cache (set by gaudi_runtime.quant)
    v_scale = 1.0
    # ``(k_cache, v_cache, k, v, slots)`` -> whether it wrote them (False: caches or tensors it does not take,
    # nothing written); set by the backend after loading (``device/cpu_layer_ops.py``). None: `write_kv`.
    cache_writer = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused projection ``[B, S, (Hq + 2 * Hkv) * D]`` (q, then k, then v) -> q ``[B, S, Hq, D]``,
        k and v ``[B, S, Hkv, D]``, as ``forward`` takes them."""
        b, s, _ = qkv.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(b, s, self.num_heads, self.head_dim), k.view(b, s, self.num_kv_heads, self.head_dim),
                v.view(b, s, self.num_kv_heads, self.head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` -> ``[B, S, Hq * D]``."""
        b, s = q.shape[:2]
        if kv_cache is not None:
            self._write_cache(kv_cache, k, v, meta.slots)
        if meta.is_prefill:
            if kv_cache is not None and kv_cache[0].dtype in FP8_KV_DTYPES:
                k = fp8_round_trip(k, kv_cache[0].dtype, self.k_scale)
                v = fp8_round_trip(v, kv_cache[1].dtype, self.v_scale)
            if meta.block_tables is not None:
                out = self._prefill_with_context(q, k, v, kv_cache[0], kv_cache[1], meta)
            else:
                out = self._prefill(q, k, v)
        else:
            if kv_cache is None:
                raise ValueError("decode needs a KV cache")
            out = self._decode(q, kv_cache[0], kv_cache[1], meta)
        return out.reshape(b, s, self.num_heads * self.head_dim)

    def _write_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
        if self.cache_writer is None or not self.cache_writer(kv_cache[0], kv_cache[1], k, v, slots):
            write_kv(kv_cache[0], kv_cache[1], k, v, slots, self.k_scale, self.v_scale)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[B, S, Hq, D]`` over k/v ``[B, L, Hkv, D]``: causal (L == S) unless a mask is given."""
        b, length = k.shape[:2]
        if attn_mask is None and IMPL.causal_prefill is not None:
            out = IMPL.causal_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale)
            if out is not None:
                return out.transpose(1, 2)
        if self.group > 1 and attn_mask is not None and IMPL.prefill_gqa:  # the long keys of a cached prefix
            out = IMPL.prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                               scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2)
        if self.group > 1:
            k = k.unsqueeze(3).expand(b, length, self.num_kv_heads, self.group, self.head_dim).reshape(
                b, length, self.num_heads, self.head_dim)
            v = v.unsqueeze(3).expand(b, length, self.num_kv_heads, self.group, self.head_dim).reshape(
                b, length, self.num_heads, self.head_dim)
        out = IMPL.prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                           is_causal=attn_mask is None, scale=self.scale)
        return out.transpose(1, 2)  # [B, S, Hq, D]

    def _prefill_with_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The new tokens attend to their rows' cached blocks, then causally to each other."""
        b, s = q.shape[:2]
        length = meta.block_tables.shape[1] * k_cache.shape[1]
        flat = meta.block_tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim)
        values = v_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim)
        if k_cache.dtype in FP8_KV_DTYPES:
            keys, values = keys.to(q.dtype) * self.k_scale, values.to(q.dtype) * self.v_scale
        if meta.context_mask is None:
            meta.context_mask = context_prefill_mask(meta.context_lens, length, s, q.dtype)
        keys, values = torch.cat([keys.to(k.dtype), k], 1), torch.cat([values.to(v.dtype), v], 1)
        if IMPL.context_prefill is not None:
            out = IMPL.context_prefill(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       meta.context_mask, self.scale)
            if out is not None:
                return out.transpose(1, 2)
        return self._prefill(q, keys, values, meta.context_mask)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        b = q.shape[0]
        if meta.block_list is not None:
            return self._flat_decode(q, k_cache, v_cache, meta)
        if IMPL.paged_decode is not None and k_cache.dtype not in FP8_KV_DTYPES:
            out = IMPL.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
            if out is not None:
                return out.view(b, 1, self.num_heads, self.head_dim)
        return self._gathered_decode(q, k_cache, v_cache, meta)

    def _flat_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """Decode block by block over the flat layout of the blocks in use."""
        if IMPL.flat_decode is None:
            raise ValueError(f"attention {IMPL.name!r} does not decode over a flat block layout")
        b = q.shape[0]
        fp8 = k_cache.dtype in FP8_KV_DTYPES
        # A float8 cache holds k / k_scale and v / v_scale: k_scale scales the scores, v_scale the output.
        scale = self.scale * self.k_scale if fp8 else self.scale
        out = IMPL.flat_decode(q.reshape(b, self.num_heads, self.head_dim), k_cache, v_cache, meta.block_list,
                               meta.block_groups, meta.block_bias, scale)
        if fp8:
            out = out * self.v_scale
        return out.view(b, 1, self.num_heads, self.head_dim)

    def _gathered_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """Decode over a contiguous copy of each row's blocks, positions past its context masked."""
        b = q.shape[0]
        block_tables, context_lens = meta.block_tables, meta.context_lens
        nb = block_tables.shape[1]
        block_size = k_cache.shape[1]
        length = nb * block_size
        # index_select copies whole blocks and is markedly faster on CPU than advanced indexing.
        flat = block_tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if k_cache.dtype in FP8_KV_DTYPES:
            keys, values = keys.to(q.dtype) * self.k_scale, values.to(q.dtype) * self.v_scale
        if meta.decode_mask is None:
            pos = torch.arange(length, device=q.device)
            # Position 0 is always allowed so a padded row with context_len 0 yields finite output, not NaN.
            mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1)) | (pos.unsqueeze(0) == 0)  # [B, L]
            meta.decode_mask = mask[:, None, None, :]
        # q [B, 1, Hq, D] -> [B, Hkv, group, D]: the group's query heads act as the query axis.
        qg = q.reshape(b, self.num_kv_heads, self.group, self.head_dim).to(keys.dtype)
        out = IMPL.decode(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return out.reshape(b, 1, self.num_heads, self.head_dim).to(q.dtype)
