"""A model's memory on each card, from its config.json alone (pure arithmetic, no torch).

The weights one tensor-parallel shard holds, counted as the runtime slices them, and the KV-cache
bytes a token costs it. A mixture-of-experts model holds every expert on every shard (each expert's
intermediate dimension is split), so all experts count, not only the few a token activates
(Qwen3-30B-A3B: 30.5B parameters in memory, 3.3B active; DeepSeek-V3: 671B). Multi-head latent
attention (DeepSeek-V2/V3, a config with ``kv_lora_rank``) caches the compressed latent and the rope
key instead of keys and values, whole on every shard. A pre-quantized checkpoint (GPTQ, AWQ, FP8) keeps
its linear weights packed, and they count as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CONFIG_KEYS", "MemoryEstimate", "config_subset", "linear_bytes_per_weight", "memory_status", "model_memory"]

# The config.json entries the estimate reads: what status.download keeps of the download's config (so that a
# later pass, after a change of spec.shards, estimates again without the Job's log).
CONFIG_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias", "moe_intermediate_size",
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
    "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "quantization_config",
)
_QUANT_KEYS = ("quant_method", "bits", "w_bit", "group_size", "q_group_size")


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


def _mlp(cfg: dict[str, Any], sparse: bool, shards: int) -> tuple[int, int]:
    """(linear weight elements, other elements: routers) of one feed-forward layer on one shard."""
    hidden = int(cfg["hidden_size"])
    if not sparse:
        return 3 * hidden * (int(cfg["intermediate_size"]) // shards), 0
    experts = _experts(cfg)
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    router = experts * hidden + (experts if cfg.get("n_routed_experts") else 0)  # DeepSeek's correction bias
    shared = int(cfg.get("n_shared_experts") or 0) * inter
    return experts * 3 * hidden * (inter // shards) + 3 * hidden * (shared // shards), router


def _latent_attention(cfg: dict[str, Any], shards: int) -> tuple[int, int, int]:
    """(linear elements, other elements, cached values per token) of one MLA layer: heads split, the
    latent replicated."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]) // shards
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    rank, q_rank = int(cfg["kv_lora_rank"]), int(cfg.get("q_lora_rank") or 0)
    q = heads * (nope + rope) * (q_rank or hidden) + q_rank * hidden
    kv = (rank + rope) * hidden + heads * (nope + v) * rank
    return q + kv + hidden * heads * v, q_rank + rank, rank + rope  # other: the two latents' norms


def _attention(cfg: dict[str, Any], shards: int) -> tuple[int, int, int]:
    """(linear elements, other elements: biases and norms, cached values per token) of one attention
    layer on one shard."""
    if cfg.get("kv_lora_rank"):
        return _latent_attention(cfg, shards)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_local = _ceil_div(int(cfg.get("num_key_value_heads") or heads), shards)  # fewer KV heads: a whole one each
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    model_type = str(cfg.get("model_type", ""))
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = bias or model_type == "qwen2", bias and model_type != "qwen2"
    q_local = heads // shards
    other = ((q_local + 2 * kv_local) * head_dim if qkv_bias else 0) + (hidden if o_bias else 0)
    other += 2 * head_dim if model_type.startswith("qwen3") else 0  # q/k norms
    return (2 * q_local + 2 * kv_local) * head_dim * hidden, other, 2 * kv_local * head_dim


def _elements_per_shard(cfg: dict[str, Any], shards: int) -> tuple[int, int, int]:
    """(linear weight elements, other weight elements, KV values per token) one of `shards`
    tensor-parallel ranks holds."""
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    attention, attention_other, kv_width = _attention(cfg, shards)
    linear = 0
    other = _ceil_div(vocab, shards) * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2) + hidden
    for sparse in sparse_layers(cfg):
        mlp, router = _mlp(cfg, sparse, shards)
        linear += attention + mlp
        other += attention_other + 2 * hidden + router
    return linear, other, kv_width * int(cfg["num_hidden_layers"])


def linear_bytes_per_weight(cfg: dict[str, Any], dtype_bytes: int) -> float:
    """What one weight of a linear layer costs in memory: the model dtype, or a pre-quantized checkpoint's
    packed bits with their group scales and zero points (GPTQ, AWQ), or one byte (FP8; with block scales
    a float32 per row and block of columns, as the runtime expands them), as the runtime keeps them
    (packed, not dequantized). Embeddings, the LM head and norms stay in the model dtype."""
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        bits = int(qc.get("bits") or qc.get("w_bit") or 4)
        group = int(qc.get("group_size") or qc.get("q_group_size") or -1)
        per_group = (2 + bits / 8) / group if group > 0 else 0.0  # a float16 scale and a packed zero per group
        return bits / 8 + per_group
    if method in ("fp8", "compressed-tensors"):
        block = qc.get("weight_block_size")  # block scales: a float32 per weight row and block of columns
        return 1.0 + (4 / block[1] if isinstance(block, list) and len(block) == 2 and block[1] else 0.0)
    return float(dtype_bytes)


def model_memory(cfg: dict[str, Any], dtype_bytes: int = 2, shards: int = 1,
                 kv_dtype_bytes: int | None = None) -> MemoryEstimate:
    """Weights and KV bytes per token of a decoder (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE,
    DeepSeek-V3) from its config.json, per tensor-parallel shard. Norms and routers are replicated; a
    pre-quantized checkpoint's linear layers count their packed bytes (`linear_bytes_per_weight`)."""
    linear, other, kv_values = _elements_per_shard(cfg, shards)
    one_linear, one_other, _ = _elements_per_shard(cfg, 1)
    weight_bytes = other * dtype_bytes + round(linear * linear_bytes_per_weight(cfg, dtype_bytes))
    return MemoryEstimate(parameters=one_linear + one_other, weight_bytes_per_shard=weight_bytes,
                          kv_bytes_per_token_per_shard=kv_values * (kv_dtype_bytes or dtype_bytes))


def config_subset(cfg: Any) -> dict[str, Any] | None:
    """What the estimate reads of a config.json (None when it is not an object)."""
    if not isinstance(cfg, dict):
        return None
    out = {k: cfg[k] for k in CONFIG_KEYS if k in cfg}
    if isinstance(out.get("quantization_config"), dict):
        out["quantization_config"] = {k: v for k, v in out["quantization_config"].items() if k in _QUANT_KEYS}
    return out


def memory_status(cfg: dict[str, Any], shards: int, host_tier_bytes: int | None = None) -> dict[str, Any] | None:
    """status.memory: the estimate for one card of `shards`, in bytes, and with a host tier of `host_tier_bytes`
    (the pod's, shared by its shards as vLLM's --kv-offloading-size is by its ranks, each keeping its own slice
    of every token) the tokens of KV cache it holds. None for a config it cannot read (a multimodal model's
    nested text config, say)."""
    try:
        est = model_memory(cfg, dtype_bytes=2, shards=shards)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    out: dict[str, Any] = {"parameters": est.parameters, "weightBytesPerShard": est.weight_bytes_per_shard,
                           "kvBytesPerTokenPerShard": est.kv_bytes_per_token_per_shard}
    if host_tier_bytes and est.kv_bytes_per_token_per_shard:
        out["hostTierTokens"] = host_tier_bytes // (est.kv_bytes_per_token_per_shard * shards)
    return out
