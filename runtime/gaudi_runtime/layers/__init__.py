"""Model building blocks: tensor-parallel linear/embedding layers, RoPE, RMSNorm, paged attention."""

from .attention import Attention, AttentionMetadata, write_kv
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .kv_cache import allocate_kv_cache, kv_bytes_per_block
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPContext,
)
from .moe import FusedMoE
from .norm import RMSNorm
from .rotary import RotaryEmbedding, rope_params_from_config

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ColumnParallelLinear",
    "FusedMoE",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "allocate_kv_cache",
    "kv_bytes_per_block",
    "rope_params_from_config",
    "write_kv",
]
