"""What a pod of this spec will warm up, read from the runtime's own bucket code, and what a model
holds in device memory per card, read from its config.json (pure).

The operator does not model warmup: it builds the runtime's configuration from the command line and
environment it renders into the pod, exactly as `gaudi-serve launch` on a Gaudi card would resolve
them, and asks `gaudi_runtime.buckets.warmup_plan` (the function the shards warm up from) for the
shapes. `gaudi_runtime.config` and `gaudi_runtime.buckets` import neither torch nor anything of the
runtime's heavy dependencies, so the operator image carries them (Dockerfile.operator installs the
package without its extras).

`model_memory` counts a card's weight bytes (every expert of a mixture of experts: each card holds
its slice of all of them) and its KV-cache bytes per token, from the per-token shapes the runtime's
model classes cache: keys and values of the card's KV heads, or for multi-head latent attention
(DeepSeek-V2/V3, a config with ``kv_lora_rank``) the latent and the rope key, which every card holds
whole.

Nothing here sizes a probe: the probes follow the pod's progress (render.probes). The figure is shown
while a pod loads, before the pod reports its own total.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from gaudi_runtime import buckets
from gaudi_runtime.config import Config, ConfigError, add_arguments, resolve

from .render import runtime_args, runtime_env
from .spec import InferenceServiceSpec

# The device a Gaudi pod's `--device auto` resolves to.
POD_DEVICE = "hpu"

__all__ = ["MemoryEstimate", "expected_warmup_shapes", "model_memory", "pod_runtime_config"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3fn": 1}


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes_per_card: int
    kv_bytes_per_token_per_card: int  # all layers

    def total_per_card(self, kv_tokens: int) -> int:
        return self.weight_bytes_per_card + kv_tokens * self.kv_bytes_per_token_per_card


def _attention_params(cfg: dict[str, Any], hidden: int, heads: int) -> int:
    if cfg.get("kv_lora_rank"):
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        q = hidden * heads * (nope + rope) if not q_rank else hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        return q + hidden * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * hidden
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return hidden * head_dim * (2 * heads + 2 * kv_heads)


def _experts(cfg: dict[str, Any]) -> int:
    return cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0


def _is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    if not _experts(cfg):
        return False
    return i >= cfg.get("first_k_dense_replace", 0) and i % (cfg.get("moe_layer_freq") or 1) == 0


def _mlp_params(cfg: dict[str, Any], hidden: int, i: int) -> int:
    if not _is_moe_layer(cfg, i):
        return 3 * hidden * cfg["intermediate_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = (cfg.get("n_shared_experts") or 0) * inter
    bias = _experts(cfg) if cfg.get("n_routed_experts") else 0  # DeepSeek's e_score_correction_bias
    return _experts(cfg) * (3 * hidden * inter + hidden) + bias + 3 * hidden * shared


def model_memory(config: dict[str, Any], dtype: str, shards: int, kv_cache_dtype: str | None = None) -> MemoryEstimate:
    """A card's bytes for a model of `config` (config.json as a dict) served in `dtype` over `shards` cards:
    weights split evenly (embeddings, attention and every expert are sharded; norms are few), and the KV
    cache per token in `kv_cache_dtype` (default: `dtype`)."""
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    params = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    params += sum(_attention_params(config, hidden, heads) + _mlp_params(config, hidden, i) + 2 * hidden
                  for i in range(layers))
    kv_bytes = DTYPE_BYTES[kv_cache_dtype or dtype]
    if config.get("kv_lora_rank"):  # replicated latent: every card caches it whole
        per_token = layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * kv_bytes
    else:
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        per_token = 2 * layers * max(1, kv_heads // shards) * head_dim * kv_bytes
    return MemoryEstimate(-(-params * DTYPE_BYTES[dtype] // shards), per_token)


def pod_runtime_config(args: list[str], env: list[dict[str, Any]], shards: int) -> Config:
    """The runtime's configuration for the container `args` (after `launch`) and `env` on a Gaudi node.

    Variables taken from Secrets or fields (valueFrom) are unknown here and left out; none of them sets
    a bucket. Raises ConfigError where the runtime would refuse to start."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    parsed, _ = parser.parse_known_args(args[1:] if args[:1] == ["launch"] else args)
    environ = {e["name"]: str(e["value"]) for e in env if "value" in e and "name" in e}
    if parsed.device is None and "DEVICE" not in environ:
        parsed.device = POD_DEVICE
    return resolve(parsed, environ, device_count=lambda _device: shards)


def expected_warmup_shapes(spec: InferenceServiceSpec) -> int | None:
    """How many shapes a pod of `spec` warms up on Gaudi (None: the runtime would refuse the settings)."""
    try:
        cfg = pod_runtime_config(runtime_args(spec), runtime_env(spec), spec.shards)
    except ConfigError:
        return None
    if not cfg.device.warmup_enabled:
        return 0
    flat = buckets.flat_decode_on(cfg.device.device, cfg.device.use_flash_attention)
    return buckets.warmup_shape_count(cfg, flat)
