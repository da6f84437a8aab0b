"""MEASURE mode on our path: forward hooks that record per-tensor max-abs statistics, INC's maxabs observer.

Every quantizable layer gets a node (input, output and weight max-abs; an
embedding's input is token ids, so it has none), and every attention layer
gets `<name>.k_cache` and `<name>.v_cache` nodes with the max-abs of the keys
and values it writes (the FP8 KV-cache scales).
"""

from __future__ import annotations

import torch
from torch import nn

from gaudi_runtime.quant.layers import attention_layers, quantizable_layers
from gaudi_runtime.quant.stats import NodeStats


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().amax().float())


class Observer:
    """Attach with `Observer(model)`, run forward passes, read `nodes`, then `remove()`."""

    def __init__(self, model: nn.Module):
        self.nodes: dict[str, NodeStats] = {}
        self._handles = []
        for name, m in quantizable_layers(model).items():
            self._handles.append(m.register_forward_hook(self._layer_hook(name)))
        for name, m in attention_layers(model).items():
            self._handles.append(m.register_forward_hook(self._kv_hook(name)))

    def _node(self, name: str) -> NodeStats:
        return self.nodes.setdefault(name, NodeStats())

    def _layer_hook(self, name: str):
        def hook(module, args, output):
            x = args[0]
            inputs = [] if not torch.is_floating_point(x) else [_amax(x)]
            self._node(name).update(inputs, _amax(output), _amax(module.weight))

        return hook

    def _kv_hook(self, name: str):
        def hook(module, args, output):
            k, v = args[1], args[2]
            self._node(f"{name}.k_cache").update([_amax(k)], None, None)
            self._node(f"{name}.v_cache").update([_amax(v)], None, None)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
