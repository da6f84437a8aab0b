"""The few-row product kernel as a torch operator: the values of F.linear, in the kernel where it takes the
rows; a traced graph (make_fx) holds it as one operator; torch.compile(fullgraph=True) compiles a function
that calls it without a graph break, and the compiled function gives the eager values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from gaudi_runtime.device import cpu_gemv, cpu_ops

OP = torch.ops.gaudi_serve.few_row_linear


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if cpu_gemv.kernel() is None:
        pytest.fail("the few-row kernel did not load here: no prebuilt library and no C compiler (cc or $CC)?")


def operands(rows: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    return x, w, torch.randn(80, generator=gen).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 64], ids=["one-row", "few-rows", "many-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_operator_gives_f_linears_values(rows, dtype):
    x, w, b = operands(rows, dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(OP(x, w, b).float(), F.linear(x.double(), w.double(), b.double()).float(), **tol)
    torch.testing.assert_close(OP(x, w, None), cpu_ops.few_row_linear(x, w, None))


def test_a_traced_graph_holds_the_kernel_as_one_operator():
    x, w, b = operands(1, torch.float32)
    graph = make_fx(lambda x, w, b: torch.relu(OP(x, w, b)))(x, w, b)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "gaudi_serve.few_row_linear.default" in targets
    assert not any("linear" in t or "addmm" in t or "mm." in t for t in targets if "gaudi_serve" not in t)
    torch.testing.assert_close(graph(x, w, b), torch.relu(OP(x, w, b)))


def test_torch_compile_takes_it_without_a_graph_break():
    x, w, b = operands(2, torch.float32)

    def layer(x, w, b):
        return torch.nn.functional.silu(OP(x, w, b)) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    torch.testing.assert_close(compiled(x, w, b), layer(x, w, b))
