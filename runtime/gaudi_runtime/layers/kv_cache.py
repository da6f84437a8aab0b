"""Paged KV cache storage.

Per layer a ``(k, v)`` pair, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The flat slot of token ``j`` of a sequence is ``block_table[j // block_size] * block_size + j % block_size``.
Block 0 is a reserved trash block (padding tokens write there; it is never given to a sequence).
The cache is zero-initialized: attention masks unused slots, and zeros (never NaN garbage)
keep masked-out entries harmless.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
