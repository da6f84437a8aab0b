"""Paged KV cache storage.

Per layer a pair of tensors ``[num_blocks, block_size, heads, dim]``, each with the (heads, dim) its model
asks for per token (``interface.CausalLM.kv_token_shapes``): for grouped-query attention the keys and
the values, ``(num_kv_heads, head_dim)`` each; for multi-head latent attention (``layers/mla.py``) the
compressed latent and the shared rope key, ``(1, kv_lora_rank)`` and ``(1, qk_rope_head_dim)``. The
cache is sized and counted from these shapes only, so a model's bytes per token are what it declares.
The flat slot of token ``j`` of a sequence is ``block_table[j // block_size] * block_size + j % block_size``.
Block 0 is a reserved trash block (padding tokens write there; it is never given to a sequence).
The cache is zero-initialized: attention masks unused slots, and zeros (never NaN garbage)
keep masked-out entries harmless.
"""

from __future__ import annotations

import torch

TokenShapes = tuple[tuple[int, int], tuple[int, int]]  # (heads, dim) of the pair's two tensors, per token


def model_token_shapes(model) -> TokenShapes:
    """The per-token shapes `model` declares; a model without the attribute caches keys and values."""
    shapes = getattr(model, "kv_token_shapes", None)
    return tuple(shapes) if shapes else ((model.num_kv_heads, model.head_dim),) * 2


def allocate_cache(num_layers: int, num_blocks: int, block_size: int, token_shapes: TokenShapes,
                   dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(torch.zeros((num_blocks, block_size, h, d), dtype=dtype, device=device) for h, d in token_shapes)
            for _ in range(num_layers)]


def cache_bytes_per_block(num_layers: int, block_size: int, token_shapes: TokenShapes, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * block_size * sum(h * d for h, d in token_shapes) * element_size


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return allocate_cache(num_layers, num_blocks, block_size, ((num_kv_heads, head_dim),) * 2, dtype, device)


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    return cache_bytes_per_block(num_layers, block_size, ((num_kv_heads, head_dim),) * 2, dtype)
