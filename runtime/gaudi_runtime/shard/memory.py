"""What a shard holds in memory: its weights, and how many KV-cache blocks to allocate."""

from __future__ import annotations

import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config


def size_kv_cache(cfg: Config, bytes_per_block: int, free_bytes: int | None) -> int:
    """Blocks to allocate (block 0, the padding block, included)."""
    per_seq = buckets.blocks_per_sequence(cfg)
    if cfg.scheduling.max_batch_total_tokens is not None:
        return buckets.ceil_div(cfg.scheduling.max_batch_total_tokens, cfg.device.block_size) + 1
    wanted = cfg.scheduling.max_batch_size * per_seq + 1
    if free_bytes is None:
        return wanted
    fit = int(free_bytes * cfg.device.memory_fraction) // bytes_per_block
    if fit < per_seq + 1:
        raise MemoryError(
            f"the KV cache does not fit: {fit} blocks free, one sequence of --max-total-tokens "
            f"{cfg.limits.max_total_tokens} needs {per_seq + 1}; lower --max-total-tokens"
        )
    return min(wanted, fit)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes this rank holds for the model: parameters (tied ones once) and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
