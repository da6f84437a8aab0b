"""Model building blocks: tensor-parallel linear/embedding layers, RoPE, norms, paged attention."""

from .activation import get_activation
from .attention import Attention, AttentionMetadata, write_kv
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .fused_qkv import FusedQKVParallelLinear
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
from .norm import LayerNorm, RMSNorm
from .position import PositionEmbedding
from .rotary import RotaryEmbedding, rope_params_from_config

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ColumnParallelLinear",
    "FusedMoE",
    "FusedQKVParallelLinear",
    "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "PositionEmbedding",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "allocate_kv_cache",
    "get_activation",
    "kv_bytes_per_block",
    "rope_params_from_config",
    "write_kv",
]
