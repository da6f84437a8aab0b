"""What an `Attention` layer asks of the kernels that compute it: the attention backend interface.

One object per implementation (torch SDPA here; the CPU's kernels, Habana's FusedSDPA and the explicit math
under ``device/``), chosen once per model by the device backend (``device/base.Backend.attention``) and set
on the model's layers (``layers/attention.use_attention``). The layers call only what this class declares,
so they never import device code; a new implementation subclasses it where its device lives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class AttentionBackend:
    """torch SDPA for every step (CUDA, and any device without kernels of its own); an implementation
    overrides `prefill` and `decode` and offers the optional kernels it has (None: not offered)."""

    name = "sdpa"
    # Whether `prefill` takes torch SDPA's enable_gqa (K/V with fewer heads than Q, not repeated).
    prefill_gqa = True
    # (q [B, 1, Hq, D], k_cache, v_cache, block_tables, context_lens, scale) -> [B, Hq, D] read from the paged
    # cache in place, or None for tensors it does not take (which then go through the gather and `decode`).
    # The layer never hands it a float8 cache. A windowed or soft-capped layer also passes ``starts`` ([B], each
    # row's first position, or None) and ``softcap`` (or None) by keyword.
    paged_decode: Callable[..., torch.Tensor | None] | None = None
    # (q [B, Hq, S, D], k/v [B, Hkv, L, D], additive mask, scale) -> [B, Hq, S, D] for a prefill over cached
    # blocks, or None for shapes it does not take (which then go through `prefill`).
    context_prefill: Callable[..., torch.Tensor | None] | None = None
    # (q [B, Hq, S, D], k/v [B, Hkv, S, D], scale) -> [B, Hq, S, D] for a causal prefill (no cached blocks),
    # or None for tensors it does not take (which then go through `prefill`).
    causal_prefill: Callable[..., torch.Tensor | None] | None = None
    # (q [B, Hq, D], k_cache, v_cache, block_list, block_groups, block_bias, scale) -> [B, Hq, D] over the
    # flat layout of `flat_paged_attention`: decode steps whose metadata carries it (the runner builds it
    # where this is offered and the device backend asks for it). A soft-capped layer passes ``softcap=``.
    flat_decode: Callable[..., torch.Tensor] | None = None
    # `paged_decode`'s signature, run for every query token of a prefill (a prompt, a chunk, the tokens after
    # cached blocks, a speculative verify pass) as a decode row over its own first positions, after the step's
    # K/V are written: a query then computes exactly as a decode step's does, whatever else is in the step
    # (the batch-invariant mode). None: prefills take the kernels above.
    every_query: Callable[..., torch.Tensor | None] | None = None

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """q ``[B, Hq, S, D]`` over k/v ``[B, H, L, D]`` (H == Hq, or fewer with enable_gqa where
        `prefill_gqa`), causal or under `attn_mask` (bool, or additive), as torch SDPA takes them."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """Decode over the gathered blocks: q ``[B, Hkv, G, D]`` (a KV group's query heads as the query axis),
        k/v ``[B, Hkv, L, D]`` (transposed views of the gathered ``[B, L, Hkv, D]``), attn_mask ``[B, 1, 1,
        L]`` bool."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
