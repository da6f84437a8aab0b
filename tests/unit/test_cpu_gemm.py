"""bf16 linear layers over oneDNN-reordered weights give the same logits as F.linear."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.device import cpu_gemm
from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.models.registry import load_model
from gaudi_runtime.quant.fp8_linear import is_fp8, to_fp8
from gaudi_runtime.tools.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="this CPU's oneDNN has no bf16 kernels")


@pytest.fixture(scope="module", params=["llama", "qwen2", "falcon"])  # untied head; tied head; row_partial
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def prompt_logits(model) -> torch.Tensor:
    kv = allocate_kv_cache(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, torch.bfloat16,
                           torch.device("cpu"))
    ids = torch.arange(3, 27).view(2, 12)
    pos = torch.arange(12).expand(2, 12)
    slots = torch.cat([torch.arange(16, 28), torch.arange(32, 44)]).view(2, 12)
    with torch.inference_mode():
        hidden = model(ids, pos, kv, AttentionMetadata(is_prefill=True, slots=slots))
        return model.compute_logits(hidden)


def test_reordered_weights_give_the_same_logits_and_free_the_originals(model_dir):
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    before = prompt_logits(model)
    head_shared = model.lm_head.weight.data_ptr() in {p.data_ptr() for n, p in model.named_parameters()
                                                       if not n.startswith("lm_head")}

    assert cpu_gemm.prepack_linears(model) > 0
    after = prompt_logits(model)

    torch.testing.assert_close(after, before, rtol=0, atol=0)
    released = [m for m in model.modules() if getattr(m, "kernel", None) is not None and m.weight.numel() == 0]
    assert released, "no layer gave its plain weight back"
    # A head tied to the embedding keeps the table the embedding still reads.
    assert (model.lm_head.weight.numel() > 0) == head_shared


def test_float32_and_fp8_layers_keep_their_own_kernels(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    model = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    assert cpu_gemm.prepack_linears(model) == 0

    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    down = model.model.layers[0].mlp.down_proj
    to_fp8(down, torch.bfloat16)
    cpu_gemm.prepack_linears(model)
    assert is_fp8(down) and down.kernel is None
