"""What a pod of this spec will warm up, read from the runtime's own bucket code (pure).

The operator does not model warmup: it builds the runtime's configuration from the command line and
environment it renders into the pod, exactly as `gaudi-serve launch` on a Gaudi card would resolve
them, and asks `gaudi_runtime.buckets.warmup_plan` (the function the shards warm up from) for the
shapes. `gaudi_runtime.config` and `gaudi_runtime.buckets` import neither torch nor anything of the
runtime's heavy dependencies, so the operator image carries them (Dockerfile.operator installs the
package without its extras).

Nothing here sizes a probe: the probes follow the pod's progress (render.probes). The figure is shown
while a pod loads, before the pod reports its own total.

`model_memory` sizes a model from its config.json alone (pure arithmetic, no torch): the weights each
tensor-parallel shard holds and the KV-cache bytes a token costs it. A mixture-of-experts model holds
every expert on every shard (each expert's intermediate dimension is split), so all experts' weights
count, not only the few a token activates (Qwen3-30B-A3B: 30.5B parameters in memory, 3.3B active).
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


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # in the checkpoint (every expert)
    weight_bytes_per_shard: int
    kv_bytes_per_token_per_shard: int


def _experts(cfg: dict[str, Any]) -> tuple[int, int, list[bool]]:
    """(experts, their intermediate size, per layer: whether it is sparse) of a Mixtral or Qwen-MoE config."""
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return 0, 0, [False] * layers
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return experts, int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]), sparse


def _elements_per_shard(cfg: dict[str, Any], shards: int) -> tuple[int, int]:
    """(weight elements one of `shards` tensor-parallel ranks holds, KV heads it caches)."""
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_local = -(-kv_heads // shards)  # fewer KV heads than shards: each rank keeps a whole one
    experts, expert_inter, sparse = _experts(cfg)
    model_type = str(cfg.get("model_type", ""))
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = bias or model_type == "qwen2", bias and model_type != "qwen2"
    q_local = heads // shards
    attention = (2 * q_local + 2 * kv_local) * head_dim * hidden
    attention += ((q_local + 2 * kv_local) * head_dim if qkv_bias else 0) + (hidden if o_bias else 0)
    norms = 2 * hidden + (2 * head_dim if model_type.startswith("qwen3") else 0)
    total = -(-vocab // shards) * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2) + hidden
    for is_sparse in sparse:
        if is_sparse:  # every expert, each with its slice of the intermediate dimension, and the router
            mlp = experts * 3 * hidden * (expert_inter // shards) + experts * hidden
        else:
            mlp = 3 * hidden * (int(cfg["intermediate_size"]) // shards)
        total += attention + norms + mlp
    return total, kv_local * head_dim


def model_memory(cfg: dict[str, Any], dtype_bytes: int = 2, shards: int = 1,
                 kv_dtype_bytes: int | None = None) -> MemoryEstimate:
    """Weights and KV bytes per token of a Llama-layout decoder (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE)
    from its config.json, per tensor-parallel shard. Norms, q/k norms and routers are replicated."""
    per_shard, kv_width = _elements_per_shard(cfg, shards)
    layers = int(cfg["num_hidden_layers"])
    return MemoryEstimate(parameters=_elements_per_shard(cfg, 1)[0], weight_bytes_per_shard=per_shard * dtype_bytes,
                          kv_bytes_per_token_per_shard=2 * layers * kv_width * (kv_dtype_bytes or dtype_bytes))
