"""Linear layers on a CPU: over oneDNN-reordered weights and, for one row, through the C kernel, they give
F.linear's logits (the same bits in bf16; float32 rounding apart in float32); a few bf16 rows through the
C kernel give oneDNN's tokens."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_gemm, cpu_gemv
from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.layers.linear import ReplicatedLinear
from gaudi_runtime.models.registry import load_model
from gaudi_runtime.quant.fp8_linear import is_fp8, to_fp8
from gaudi_runtime.tools.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="this CPU's oneDNN has no bf16 kernels")


@pytest.fixture(scope="module", params=["llama", "qwen2", "falcon"])  # untied head; tied head; row_partial
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def prompt_logits(model, rows: int = 2, length: int = 12) -> torch.Tensor:
    """Logits of `rows` prompts of `length` tokens. With `rows=0` (one prompt of one token) every product
    is one row; with `length=1` every product has `rows` rows, as in a decode batch."""
    length = length if rows else 1
    rows = rows or 1
    kv = allocate_kv_cache(model.num_layers, rows + 2, 16, model.num_kv_heads, model.head_dim, model.dtype,
                           torch.device("cpu"))
    ids = torch.arange(3, 3 + rows * length).view(rows, length)
    pos = torch.arange(length).expand(rows, length)
    slots = (torch.arange(length) + 16 * torch.arange(1, rows + 1).view(rows, 1))
    with torch.inference_mode():
        hidden = model(ids, pos, kv, AttentionMetadata(is_prefill=True, slots=slots))
        return model.compute_logits(hidden)


def counted_gemv(monkeypatch) -> list[tuple[int, int]]:
    """The (out, in) of every product the C kernel runs from here on."""
    calls = []
    k = cpu_gemv.kernel()
    assert k is not None, "the few-row kernel did not build here: is there a C compiler (cc or $CC)?"
    real = type(k).multiply
    monkeypatch.setattr(type(k), "multiply",
                        lambda self, x, rows, w, b: calls.append(tuple(w.shape)) or real(self, x, rows, w, b))
    return calls


def test_reordered_weights_give_the_same_logits_and_free_the_originals(model_dir):
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    before = prompt_logits(model)
    head_shared = model.lm_head.weight.data_ptr() in {p.data_ptr() for n, p in model.named_parameters()
                                                       if not n.startswith("lm_head")}

    assert cpu_gemm.prepack_linears(model, few_rows=False) > 0
    after = prompt_logits(model)

    torch.testing.assert_close(after, before, rtol=0, atol=0)
    released = [m for m in model.modules() if getattr(m, "kernel", None) is not None and m.weight.numel() == 0]
    assert released, "no layer gave its plain weight back"
    # A head tied to the embedding keeps the table the embedding still reads.
    assert (model.lm_head.weight.numel() > 0) == head_shared


def test_float32_layers_are_reordered_too(model_dir):
    """F.linear's float32 path is MKL's sgemm; oneDNN over reordered weights gives the same logits but
    for the order of float32 sums."""
    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    before = prompt_logits(model)
    assert cpu_gemm.prepack_linears(model, few_rows=False) > 0
    torch.testing.assert_close(prompt_logits(model), before, rtol=1e-5, atol=1e-5)


def test_fp8_layers_keep_their_own_kernels(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    down = model.model.layers[0].mlp.down_proj
    to_fp8(down, torch.bfloat16)
    cpu_gemm.prepack_linears(model)
    assert is_fp8(down) and down.kernel is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_row_products_run_through_the_c_kernel_with_the_same_logits(model_dir, dtype, monkeypatch):
    """Batch-1 decode (one row) goes through the C kernel over the kept plain weights; a batch of rows
    still goes through oneDNN, as it does without the kernel."""
    model = load_model(str(model_dir), dtype, torch.device("cpu"))
    one_before = prompt_logits(model, rows=0)
    layers = [m for m in model.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2
              and hasattr(m, "kernel")]

    cpu_gemm.prepack_linears(model, release=False, few_rows=False)
    many_onednn = prompt_logits(model)
    cpu_gemm.prepack_linears(model)
    calls = counted_gemv(monkeypatch)
    many_after = prompt_logits(model)
    assert calls == []
    torch.testing.assert_close(many_after, many_onednn, rtol=0, atol=0)
    one_after = prompt_logits(model, rows=0)

    assert len(calls) == len(layers), "a layer's one-row product did not go through the kernel"
    assert all(m.weight.numel() > 0 for m in layers)  # the kernel reads the plain weights
    if dtype == torch.bfloat16:  # float32 sums in another order: the bf16 roundings of the logits agree here
        torch.testing.assert_close(one_after, one_before, rtol=0, atol=0)
    else:
        torch.testing.assert_close(one_after, one_before, rtol=1e-5, atol=1e-5)


def test_a_small_bf16_decode_batch_runs_through_the_c_kernel_with_the_same_tokens(model_dir, monkeypatch):
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    layers = [m for m in model.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2
              and hasattr(m, "kernel")]
    cpu_gemm.prepack_linears(model, release=False, few_rows=False)
    onednn = prompt_logits(model, rows=4, length=1)
    cpu_gemm.prepack_linears(model)
    calls = counted_gemv(monkeypatch)
    after = prompt_logits(model, rows=4, length=1)
    assert len(calls) == len(layers), "a layer's four-row product did not go through the kernel"
    assert torch.equal(after.argmax(-1), onednn.argmax(-1))
    torch.testing.assert_close(after, onednn, rtol=2 ** -6, atol=2 ** -6)


def test_several_bfloat16_rows_of_wide_inputs_are_left_to_onednn_where_the_cpu_has_the_dot_product():
    """There oneDNN multiplies them faster (``BF16_DOT_X_VALUES``); one row, narrow inputs, float32 rows
    and a kernel that widens bfloat16 stay on the kernel."""
    kernel = cpu_gemv.kernel()
    assert kernel.bf16_dot == ("avx512_bf16" in open("/proc/cpuinfo").read())
    first = functools.partial(cpu_gemm.kernel_first, kernel)
    assert first(1, torch.bfloat16, 14336) and first(2, torch.bfloat16, 4096)
    assert first(8, torch.bfloat16, 512) and first(8, torch.float32, 4096)
    assert first(3, torch.bfloat16, 4096) == (not kernel.bf16_dot)
    assert first(6, torch.bfloat16, 1536) == (not kernel.bf16_dot)


def test_a_wide_bf16_layer_leaves_several_rows_to_onednn_where_the_cpu_has_the_dot_product(monkeypatch):
    """Six rows of 1,536 inputs: oneDNN's product where the kernel would run on the bfloat16 dot
    product (``cpu_gemm.BF16_DOT_X_VALUES``), the kernel elsewhere; the same values either way."""
    layer = ReplicatedLinear(1536, 64, bias=False).to(torch.bfloat16)
    layer.weight.data.normal_()
    cpu_gemm.prepack_linears(layer)
    calls = counted_gemv(monkeypatch)
    x = torch.randn(6, 1536).bfloat16()
    got = layer.kernel(x, None)
    assert len(calls) == (0 if cpu_gemv.kernel().bf16_dot else 1)
    torch.testing.assert_close(got.float(), F.linear(x, layer.weight).float(), rtol=2 ** -7, atol=1e-2)
    one_row = counted_gemv(monkeypatch)
    layer.kernel(x[:1], None)
    assert one_row == [(64, 1536)]


def test_switched_off_every_product_stays_on_onednn(model_dir, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "kernel", lambda: pytest.fail("built although switched off"))
    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    assert cpu_gemm.prepack_linears(model, few_rows=False) > 0
    assert all(m.kernel.func is cpu_gemm._packed_linear for m in model.modules() if getattr(m, "kernel", None))


def test_a_row_of_another_dtype_is_refused_not_misread(model_dir):
    """A float32 row into a bf16 layer is refused (oneDNN where bf16 is native) or multiplied as float32 by
    the bf16 weights (oneDNN where it is emulated): never read as bf16 bits."""
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    reference_weight = model.lm_head.weight.detach().float().clone()
    cpu_gemm.prepack_linears(model)
    head = model.lm_head
    row = torch.randn(1, reference_weight.shape[1])
    try:
        out = head.kernel(row, None)
    except RuntimeError:
        return
    torch.testing.assert_close(out.float(), row @ reference_weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,length", [(1, 30), (3, 1), (24, 1)])
def test_the_logits_do_not_depend_on_the_thread_count(model_dir, rows, length):
    # A CPU shard changes its thread count with the machine's load (device/cpu_threads.py): the answer
    # must not change with it.
    if torch.get_num_threads() < 2:
        pytest.skip("one core: there is no other thread count")
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    cpu_gemm.prepack_linears(model)
    most = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prompt_logits(model, rows=rows, length=length)
    finally:
        torch.set_num_threads(most)
    assert torch.equal(prompt_logits(model, rows=rows, length=length), one)
