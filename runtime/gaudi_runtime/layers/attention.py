"""Paged attention, batched, without host syncs, over the kernels of an attention backend.

The layer owns what every device shares (writing K/V into the paged cache, gathering cached blocks,
masks, GQA's head layout, float8 scales); the kernels are its `backend`'s (``attention_backend.py``: torch
SDPA unless the device backend chose another for the model, see ``device/base.Backend.attention``).

Prefill: right-padded ``[B, S]`` batch; K/V of every token are written into
its slot; attention is causal within each row (pads come after real tokens, so
real tokens never see them): the backend's `causal_prefill` where it offers one
and takes the tensors, else its `prefill`. A prefill whose prompts start with cached blocks
(prefix caching) attends over those blocks, gathered through ``block_tables``
(the first ``context_lens`` positions of each row), then causally over its own
new tokens; the gather follows this layer's write, so a row may read blocks
another row of the same batch has just filled. That attention runs through the
backend's `context_prefill` where it takes the shape, else its `prefill` with a mask.

With a float8 cache, prefill attends to the K/V values the cache holds (rounded
to float8 and back), as decode and a prefill reading them later do, so that a
prompt's output does not depend on which of its blocks were cached.

Decode (``S == 1``): the new K/V are written, then each sequence attends over
its first ``context_lens`` cached positions: through the backend's `paged_decode`,
which reads them in place through ``block_tables`` (the CPU's C kernel; never a float8 cache);
over the flat layout of the blocks in use when the metadata carries it (``block_list``,
``block_groups``, ``block_bias``; the backend's `flat_decode`, HPU), so no row pays for the
batch's widest one; elsewhere the blocks are gathered through ``block_tables`` into a contiguous
copy with positions ``>= context_lens`` masked, and grouped-query attention
folds the query heads of one KV group into the query-length axis for the backend's `decode`, so K/V are
never repeated.

A layer with a sliding window or an attention soft cap (Gemma 2/3's) honours them on every path above:
masks of positions for the prefills, a first position per row and a cap for the C kernel, a window bias
for the flat layout (``attention_window.py``); a layer without either runs those paths unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gaudi_runtime.layers import attention_window as aw
from gaudi_runtime.layers.attention_backend import AttentionBackend

FP8_KV_DTYPES = (torch.float8_e4m3fn,)  # --kv-cache-dtype fp8_e4m3fn


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


def attention_in_use(backend: AttentionBackend, kv_dtype: torch.dtype) -> str:
    """`backend`'s name as it runs over a cache of `kv_dtype` (for /info and the log): a float8 cache is never
    read in place (`Attention._decode`), so the CPU's in-place kernel gives way to its gathered decode."""
    if backend.paged_decode is not None and kv_dtype in FP8_KV_DTYPES:
        return "sdpa (decode: grouped bmm; the float8 cache is gathered)"
    return backend.name


def use_attention(model: nn.Module, backend: AttentionBackend) -> int:
    """Give every `Attention` layer of `model` `backend` (the one the device backend chose for this model);
    returns how many layers took it."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.backend = backend
    return len(layers)


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
    # A windowed layer's masks, starts and biases (`attention_window`), keyed by kind and window: built by
    # the first layer with that window, reused by the others.
    window_cache: dict = field(default_factory=dict)
    # A mixed step (`Attention._mixed`): its decode rows' metadata and its prefill's, over one token axis
    # ``[1, D + B * S]`` (the D decode tokens first); `slots` is then unused.
    parts: tuple[AttentionMetadata, AttentionMetadata] | None = None

    def windowed(self, key: tuple, build):
        if key not in self.window_cache:
            self.window_cache[key] = build()
        return self.window_cache[key]


def query_tables(meta: AttentionMetadata, s: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token of a prefill ``[B, S]`` as a decode row: its row's block table ``[B * S, blocks]``
    (the cached blocks, then the blocks its new tokens' slots name) and its context length ``[B * S]`` (its
    position + 1). A padding token (slot in block 0) reads position 0 only."""
    slots = meta.slots
    b, dev = slots.shape[0], slots.device
    start = meta.context_lens if meta.block_tables is not None else torch.zeros(b, dtype=torch.long, device=dev)
    pos = start[:, None] + torch.arange(s, device=dev)[None, :]
    real = slots >= block_size
    width = max(1, (int(pos.max()) + block_size) // block_size)
    tables = torch.zeros(b, width + 1, dtype=torch.long, device=dev)  # the last column takes padding's writes
    if meta.block_tables is not None:
        cols = min(width, meta.block_tables.shape[1])
        tables[:, :cols] = meta.block_tables[:, :cols]
    tables.scatter_(1, torch.where(real, pos // block_size, width), slots // block_size)
    lens = torch.where(real, pos + 1, 1).reshape(-1)
    return tables[:, :width].repeat_interleave(s, 0), lens


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

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 backend: AttentionBackend | None = None, window: int | None = None,
                 softcap: float | None = None):
        """`backend`: the kernels this layer runs (`use_attention` sets the model's after loading); torch
        SDPA until then. `window`: attend to the current position and the ``window - 1`` before it only;
        `softcap`: scores become ``softcap * tanh(score / softcap)`` (`attention_window`)."""
        super().__init__()
        self.backend = AttentionBackend() if backend is None else backend
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.banded = window is not None or softcap is not None

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
        if meta.parts is not None:
            return self._mixed(q, k, v, kv_cache, *meta.parts)
        b, s = q.shape[:2]
        if kv_cache is not None:
            self._write_cache(kv_cache, k, v, meta.slots)
        if meta.is_prefill and self.backend.every_query is not None and kv_cache is not None:
            out = self._every_query(q, kv_cache[0], kv_cache[1], meta)
        elif meta.is_prefill:
            if kv_cache is not None and kv_cache[0].dtype in FP8_KV_DTYPES:
                k = fp8_round_trip(k, kv_cache[0].dtype, self.k_scale)
                v = fp8_round_trip(v, kv_cache[1].dtype, self.v_scale)
            if self.banded:
                out = self._banded_prefill(q, k, v, kv_cache, meta)
            elif meta.block_tables is not None:
                out = self._prefill_with_context(q, k, v, kv_cache[0], kv_cache[1], meta)
            else:
                out = self._prefill(q, k, v)
        else:
            if kv_cache is None:
                raise ValueError("decode needs a KV cache")
            out = self._decode(q, kv_cache[0], kv_cache[1], meta)
        return out.reshape(b, s, self.num_heads * self.head_dim)

    def _mixed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               decode: AttentionMetadata, prefill: AttentionMetadata) -> torch.Tensor:
        """A mixed step's tokens ``[1, D + B * S, ...]``: the first D, one per decode row, attend as a decode
        step's; the rest, a prefill's ``[B, S]`` rows, as that prefill's. Each part writes its own slots and
        runs its own path, so a row's attention is what it would be in a step of its kind alone."""
        d = decode.slots.shape[0]
        rows, seq = prefill.slots.shape

        def one_each(x: torch.Tensor) -> torch.Tensor:
            return x[0, :d].unsqueeze(1)

        def prompts(x: torch.Tensor) -> torch.Tensor:
            return x[0, d:].reshape(rows, seq, *x.shape[2:])

        decoded = self.forward(one_each(q), one_each(k), one_each(v), kv_cache, decode)
        prefilled = self.forward(prompts(q), prompts(k), prompts(v), kv_cache, prefill)
        return torch.cat([decoded.reshape(d, -1), prefilled.reshape(rows * seq, -1)])[None]

    def _every_query(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """A prefill's queries ``[B, S, Hq, D]`` each through the backend's `every_query` as a decode row over
        its row's positions up to its own (the cache holds this step's K/V already)."""
        b, s = q.shape[:2]
        tables, lens = meta.windowed(("queries",), lambda: query_tables(meta, s, k_cache.shape[1]))
        band = {}
        if self.banded:
            band = {"softcap": self.softcap, "starts": None if self.window is None else meta.windowed(
                ("query_starts", self.window), lambda: aw.window_starts(lens, self.window))}
        out = self.backend.every_query(q.reshape(b * s, 1, self.num_heads, self.head_dim), k_cache, v_cache, tables,
                                       lens, self.scale, **band)
        if out is None:
            raise ValueError(f"attention {self.backend.name!r} does not take this layer's head size "
                             f"{self.head_dim} or its {k_cache.dtype} cache")
        return out.view(b, s, self.num_heads, self.head_dim)

    def _write_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
        if self.cache_writer is None or not self.cache_writer(kv_cache[0], kv_cache[1], k, v, slots):
            write_kv(kv_cache[0], kv_cache[1], k, v, slots, self.k_scale, self.v_scale)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[B, S, Hq, D]`` over k/v ``[B, L, Hkv, D]``: causal (L == S) unless a mask is given."""
        b, length = k.shape[:2]
        impl = self.backend
        if attn_mask is None and impl.causal_prefill is not None:
            out = impl.causal_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale)
            if out is not None:
                return out.transpose(1, 2)
        if self.group > 1 and attn_mask is not None and impl.prefill_gqa:  # the long keys of a cached prefix
            out = impl.prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                               scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2)
        if self.group > 1:
            k = k.unsqueeze(3).expand(b, length, self.num_kv_heads, self.group, self.head_dim).reshape(
                b, length, self.num_heads, self.head_dim)
            v = v.unsqueeze(3).expand(b, length, self.num_kv_heads, self.group, self.head_dim).reshape(
                b, length, self.num_heads, self.head_dim)
        out = impl.prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                           is_causal=attn_mask is None, scale=self.scale)
        return out.transpose(1, 2)  # [B, S, Hq, D]

    def _with_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, L + S, Hkv, D]`` of a prefill over cached blocks: each row's gathered blocks,
        then its new tokens."""
        b = q.shape[0]
        length = meta.block_tables.shape[1] * k_cache.shape[1]
        flat = meta.block_tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim)
        values = v_cache.index_select(0, flat).view(b, length, self.num_kv_heads, self.head_dim)
        if k_cache.dtype in FP8_KV_DTYPES:
            keys, values = keys.to(q.dtype) * self.k_scale, values.to(q.dtype) * self.v_scale
        return torch.cat([keys.to(k.dtype), k], 1), torch.cat([values.to(v.dtype), v], 1)

    def _prefill_with_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The new tokens attend to their rows' cached blocks, then causally to each other."""
        s = q.shape[1]
        keys, values = self._with_context(q, k, v, k_cache, v_cache, meta)
        if meta.context_mask is None:
            meta.context_mask = context_prefill_mask(meta.context_lens, keys.shape[1] - s, s, q.dtype)
        if self.backend.context_prefill is not None:
            out = self.backend.context_prefill(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       meta.context_mask, self.scale)
            if out is not None:
                return out.transpose(1, 2)
        return self._prefill(q, keys, values, meta.context_mask)

    def _banded_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """A prefill of a windowed or soft-capped layer, with or without cached blocks: under the window's mask,
        through the backend's masked prefill, or `explicit_attention` where scores are soft-capped."""
        s = q.shape[1]
        if meta.block_tables is not None:
            k, v = self._with_context(q, k, v, kv_cache[0], kv_cache[1], meta)
            mask = meta.windowed(("context", self.window), lambda: aw.context_window_mask(
                meta.context_lens, k.shape[1] - s, s, self.window, q.dtype))
        else:
            mask = meta.windowed(("causal", s, self.window), lambda: aw.causal_window_mask(
                s, self.window, q.dtype, q.device))
        if self.softcap is None:
            if meta.block_tables is not None and self.backend.context_prefill is not None:
                out = self.backend.context_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                                   self.scale)
                if out is not None:
                    return out.transpose(1, 2)
            return self._prefill(q, k, v, mask)
        out = aw.explicit_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale,
                                    self.softcap)
        return out.transpose(1, 2)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        b = q.shape[0]
        if meta.block_list is not None:
            return self._flat_decode(q, k_cache, v_cache, meta)
        paged_decode = self.backend.paged_decode
        if paged_decode is not None and k_cache.dtype not in FP8_KV_DTYPES:
            band = {}
            if self.banded:  # the C kernel's start per row and cap
                band = {"softcap": self.softcap, "starts": None if self.window is None else meta.windowed(
                    ("starts", self.window), lambda: aw.window_starts(meta.context_lens, self.window))}
            out = paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale, **band)
            if out is not None:
                return out.view(b, 1, self.num_heads, self.head_dim)
        return self._gathered_decode(q, k_cache, v_cache, meta)

    def _flat_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """Decode block by block over the flat layout of the blocks in use."""
        flat_decode = self.backend.flat_decode
        if flat_decode is None:
            raise ValueError(f"attention {self.backend.name!r} does not decode over a flat block layout")
        b = q.shape[0]
        fp8 = k_cache.dtype in FP8_KV_DTYPES
        # A float8 cache holds k / k_scale and v / v_scale: k_scale scales the scores, v_scale the output.
        scale = self.scale * self.k_scale if fp8 else self.scale
        bias, band = meta.block_bias, {}
        if self.window is not None:
            bias = meta.windowed(("flat", self.window), lambda: aw.flat_window_bias(
                meta.block_groups, meta.block_bias, b, self.window))
        if self.softcap is not None:
            band = {"softcap": self.softcap}
        out = flat_decode(q.reshape(b, self.num_heads, self.head_dim), k_cache, v_cache, meta.block_list,
                          meta.block_groups, bias, scale, **band)
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
        # q [B, 1, Hq, D] -> [B, Hkv, group, D]: the group's query heads act as the query axis.
        qg = q.reshape(b, self.num_kv_heads, self.group, self.head_dim).to(keys.dtype)
        if self.banded:
            mask = meta.windowed(("decode", self.window), lambda: aw.decode_window_mask(
                context_lens, length, self.window))
            if self.softcap is not None:
                out = aw.explicit_attention(qg, keys, values, mask, self.scale, self.softcap)
                return out.reshape(b, 1, self.num_heads, self.head_dim).to(q.dtype)
            out = self.backend.decode(qg, keys, values, attn_mask=mask, scale=self.scale)
            return out.reshape(b, 1, self.num_heads, self.head_dim).to(q.dtype)
        if meta.decode_mask is None:
            pos = torch.arange(length, device=q.device)
            # Position 0 is always allowed so a padded row with context_len 0 yields finite output, not NaN.
            mask = (pos.unsqueeze(0) < context_lens.unsqueeze(1)) | (pos.unsqueeze(0) == 0)  # [B, L]
            meta.decode_mask = mask[:, None, None, :]
        out = self.backend.decode(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return out.reshape(b, 1, self.num_heads, self.head_dim).to(q.dtype)
