"""The C kernel multiplies activation rows by GPTQ's packed weights as the layer's own dequantizing path
does (4 and 8 bit, groups of 128 down to 8 columns and one per row, desc_act, asymmetric zeros, fused
projections, a packed row that ends in part of a vector, float32 and bfloat16 activations): up to
GEMM_ROWS rows reading only the packed words, more by dequantizing each segment in one pass. desc_act
layers have their columns sorted by group first; a layer whose packed words mix groups keeps its own
path."""

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


def fused_layer(bits: int, group: int, desc_act: bool, cols: int = 384):
    torch.manual_seed(0)
    return gptq_layer(MergedColumnParallelLinear(cols, [48, 80]), [torch.randn(48, cols), torch.randn(80, cols)],
                      bits, group, desc_act=desc_act)


@pytest.mark.parametrize("bits,group,desc_act,cols", [
    (4, 128, False, 384), (4, 32, False, 384), (8, 16, False, 384), (4, -1, False, 384), (4, 16, True, 384),
    (8, 64, True, 384), (4, 128, True, 384), (4, 40, False, 200), (8, 8, True, 200)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
def test_kernel_matches_the_layers_own_product(bits, group, desc_act, cols, rows):
    layer = fused_layer(bits, group, desc_act, cols)
    x = torch.randn(rows, cols)
    expected = layer.matmul(x, None)  # no kernel yet: dequantize, then F.linear
    dense = layer.matmul(torch.eye(cols), None).t()  # the weight [out, in], as loaded
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    if rows <= cpu_gptq.GEMM_ROWS or cols % 16 == 0:  # packed, or dequantized in C (rows of whole vectors)
        assert layer.kernel(x, None) is not None
    torch.testing.assert_close(layer.matmul(x, None), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.matmul(x, None), gptq_reference(x, dense), rtol=1e-4, atol=1e-4)


def rounds_weights(layer, x: torch.Tensor) -> bool:
    """Whether the kernel multiplies these bfloat16 rows by the weight rounded to bfloat16 (folded or
    dequantized), rather than by the exact one."""
    rows = x.numel() // x.shape[-1]
    low, high = cpu_gptq.FOLD_ROWS
    return rows > cpu_gptq.GEMM_ROWS or (low <= rows <= high and cpu_gptq.kernel().takes_folded(layer, x))


@pytest.mark.parametrize("bits,group,desc_act", [
    (4, 128, False), (4, 32, True), (8, 64, False), (4, -1, False), (4, 16, False)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13, 16, 17, 40, 48, 49])
def test_bfloat16_activations_give_the_float_product_rounded(bits, group, desc_act, rows):
    """bfloat16 rows (a served model's): a few rows' 4-bit weights go through the bfloat16 dot product
    where the CPU has one, others through float32, both the float32 product of the exact weights; from
    FOLD_ROWS on such a CPU, and past GEMM_ROWS everywhere, the rows multiply the weight dequantized to
    bfloat16, as the layer's own path does. Then rounded to bfloat16."""
    layer = fused_layer(bits, group, desc_act)
    dense = layer.matmul(torch.eye(384), None).t()
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    x = torch.randn(1, rows, 384).to(torch.bfloat16)
    got = layer.matmul(x, None)
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 128)
    weight = dense.bfloat16().float() if rounds_weights(layer, x) else dense
    torch.testing.assert_close(got.float(), gptq_reference(x.float(), weight), rtol=4e-3, atol=1e-3)  # bf16: 2^-8


def test_a_cpu_with_the_bfloat16_dot_product_folds_4_bit_weights_for_several_rows():
    layer = fused_layer(4, 128, False)
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    x = torch.randn(16, 384).to(torch.bfloat16)
    assert cpu_gptq.kernel().takes_folded(layer, x) == cpu_gptq.kernel().folds
    assert cpu_gptq.kernel().folds == ("avx512_bf16" in open("/proc/cpuinfo").read())


def test_the_rows_of_a_batch_do_not_depend_on_each_other():
    layer = fused_layer(4, 128, False)
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    x = torch.randn(16, 384)
    together = layer.matmul(x, None)
    for r in (0, 5, 15):
        torch.testing.assert_close(layer.matmul(x[r:r + 1], None)[0], together[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [128, 32])
def test_folded_rows_do_not_depend_on_the_rows_beside_them(group):
    """Any block of rows the folded path takes: each row's sums run in its own fixed order."""
    layer = fused_layer(4, group, False)
    assert cpu_gptq.use_gptq_kernel(layer) == 1
    x = torch.randn(47, 384).to(torch.bfloat16)
    together = layer.matmul(x, None)
    for rows in (slice(0, 5), slice(9, 22), slice(30, 47)):
        assert torch.equal(layer.matmul(x[rows], None), together[rows])


def test_packed_words_that_mix_groups_keep_the_layers_own_path():
    layer = fused_layer(4, 4, False)  # groups of 4 columns: two in every 8-value word
    x = torch.randn(2, 384)
    expected = layer.matmul(x, None)
    assert cpu_gptq.use_gptq_kernel(layer) == 0
    assert layer.kernel is None
    torch.testing.assert_close(layer.matmul(x, None), expected)
