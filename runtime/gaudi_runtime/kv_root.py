"""The root of every KV block's hash chain: what besides the tokens decides a block's bytes.

Shared by the router's prefix cache (router/prefix_cache.py) and the shards' disk tier
(shard/kv_files.py), whose directory is keyed by it.
"""

from __future__ import annotations

import hashlib

from gaudi_runtime.config import Config


def root_hash(cfg: Config) -> bytes:
    """The parent of every sequence's first block: the model, its revision, dtypes, quantization, RoPE
    and the block size."""
    m = cfg.model
    salt = "|".join(str(x) for x in (m.model_id, m.revision, m.dtype, m.kv_cache_dtype, m.quantize,
                                     m.quant_config, m.rope_scaling, m.rope_factor, cfg.device.block_size))
    return hashlib.sha256(salt.encode()).digest()
