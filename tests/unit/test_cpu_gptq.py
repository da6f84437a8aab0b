"""The C kernel multiplies activation rows by GPTQ's packed weights as the layer's own dequantizing path
does (4 and 8 bit, groups incl. one per row, desc_act, asymmetric zeros, fused projections, rows 1..8),
reading only the packed words; desc_act layers have their columns sorted by group first, and the layer's
own path (more rows) still gives the same product."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.device import cpu_gptq
from gaudi_runtime.layers.linear import MergedColumnParallelLinear
from gaudi_runtime.quant.checkpoint import CheckpointQuant
from gaudi_runtime.quant.gptq import to_gptq
from tests.runtime.prequantized import gptq_quantize


def gptq_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


def gptq_layer(layer, weights: list[torch.Tensor], bits: int, group: int, desc_act: bool):
    found = CheckpointQuant("gptq", f"int{bits}", "group", group_size=group, desc_act=desc_act, sym=False)
    to_gptq("layer", layer, found, weights[0].shape[1])
    for shard, w in enumerate(weights):
        t = gptq_quantize(w, bits, group, desc_act, sym=False, seed=shard)
        extra = (shard,) if len(weights) > 1 else ()
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            p = getattr(layer, name)
            p.weight_loader(p, t[name], *extra)
    return layer


@pytest.mark.parametrize("bits,group,desc_act", [(4, 32, False), (8, 16, False), (4, -1, False), (4, 16, True),
                                                 (8, 64, True)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_matches_the_layers_own_product(bits, group, desc_act, rows):
    torch.manual_seed(0)
    layer = gptq_layer(MergedColumnParallelLinear(128, [48, 80]), [torch.randn(48, 128), torch.randn(80, 128)],
                       bits, group, desc_act=desc_act)
    x = torch.randn(rows, 128)
    expected = layer.matmul(x, None)  # no kernel yet: dequantize, then F.linear
    layer_before = layer.matmul(torch.eye(128), None).t()  # the dense weight [out, in], as loaded
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    got = layer.matmul(x, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert layer.kernel(torch.randn(9, 128), None) is None  # more rows: the layer's own path
    x9 = torch.randn(9, 128)  # ... which still computes the same product over the sorted columns
    torch.testing.assert_close(layer.matmul(x9, None), gptq_reference(x9, layer_before), rtol=1e-4, atol=1e-4)
