"""FP8 checkpoints on Gaudi: every float8 layer runs on Habana's FP8 matmul (`fp8_gemm_v2`, through the
recording fake), with per-channel weight scales inside the card's E4M3 range (Gaudi 2: 240, not 448)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.config import resolve
from gaudi_runtime.device import hpu
from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.models import load_model
from gaudi_runtime.quant.prequantized import is_fp8_checkpoint_layer
from gaudi_runtime.quant.setup import quantize_loaded
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.prequantized import reference_model, write_block_fp8, write_compressed_tensors_fp8


def logits(model, ids):
    s = ids.shape[1]
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(1, s, dtype=torch.long))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(s)[None], None, meta)[0])


def on_card(monkeypatch, bridge, card: str) -> None:
    """The recording fake as Gaudi `card`: its device type, and the float8 range it refuses beyond."""
    monkeypatch.setattr(hpu, "device_type", lambda: card)
    monkeypatch.setattr(bridge, "FP8_LIMIT", 240.0 if card == "GAUDI2" else 448.0)


def loaded_for_hpu(model_dir):
    """(prompt ids, the reference's logits for them, the checkpoint loaded as the HPU shard loads it)."""
    ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference_model(model_dir)(ids).logits[0]
    model = load_model(str(model_dir), torch.float32, "cpu")
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "DEVICE": "hpu", "NUM_SHARD": "1"})
    backend = hpu.HpuBackend(torch_device=torch.device("cpu"))
    return ids, expected, quantize_loaded(model, cfg, backend, torch.float32)


@pytest.mark.parametrize("card,fmt", [("GAUDI2", "block"), ("GAUDI2", "ct-static"), ("GAUDI3", "ct-channel")])
def test_fp8_checkpoint_runs_on_gaudi_fp8_matmuls(card, fmt, fake_hpu, monkeypatch, tmp_path):
    import habana_frameworks.torch as bridge

    on_card(monkeypatch, bridge, card)  # the card refuses more
    model_dir = make_tiny_model(tmp_path, "llama")
    if fmt == "block":
        write_block_fp8(model_dir)
    else:
        write_compressed_tensors_fp8(model_dir, "channel", static=fmt.endswith("static"))
    ids, expected, model = loaded_for_hpu(model_dir)
    layers = [m for m in model.modules() if is_fp8_checkpoint_layer(m)]
    got = logits(model, ids)
    assert "Gaudi FP8 matmuls" in model.quantization
    calls = fake_hpu["fp8_gemm_v2"]
    assert len(calls) == len(layers) == 2 * 4  # qkv, o, gate/up, down in each of 2 layers, one call each
    assert all(c["b_scale"] == (c["b"][0],) for c in calls)  # per-channel weight scales
    limit = 240.0 if card == "GAUDI2" else 448.0
    assert max(float(m.weight.float().abs().max()) for m in layers) <= limit
    # Activations are float8 on the card (the reference's are not): close, not equal.
    assert float(F.cosine_similarity(expected.flatten(), got.flatten(), dim=0)) >= 0.99


@pytest.mark.parametrize("card,family,block", [("GAUDI2", "qwen3_moe", (16, 16)), ("GAUDI3", "deepseek_v3", (16, 16)),
                                               ("GAUDI3", "qwen3_moe", (16, 32))])
def test_fp8_experts_run_on_gaudi_blockwise_moe(card, family, block, fake_hpu, monkeypatch, tmp_path):
    """Block-FP8 MoE checkpoints on Gaudi: the experts go to the fused MoE op's blockwise float8 variant as
    stored (square blocks; Gaudi 2's range taken into account), one call per MoE layer; blocks the op cannot
    take (not square) are dequantized at load for the plain op. The other layers run on FP8 matmuls."""
    import habana_frameworks.torch as bridge

    from gaudi_runtime.layers.moe import FusedMoE

    on_card(monkeypatch, bridge, card)
    model_dir = write_block_fp8(make_tiny_model(tmp_path, family), block)
    ids, expected, model = loaded_for_hpu(model_dir)
    torch_experts = logits(model, ids)  # the experts dequantized by torch, the rest as on the card
    hpu.HpuBackend(torch_device=torch.device("cpu")).prepare_model(model)  # Habana's fused MoE op
    fake_hpu["fp8_gemm_v2"].clear()
    got = logits(model, ids)
    moe_layers = sum(isinstance(m, FusedMoE) for m in model.modules())
    calls, plain = fake_hpu["mixture_of_experts_fp8"], fake_hpu["mixture_of_experts"]
    if block[0] == block[1]:
        assert len(calls) == moe_layers and not plain
        hidden, (out, cols) = model.config.hidden_size, calls[0]["w12"][1]
        assert calls[0]["w12"][0] == torch.float8_e4m3fn and calls[0]["block_size"] == block[0]
        assert calls[0]["d_scale_w12"] == (-(-out // block[0]), cols // block[1]) and cols == hidden
        assert calls[0]["experts"] == (0, model.model.layers[-1].mlp.num_experts - 1)
    else:
        assert not calls and len(plain) == moe_layers
    assert fake_hpu["fp8_gemm_v2"]  # attention (MLA's projections too) and dense MLPs on FP8 matmuls
    # The op computes what torch's dequantized experts compute (its output in bfloat16).
    assert float(F.cosine_similarity(torch_experts.flatten(), got.flatten(), dim=0)) >= 0.9999
    # Against transformers, the activations cast to float8 per tensor in every projection (MLA: five per
    # layer) make it close, not equal.
    assert float(F.cosine_similarity(expected.flatten(), got.flatten(), dim=0)) >= 0.95
