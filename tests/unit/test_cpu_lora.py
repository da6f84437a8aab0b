"""LoRA adapters' products on a CPU through one C call per layer (device/cpu_lora.py): the same values as the
gathered bmm (layers/lora.py) for any mix of slots, fused layers' block-diagonal B, tails of every size and
both dtypes, as this CPU builds the kernel (bfloat16 on its dot product where it has avx512_bf16) and as a
CPU without avx512_bf16 builds it (widened to float32); the same bits on any thread count; what the kernel
does not take stays on the bmm; and a model whose LoRA layers use it gives what transformers + peft give."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.device import cpu_kernels, cpu_lora
from gaudi_runtime.layers.lora import AdapterRows, LoraWeights


@pytest.fixture(scope="module")
def kernel():
    k = cpu_lora.kernel()
    assert k is not None, "the LoRA kernel did not build here: is there a C compiler (cc or $CC)?"
    return k


@pytest.fixture(scope="module")
def widened_kernel(tmp_path_factory):
    """The kernel as a CPU without avx512_bf16 builds it (the same build here where the CPU lacks it)."""
    environ = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("kernels"))}
    return cpu_kernels.load(cpu_lora.SOURCE, "lora", cpu_lora.LoraKernel, environ, extra_flags=("-mno-avx512bf16",))


def test_bfloat16_runs_on_the_dot_product_where_the_cpu_has_it(kernel, widened_kernel):
    assert kernel.dot_bf16 == ("avx512_bf16" in open("/proc/cpuinfo").read())
    assert not widened_kernel.dot_bf16


def weights(slots: int, in_features: int, slices: list[tuple[int, int]], rank: int, dtype, seed: int = 0):
    """Random stacked A and B (slot 0 zeros), B nonzero only on each slice's block, as models/lora.py fills it."""
    g = torch.Generator().manual_seed(seed)
    out = sum(size for _, size in slices)
    k = len(slices) * rank
    a = torch.randn(slots, in_features, k, generator=g) / in_features ** 0.5
    b = torch.zeros(slots, k, out)
    for j, (offset, size) in enumerate(slices):
        b[:, j * rank:(j + 1) * rank, offset:offset + size] = torch.randn(slots, rank, size, generator=g)
    a[0], b[0] = 0, 0
    rows = AdapterRows()
    return LoraWeights(rows, a.to(dtype), b.to(dtype)), torch.tensor(slices, dtype=torch.int64)


CASES = [  # rows, seq, in, slices (offset, size), rank, slots of the rows
    (16, 1, 512, [(0, 512), (512, 256), (768, 256)], 16, [1, 2, 3, 4] * 4),  # a decode step, fused q/k/v
    (16, 1, 1536, [(0, 512)], 16, [0, 1, 0, 2, 2, 2, 2, 2, 3, 0, 1, 4, 4, 1, 3, 0]),  # down_proj, base rows
    (3, 7, 72, [(0, 40), (40, 40)], 5, [2, 0, 1]),  # a prefill, fused gate/up, every size a tail
    (2, 9, 20, [(0, 3)], 3, [1, 1]),  # fewer columns than a vector
    (3, 5, 37, [(0, 24), (24, 40)], 16, [1, 2, 1]),  # an odd input count: the dot product's last pair is half
    (4, 1, 64, [(0, 64)], 8, [0, 0, 0, 0]),  # no adapter row
]


def assert_within_bfloat16_roundings(got, want, x, lora: LoraWeights, index):
    """What bfloat16's arithmetic promises: products exact, sums in float32, x A rounded to bfloat16 where
    the dot product runs (as torch's bfloat16 bmm, and peft, round it), and y + delta rounded once. Each
    rounding is at most 2^-9 of its value (2^-8 here, room for the float32 sums), so an output may be off by
    2^-8 of itself plus 2^-8 of sum_r |x A|_r |B|_r, the size of what the rounded x A multiplies."""
    a, b = lora.a.double().index_select(0, index), lora.b.double().index_select(0, index)
    magnitude = torch.bmm(torch.bmm(x.double(), a).abs(), b.abs())
    bound = 2 ** -8 * (want.abs() + magnitude) + 1e-6
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"{int((error > bound).sum())} outputs off by up to {float(error.max()):.4f}"


@pytest.mark.parametrize("dtype,build", [(torch.float32, "native"), (torch.bfloat16, "native"),
                                         (torch.bfloat16, "widened")])
@pytest.mark.parametrize("rows,seq,in_features,slices,rank,slots", CASES)
def test_the_kernel_adds_what_the_gathered_bmm_adds(kernel, widened_kernel, dtype, build, rows, seq, in_features,
                                                    slices, rank, slots):
    kernel = widened_kernel if build == "widened" else kernel
    lora, spans = weights(5, in_features, slices, rank, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, seq, in_features, generator=g).to(dtype)
    y = torch.randn(rows, seq, int(spans[:, 1].sum()), generator=g).to(dtype)
    index = torch.tensor(slots)
    exact = LoraWeights(lora.rows, lora.a.double(), lora.b.double())  # the weights' values, in float64
    want = y.double() + exact.delta(x.double(), index)
    got = kernel.add(spans, lora, x, y.clone(), index)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        assert_within_bfloat16_roundings(got, want, x, lora, index)
    base = torch.tensor(slots) == 0
    assert torch.equal(got[base], y[base]), "a row of the base model must be left as it was"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bits_do_not_depend_on_the_thread_count(kernel, dtype):
    lora, spans = weights(5, 512, [(0, 1024), (1024, 1024)], 16, dtype)
    x = torch.randn(32, 4, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = torch.zeros(32, 4, 2048, dtype=dtype)
    index = torch.randint(0, 5, (32,), generator=torch.Generator().manual_seed(3))
    results, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(kernel.add(spans, lora, x, y.clone(), index))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_what_the_kernel_does_not_take_stays_on_the_bmm(kernel):
    lora, spans = weights(3, 32, [(0, 16)], 4, torch.float32)
    x, y, index = torch.randn(2, 1, 32), torch.zeros(2, 1, 16), torch.tensor([1, 2])
    assert kernel.add(spans, lora, x.double(), y.double(), index) is None  # a dtype it does not multiply
    strided = torch.zeros(2, 1, 32)[..., ::2]
    assert kernel.add(spans, lora, x, strided, index) is None  # an output it cannot add into in place
    assert kernel.add(spans, lora, x, y, index.int()) is None
    lora.kernel = lambda *args: kernel.add(spans, *args)
    lora.rows.index = index
    torch.testing.assert_close(lora.add(x, strided), lora.delta(x, index))  # the bmm's answer
    torch.testing.assert_close(lora.add(x, y.clone()), lora.delta(x, index))  # the kernel's
    with pytest.raises(IndexError, match="adapter slot"):
        kernel.add(spans, lora, x, y, torch.tensor([1, 3]))
