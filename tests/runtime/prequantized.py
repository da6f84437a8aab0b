"""FP8 checkpoints in the exact on-disk formats their libraries publish, written from a tiny model.

- compressed-tensors (`llmcompressor`'s FP8 / FP8-dynamic schemes): every Linear but `lm_head` stored as
  ``weight`` (float8_e4m3fn) and ``weight_scale`` (float32, ``[1]`` per tensor or ``[out, 1]`` per channel),
  plus ``input_scale`` (``[1]``) for static activations; `config.json` gets the library's
  `quantization_config` (`format: float-quantized`, one config group targeting `Linear`).
- block FP8 (transformers' FineGrainedFP8, DeepSeek's layout): ``weight`` float8 and ``weight_scale_inv``
  ``[out / rows, in / cols]``, multiplied in: ``w = q * scale_inv`` block by block.

GPTQ (AutoGPTQ / gptqmodel `gptq` format) and AWQ (AutoAWQ GEMM) checkpoints likewise, round-to-nearest.

The references dequantize them with the libraries' own code (transformers with compressed-tensors
installed, or transformers' FineGrainedFP8 dequantization; gptqmodel for GPTQ and AWQ), never ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The projections every family here names its linear layers after (not the LM head: kept, as published).
LINEAR_SUFFIXES = ("_proj.weight", "kv_a_proj_with_mqa.weight", "query_key_value.weight", "dense.weight", "dense_h_to_4h.weight",
                   "dense_4h_to_h.weight", "c_attn.weight", "c_proj.weight", "c_fc.weight")


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(LINEAR_SUFFIXES) and "lm_head" not in name and "embed" not in name


def _per_channel(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True) if strategy == "channel" else wf.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` of the weight; the last row or column of blocks may be partial (DeepSeek's
    kv_a_proj_with_mqa: 576 rows in 128-row blocks), its scale then counted over the rows it has."""
    out, cols = w.shape
    r, c = block
    nr, nc = -(-out // r), -(-cols // c)
    padded = torch.zeros(nr * r, nc * c)
    padded[:out, :cols] = w.float()
    blocks = padded.reshape(nr, r, nc, c)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(nr * r, nc * c)[:out, :cols].contiguous(), scale


def _rewrite(model_dir: Path, quantize, quantization_config: dict) -> Path:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if not _quantizable(name, t):
            out[name] = t
            continue
        module = name[: -len(".weight")]
        out.update({f"{module}.{k}": v for k, v in quantize(module, t).items()})
    save_file(out, path, metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return model_dir


def write_compressed_tensors_fp8(model_dir: Path, strategy: str = "channel", static: bool = False) -> Path:
    """Rewrite a tiny model as llmcompressor's FP8 (`static`: static per-tensor activation scales) or
    FP8-dynamic scheme (dynamic per-token activations)."""
    def quantize(module: str, w: torch.Tensor) -> dict:
        q, scale = _per_channel(w, strategy)
        found = {"weight": q, "weight_scale": scale}
        if static:  # a calibrated input max-abs: any positive value is a valid checkpoint
            found["input_scale"] = torch.tensor([0.05 + 0.001 * (hash(module) % 7)], dtype=torch.float32)
        return found

    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
            if static else {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True})
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                        "symmetric": True, "dynamic": False, "group_size": None,
                                                        "observer": "minmax"}}}}
    return _rewrite(model_dir, quantize, config)


def write_block_fp8(model_dir: Path, block: tuple[int, int] = (16, 16)) -> Path:
    """Rewrite a tiny model as a block-scaled FP8 checkpoint (quant_method fp8, weight_block_size): every
    projection, MoE experts and MLA projections included; routers (``mlp.gate``, DeepSeek's
    ``e_score_correction_bias``), embeddings and the LM head stay as they are, as Qwen and DeepSeek publish."""
    def quantize(module: str, w: torch.Tensor) -> dict:
        q, scale = _per_block(w, block)
        return {"weight": q, "weight_scale_inv": scale}

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _rewrite(model_dir, quantize, config)


def reference_model(model_dir: Path):
    """transformers' own loading of the checkpoint (the library dequantizes), in float32."""
    import transformers

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    kwargs = {}
    if cfg["quantization_config"]["quant_method"] == "compressed-tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


# -- GPTQ (AutoGPTQ / GPTQModel `gptq` format) ---------------------------------------------------------


def gptq_quantize(w: torch.Tensor, bits: int, group: int, desc_act: bool, sym: bool, seed: int = 0) -> dict:
    """A GPTQ layer's tensors for weight `w` ``[out, in]``: round-to-nearest per group (what GPTQ stores;
    its error correction only changes which integers are stored). With `desc_act` the input rows are
    grouped in a random order, as act-order leaves them."""
    out, cols = w.shape
    group = cols if group == -1 else group
    maxq = (1 << bits) - 1
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[order] = (torch.arange(cols) // group).to(torch.int32)
    groups = cols // group
    wt = w.float().t()  # [in, out]
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int32)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            scales[g] = (rows.abs().amax(0) * 2 / maxq).clamp(min=1e-8)
            zeros[g] = (maxq + 1) // 2
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / maxq).clamp(min=1e-8)
            zeros[g] = torch.round(-lo / scales[g]).to(torch.int32)
    scales = scales.half()
    q = torch.clamp(torch.round(wt / scales[g_idx].float()) + zeros[g_idx], 0, maxq).to(torch.int32)
    return {"q": q, "zeros": zeros, "qweight": pack_rows(q, bits),
            "qzeros": gptq_v1_zeros(pack_rows(zeros.t(), bits).t(), bits), "scales": scales, "g_idx": g_idx}


def gptq_v1_zeros(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed zeros as the `gptq` (v1) format stores them: each word minus one in every field, borrows
    included (gptqmodel's conversion to the format it saves)."""
    ones = sum(1 << k for k in range(0, 32, bits))
    word = (packed.to(torch.int64) - ones) & 0xFFFFFFFF
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[n, m]`` small ints -> int32 ``[n * bits / 32, m]``: 32 / bits consecutive rows per word, lowest first."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(-1, per, values.shape[1])
    word = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64)
    for k in range(per):
        word |= (v[:, k] & ((1 << bits) - 1)) << (bits * k)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, as int32


def write_gptq(model_dir: Path, bits: int = 4, group: int = 16, desc_act: bool = False, sym: bool = True) -> Path:
    """Rewrite a tiny model as a GPTQ checkpoint (AutoGPTQ's v1 layout: zero points stored minus one)."""
    seeds = iter(range(10_000))

    def quantize(module: str, w: torch.Tensor) -> dict:
        t = gptq_quantize(w, bits, group, desc_act, sym, seed=next(seeds))
        return {k: t[k] for k in ("qweight", "qzeros", "scales", "g_idx")}

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    return _rewrite(model_dir, quantize, config)


# -- AWQ (AutoAWQ's GEMM format) -------------------------------------------------------------------------

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word holds output column ORDER[i]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[n, out]`` 4-bit values -> int32 ``[n, out / 8]`` as AutoAWQ's WQLinear_GEMM packs them."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        word |= (v[:, :, col] & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def write_awq(model_dir: Path, group: int = 16) -> Path:
    """Rewrite a tiny model as an AutoAWQ GEMM checkpoint (4 bit, zero points)."""
    def quantize(module: str, w: torch.Tensor) -> dict:
        t = gptq_quantize(w, 4, group, desc_act=False, sym=False)
        return {"qweight": pack_awq(t["q"]), "qzeros": pack_awq(t["zeros"]), "scales": t["scales"]}

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    return _rewrite(model_dir, quantize, config)


def gptqmodel_dense_copies(pairs: list[tuple[Path, Path]], timeout: float = 600) -> None:
    """For each (quantized dir, out dir): `out` is the checkpoint dequantized by `gptqmodel`, dense, for
    transformers to run as the reference (tests/runtime/gptqmodel_reference.py; one process for all)."""
    import subprocess
    import sys

    args = [str(p) for pair in pairs for p in pair]
    subprocess.run([sys.executable, "-m", "tests.runtime.gptqmodel_reference", *args], check=True, timeout=timeout,
                   cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL)
