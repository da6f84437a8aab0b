"""The few-row product kernel (``cpu_gemv.c``) gives F.linear's answer for every shape a layer has (rows
that are not a whole number of vectors, a handful of outputs, a bias), whatever the thread count: one row in
bf16 and float32, two to eight float32 rows, two to eight bf16 rows (through the CPU's bf16 dot product where
it has avx512_bf16, and widened, as a CPU without it runs them); without a C compiler, layers keep oneDNN's
path after one warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_gemm, cpu_gemv, cpu_kernels
from gaudi_runtime.models.registry import load_model
from gaudi_runtime.tools.tiny_model import make_tiny_model

SHAPES = [(3072, 512), (512, 1536), (7, 5), (33, 70), (1, 64), (130, 96), (17, 32), (8, 2048)]


@pytest.fixture(scope="module")
def kernel():
    k = cpu_gemv.kernel()
    if k is None:
        pytest.fail("the kernel did not build here: is there a C compiler (cc or $CC)?")
    return k


@pytest.fixture(scope="module")
def widened_kernel(tmp_path_factory):
    """The kernel as a CPU without avx512_bf16 builds it (the same build here where the CPU lacks it)."""
    environ = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("kernels"))}
    return cpu_kernels.load(cpu_gemv.SOURCE, "gemv", cpu_gemv.GemvKernel, environ, extra_flags=("-mno-avx512bf16",))


@pytest.fixture
def no_kernel_yet(monkeypatch, tmp_path):
    """Nothing loaded yet, and no prebuilt library to load (``gaudi-serve build-kernels``): compiled here."""
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "no-prebuilt")
    monkeypatch.delenv(cpu_kernels.KERNELS_ENV, raising=False)
    cpu_gemv.kernel.cache_clear()
    yield
    cpu_gemv.kernel.cache_clear()


def operands(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    return torch.randn(1, in_features, generator=gen).to(dtype), w, torch.randn(out_features, generator=gen).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_a_float64_reference_and_f_linear(kernel, shape, with_bias, dtype):
    x, w, b = operands(*shape, dtype)
    b = b if with_bias else None
    got = kernel(x, w, b)
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (1, shape[0]) and got.dtype == dtype
    if dtype == torch.bfloat16:  # float32 sums, one rounding to bf16: at most one bf16 step off
        torch.testing.assert_close(got.double(), reference, rtol=2 ** -7, atol=1e-6)
        assert (got != F.linear(x, w, b)).float().mean() < 0.01
    else:
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-6)


def test_takes_two_to_eight_rows_of_either_dtype(kernel):
    assert all(kernel.takes_rows(n, dtype) for n in range(1, 9) for dtype in (torch.bfloat16, torch.float32))
    assert not kernel.takes_rows(9, torch.bfloat16) and not kernel.takes_rows(9, torch.float32)
    _, w, _ = operands(8, 64, torch.float32)
    with pytest.raises(ValueError, match="9 rows of torch.float32"):
        kernel(torch.randn(9, 64), w, None)
    with pytest.raises(ValueError, match="9 rows"):
        kernel(torch.randn(9, 64).bfloat16(), w.bfloat16(), None)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [2, 3, 8])
@pytest.mark.parametrize("dtype,build", [(torch.float32, "native"), (torch.bfloat16, "native"),
                                         (torch.bfloat16, "widened")])
def test_several_rows_match_a_float64_reference_and_f_linear(kernel, widened_kernel, shape, rows, dtype, build):
    kernel = widened_kernel if build == "widened" else kernel
    _, w, b = operands(*shape, dtype)
    x = torch.randn(rows, 1, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = kernel(x, w, b)
    assert got.shape == (rows, 1, shape[0]) and got.dtype == dtype
    reference = F.linear(x.double(), w.double(), b.double())
    if dtype == torch.bfloat16:  # float32 sums, one rounding to bf16: at most one bf16 step off
        torch.testing.assert_close(got.double(), reference, rtol=2 ** -7, atol=1e-6)
        assert (got != F.linear(x, w, b)).float().mean() < 0.01
    else:
        torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-6)
    # a row's answer does not depend on the rows beside it, nor on the thread count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x[:2], w, b), got[:2])
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_of_one_are_kept(kernel):
    x, w, b = operands(40, 64, torch.float32)
    assert kernel(x.view(1, 1, 64), w, b).shape == (1, 1, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_answer_does_not_depend_on_the_thread_count(kernel, dtype):
    x, w, b = operands(4096, 1024, dtype, seed=3)
    threads = torch.get_num_threads()
    try:
        answers = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            answers.append(kernel(x, w, b))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, answers[0]) for a in answers)


def test_takes_only_what_it_can_read_in_place():
    w = torch.zeros(8, 16)
    assert cpu_gemv.takes(w, None) and cpu_gemv.takes(w.bfloat16(), torch.zeros(8).bfloat16())
    assert not cpu_gemv.takes(w.t(), None)  # not contiguous
    assert not cpu_gemv.takes(w.half(), None)
    assert not cpu_gemv.takes(w, torch.zeros(8).bfloat16())  # bias of another dtype
    assert not cpu_gemv.takes(w.new_empty(0, 16), None)  # a released weight


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["no-compiler", "compile-fails"])
def test_without_a_compiler_layers_keep_onednns_path_after_one_warning(no_kernel_yet, monkeypatch, tmp_path,
                                                                       caplog, cc):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = load_model(str(make_tiny_model(tmp_path / "llama", "llama")), torch.float32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
        for _ in range(2):  # the kernel is looked for once per process
            cpu_gemm.prepack_linears(model)
    warnings = [r.getMessage() for r in caplog.records if "no few-row product kernel" in r.getMessage()]
    assert len(warnings) == 1 and "small decode batches multiply as larger ones do" in warnings[0]
    assert all(m.kernel.func is cpu_gemm._packed_linear for m in model.modules() if getattr(m, "kernel", None))
    assert list(tmp_path.rglob("*.so")) == []
