"""What a model's layers ask of a device besides attention: one typed kernel entry per layer kind.

The device backend builds a `LayerKernels` for a loaded model (``device/base.Backend.layer_kernels``, as it
builds the attention backend) and `install_kernels` gives each layer its entry: the one place where a
layer's ``kernel`` (or ``cache_writer``) hook is set. Every entry is optional; a layer whose hook stays None
runs its own torch code. The layers call the hooks; they never import device code.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch
from torch import nn

from gaudi_runtime.layers.attention import Attention
from gaudi_runtime.layers.embedding import ParallelLMHead
from gaudi_runtime.layers.linear import LinearBase
from gaudi_runtime.layers.lora import LoraWeights
from gaudi_runtime.layers.moe import ExpertsKernel, FusedMoE
from gaudi_runtime.layers.norm import RMSNorm
from gaudi_runtime.layers.rotary import RotaryEmbedding

log = logging.getLogger(__name__)

Tensor = torch.Tensor
# (x, bias) -> x @ W.T + bias, over the layer's weight as the kernel laid it out (or None for rows it leaves to
# the layer's own path: a packed GPTQ layer's many rows).
LinearKernel = Callable[[Tensor, Tensor | None], Tensor | None]
# (x, residual, weight, eps) -> what `RMSNorm.forward` returns, or None for tensors it does not take.
NormKernel = Callable[[Tensor, Tensor | None, Tensor, float], Tensor | tuple[Tensor, Tensor] | None]
# (positions, q, k, cos, sin) -> rotated (q, k), or None for tensors it does not take.
RotaryKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor] | None]
# (k_cache, v_cache, k, v, slots) -> whether it wrote them (False: nothing written, `write_kv` runs).
CacheWriter = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], bool]
# (lora, x, y, index) -> y with each row's adapter's product added, or None for tensors it does not take.
LoraKernel = Callable[[LoraWeights, Tensor, Tensor, Tensor], Tensor | None]


@dataclass(frozen=True)
class LayerKernels:
    """A device's kernels for one model. `linear` and `lora` are per layer (a kernel closes over that layer's
    own weight layout or output slices): given a layer, its kernel, or None to leave its hook as it is.
    The others are one kernel for every layer of their kind. None: no kernel of this kind."""

    # Linear layers and LM heads (LinearBase, ParallelLMHead: plain, FP8 checkpoint and GPTQ layers alike).
    linear: Callable[[nn.Module], LinearKernel | None] | None = None
    # RMSNorm itself: a subclass with a formula of its own (Gemma's norm) keeps its code.
    norm: NormKernel | None = None
    # RotaryEmbedding itself: a scaled variant keeps its code.
    rotary: RotaryKernel | None = None
    # Attention itself: the paged cache's writes.
    cache_write: CacheWriter | None = None
    # The adapters of a linear layer with LoRA weights.
    lora: Callable[[LinearBase], LoraKernel | None] | None = None
    # Every FusedMoE's experts.
    experts: ExpertsKernel | None = None


KINDS = tuple(f.name for f in fields(LayerKernels))


def _hooks(model: nn.Module):
    """(kind, object holding the hook, hook attribute, layer) for every hook of `model`."""
    for m in model.modules():
        if type(m) is RMSNorm:
            yield "norm", m, "kernel", m
        elif type(m) is RotaryEmbedding:
            yield "rotary", m, "kernel", m
        elif type(m) is Attention:
            yield "cache_write", m, "cache_writer", m
        elif isinstance(m, FusedMoE):
            yield "experts", m, "kernel", m
        if isinstance(m, (LinearBase, ParallelLMHead)):
            yield "linear", m, "kernel", m
        if isinstance(m, LinearBase) and m.lora is not None:
            yield "lora", m.lora, "kernel", m


def _entry(kernels: LayerKernels, kind: str, layer: nn.Module):
    entry = getattr(kernels, kind)
    if entry is None or kind not in ("linear", "lora"):
        return entry
    return entry(layer)


def install_kernels(model: nn.Module, kernels: LayerKernels, clear: Iterable[str] = ()) -> Counter:
    """Give `model`'s layers `kernels`' entries; returns how many hooks of each kind were set. The hooks of
    the kinds in `clear` (names of `LayerKernels` fields) go back to None (torch's code) first; other
    hooks without an entry keep what they hold (Gaudi's FP8 checkpoint layers get theirs at quantization)."""
    clear = set(clear)
    unknown = clear - set(KINDS)
    if unknown:
        raise ValueError(f"no kernel kinds {sorted(unknown)}; the kinds are {KINDS}")
    given: Counter = Counter()
    for kind, holder, attribute, layer in list(_hooks(model)):
        kernel = _entry(kernels, kind, layer)
        if kernel is not None:
            setattr(holder, attribute, kernel)
            given[kind] += 1
        elif kind in clear:
            setattr(holder, attribute, None)
    if given:
        log.info("device kernels: %s", ", ".join(f"{n} {kind}" for kind, n in sorted(given.items())))
    return given


__all__ = ["CacheWriter", "KINDS", "LayerKernels", "LinearKernel", "LoraKernel", "NormKernel", "RotaryKernel",
           "install_kernels"]
