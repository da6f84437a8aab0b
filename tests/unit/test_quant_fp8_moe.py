"""Block-FP8 MoE and MLA checkpoints load as stored (quant/fp8_moe.py), checked against the checkpoint's own
numbers: each expert's float8 weight times its block scale, and DeepSeek-V3's kv_b_proj dense in the model
dtype. Served greedy parity with transformers is in tests/runtime/test_prequantized_fp8.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from gaudi_runtime.config import ConfigError
from gaudi_runtime.models import load_model
from gaudi_runtime.quant.fp8_moe import Fp8ExpertWeights
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.prequantized import write_block_fp8


def stored(tensors: dict, module: str, block: tuple[int, int]) -> torch.Tensor:
    """The checkpoint's weight by the format's definition: float8 times the scale of its (possibly partial) block."""
    q, s = tensors[f"{module}.weight"].float(), tensors[f"{module}.weight_scale_inv"]
    return q * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    block = (32, 16)  # kv_a_proj_with_mqa's 48 rows end in a partial block, as DeepSeek's 576 do in 128
    d = write_block_fp8(make_tiny_model(tmp_path_factory.mktemp("ds"), "deepseek_v3"), block)
    tensors = load_file(d / "model.safetensors")
    # DeepSeek ships a multi-token-prediction layer after the last decoder layer, float8 too: not loaded.
    extra = {f"model.layers.3.self_attn.o_proj.{k}": tensors[f"model.layers.2.self_attn.o_proj.{k}"].clone()
             for k in ("weight", "weight_scale_inv")}
    save_file({**tensors, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    return d, tensors, block


@pytest.mark.parametrize("rank", [0, 1])
def test_experts_and_kv_b_proj_load_as_stored(deepseek, rank):
    d, tensors, block = deepseek
    model = load_model(str(d), torch.float32, "cpu", tp_rank=rank, tp_size=2)
    layer = model.model.layers[1]
    w13, w2 = layer.mlp.w13, layer.mlp.w2
    assert isinstance(w13, Fp8ExpertWeights) and w13.weight.dtype == torch.float8_e4m3fn
    inter = w2.weight.shape[2]  # this rank's slice of each expert
    for e in (0, 5):
        gate, up, down = (stored(tensors, f"model.layers.1.mlp.experts.{e}.{p}_proj", block)
                          for p in ("gate", "up", "down"))
        rows = slice(rank * inter, (rank + 1) * inter)
        want13 = torch.cat([gate[rows], up[rows]])
        assert torch.equal(w13.experts(torch.float32)[e], want13)
        assert torch.equal(w2.experts(torch.float32)[torch.tensor([e])][0], down[:, rows])
    kv_b = layer.self_attn.kv_b_proj.weight
    full = stored(tensors, "model.layers.1.self_attn.kv_b_proj", block)
    n = kv_b.shape[0]
    assert kv_b.dtype == torch.float32 and torch.equal(kv_b, full[rank * n:(rank + 1) * n])
    assert layer.mlp.gate.weight.dtype == torch.float32  # the router as stored, unquantized


def test_expert_columns_across_a_block_stop_the_load(tmp_path):
    """A rank's expert slice must hold whole blocks of columns: a one-line error naming the layer."""
    d = write_block_fp8(make_tiny_model(tmp_path, "qwen3_moe"), (16, 32))  # 16 columns of down_proj per rank
    with pytest.raises(ConfigError, match=r"layer model\.layers\.1\.mlp\.w2: 16 input columns per rank"):
        load_model(str(d), torch.float32, "cpu", tp_rank=0, tp_size=2)
