"""Which layers of a model FP8 applies to: INC's allowlist/blocklist over our layer names and types.

A layer's types are its class name (``QKVParallelLinear``, ``RowParallelLinear``,
``ParallelLMHead``, ...) plus the generic ``Linear`` (every linear layer and the
LM head) or ``Embedding``. A name matches a layer when it is a substring of the
layer's name, as in INC. With no allowlist every layer is allowed; the
blocklist then removes layers. A type or name that matches no layer is an
error: it is almost always a typo, and silently quantizing what the user
meant to keep in bf16 would be worse.
"""

from __future__ import annotations

from torch import nn

from gaudi_runtime.config import ConfigError
from gaudi_runtime.layers.attention import Attention
from gaudi_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gaudi_runtime.layers.linear import LinearBase
from gaudi_runtime.layers.moe import FusedMoE
from gaudi_runtime.quant.config import LayerFilter, QuantConfig


def layer_types(module: nn.Module) -> set[str]:
    names = {type(module).__name__}
    if isinstance(module, (LinearBase, ParallelLMHead)):
        names.add("Linear")
    elif isinstance(module, VocabParallelEmbedding):
        names.add("Embedding")
    return names


def quantizable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer FP8 can hold, by name (a tied LM head included: it shares the embedding's float8 copy).

    MoE routers are left out, as vLLM does: a few KiB each, and a flipped routing decision costs more than
    any rounding elsewhere."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, FusedMoE)}
    return {name: m for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, (LinearBase, VocabParallelEmbedding)) and id(m) not in routers}


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


def _matches(f: LayerFilter, name: str, types: set[str]) -> bool:
    return bool(types & set(f.types)) or any(n in name for n in f.names)


def _check_filter(qc: QuantConfig, key: str, f: LayerFilter, layers: dict[str, nn.Module]) -> None:
    all_types = set().union(*(layer_types(m) for m in layers.values())) if layers else set()
    for t in f.types:
        if t not in all_types:
            raise ConfigError(f"QUANT_CONFIG {qc.source or ''}: {key} type {t!r} matches no layer of this model; "
                              f"its layer types are {', '.join(sorted(all_types))}")
    for n in f.names:
        if not any(n in name for name in layers):
            sample = ", ".join(list(layers)[:6])
            raise ConfigError(f"QUANT_CONFIG {qc.source or ''}: {key} name {n!r} matches no layer of this model "
                              f"(layer names look like {sample}, ...)")


def select_layers(model: nn.Module, qc: QuantConfig) -> list[str]:
    """Names of the layers to hold in FP8, after checking that every filter entry names something."""
    layers = quantizable_layers(model)
    _check_filter(qc, "allowlist", qc.allowlist, layers)
    _check_filter(qc, "blocklist", qc.blocklist, layers)
    chosen = []
    for name, m in layers.items():
        types = layer_types(m)
        if qc.allowlist and not _matches(qc.allowlist, name, types):
            continue
        if _matches(qc.blocklist, name, types):
            continue
        chosen.append(name)
    return chosen
