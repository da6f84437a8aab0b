"""The typed kernel seam: a device's `LayerKernels` reach the layers through `install_kernels` alone, and
the model then computes through them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.layers.embedding import ParallelLMHead
from gaudi_runtime.layers.kernels import KINDS, LayerKernels, install_kernels
from gaudi_runtime.layers.linear import LinearBase
from gaudi_runtime.layers.norm import RMSNorm
from gaudi_runtime.models.gemma import GemmaRMSNorm
from tests.unit.test_quant_config import tiny_llama


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    s = ids.shape[1]
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(1, s, dtype=torch.long))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(s)[None], None, meta)[0])


def test_every_linear_layer_and_norm_computes_through_the_installed_kernels():
    model = tiny_llama()
    ids = torch.tensor([[3, 7, 11, 5]])
    expected = logits(model, ids)
    seen: list[str] = []

    def linear_for(layer):
        weight = layer.weight

        def kernel(x, bias):
            seen.append("linear")
            return F.linear(x, weight, bias)
        return kernel

    def norm(x, residual, weight, eps):
        seen.append("norm")
        return None  # tensors it does not take: the layer's own code runs

    given = install_kernels(model, LayerKernels(linear=linear_for, norm=norm))
    linears = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    assert given == {"linear": len(linears), "norm": len(norms)}
    assert torch.equal(logits(model, ids), expected)
    assert seen.count("linear") == len(linears) and seen.count("norm") == len(norms)


def test_a_layer_without_an_entry_keeps_its_hook_and_clear_gives_back_torchs_code():
    model = tiny_llama()
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    own = object()
    install_kernels(model, LayerKernels(linear=lambda layer: own if layer is head else None))
    install_kernels(model, LayerKernels(linear=lambda layer: None, norm=lambda *a: None))
    assert head.kernel is own  # no entry for it: what it held stays (Gaudi's FP8 layers rely on it)
    install_kernels(model, LayerKernels(), clear=("linear", "norm"))
    assert head.kernel is None
    assert all(m.kernel is None for m in model.modules() if isinstance(m, RMSNorm))
    with pytest.raises(ValueError, match="no kernel kinds"):
        install_kernels(model, LayerKernels(), clear=("attention",))
    assert set(KINDS) == {"linear", "norm", "rotary", "cache_write", "lora", "experts"}


def test_a_norm_with_a_formula_of_its_own_keeps_it():
    gemma_norm, plain = GemmaRMSNorm(8), RMSNorm(8)
    holder = torch.nn.ModuleList([gemma_norm, plain])
    install_kernels(holder, LayerKernels(norm=lambda *a: None))
    assert gemma_norm.kernel is None and plain.kernel is not None
