"""A model's memory on each card, from its config.json alone (pure arithmetic, no torch).

The weights one tensor-parallel shard holds, counted as the runtime slices them, and the KV-cache
bytes a token costs it. A mixture-of-experts model holds every expert on every shard (each expert's
intermediate dimension is split), so all experts count, not only the few a token activates
(Qwen3-30B-A3B: 30.5B parameters in memory, 3.3B active; DeepSeek-V3: 671B). Multi-head latent
attention (DeepSeek-V2/V3, a config with ``kv_lora_rank``) caches the compressed latent and the rope
key instead of keys and values, whole on every shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryEstimate", "model_memory"]


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # in the checkpoint (every expert)
    weight_bytes_per_shard: int
    kv_bytes_per_token_per_shard: int  # all layers

    def total_per_shard(self, kv_tokens: int) -> int:
        return self.weight_bytes_per_shard + kv_tokens * self.kv_bytes_per_token_per_shard


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sparse_layers(cfg: dict[str, Any]) -> list[bool]:
    """Per layer: whether it is a mixture of experts (Mixtral: all; Qwen-MoE: `decoder_sparse_step` and
    `mlp_only_layers`; DeepSeek: `first_k_dense_replace` and `moe_layer_freq`)."""
    layers = int(cfg["num_hidden_layers"])
    if not _experts(cfg):
        return [False] * layers
    if cfg.get("n_routed_experts"):
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        return [i >= first and i % freq == 0 for i in range(layers)]
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _mlp(cfg: dict[str, Any], sparse: bool, shards: int) -> int:
    hidden = int(cfg["hidden_size"])
    if not sparse:
        return 3 * hidden * (int(cfg["intermediate_size"]) // shards)
    experts = _experts(cfg)
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    router = experts * hidden + (experts if cfg.get("n_routed_experts") else 0)  # DeepSeek's correction bias
    shared = int(cfg.get("n_shared_experts") or 0) * inter
    return experts * 3 * hidden * (inter // shards) + router + 3 * hidden * (shared // shards)


def _latent_attention(cfg: dict[str, Any], shards: int) -> tuple[int, int]:
    """(weight elements, cached values per token) of one MLA layer: heads split, the latent replicated."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]) // shards
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    rank, q_rank = int(cfg["kv_lora_rank"]), cfg.get("q_lora_rank")
    q = heads * (nope + rope) * (int(q_rank) if q_rank else hidden) + (int(q_rank) * (hidden + 1) if q_rank else 0)
    kv = (rank + rope) * hidden + rank + heads * (nope + v) * rank
    return q + kv + hidden * heads * v, rank + rope


def _attention(cfg: dict[str, Any], shards: int) -> tuple[int, int]:
    """(weight elements, cached values per token) of one attention layer on one shard."""
    if cfg.get("kv_lora_rank"):
        return _latent_attention(cfg, shards)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_local = _ceil_div(int(cfg.get("num_key_value_heads") or heads), shards)  # fewer KV heads: a whole one each
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    model_type = str(cfg.get("model_type", ""))
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = bias or model_type == "qwen2", bias and model_type != "qwen2"
    q_local = heads // shards
    weights = (2 * q_local + 2 * kv_local) * head_dim * hidden
    weights += ((q_local + 2 * kv_local) * head_dim if qkv_bias else 0) + (hidden if o_bias else 0)
    weights += 2 * head_dim if model_type.startswith("qwen3") else 0  # q/k norms
    return weights, 2 * kv_local * head_dim


def _elements_per_shard(cfg: dict[str, Any], shards: int) -> tuple[int, int]:
    """(weight elements one of `shards` tensor-parallel ranks holds, KV values per token it caches)."""
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    attention, kv_width = _attention(cfg, shards)
    total = _ceil_div(vocab, shards) * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2) + hidden
    total += sum(attention + 2 * hidden + _mlp(cfg, sparse, shards) for sparse in sparse_layers(cfg))
    return total, kv_width * int(cfg["num_hidden_layers"])


def model_memory(cfg: dict[str, Any], dtype_bytes: int = 2, shards: int = 1,
                 kv_dtype_bytes: int | None = None) -> MemoryEstimate:
    """Weights and KV bytes per token of a decoder (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE,
    DeepSeek-V3) from its config.json, per tensor-parallel shard. Norms and routers are replicated."""
    per_shard, kv_values = _elements_per_shard(cfg, shards)
    return MemoryEstimate(parameters=_elements_per_shard(cfg, 1)[0], weight_bytes_per_shard=per_shard * dtype_bytes,
                          kv_bytes_per_token_per_shard=kv_values * (kv_dtype_bytes or dtype_bytes))
