"""FP8 checkpoints in the exact on-disk formats their libraries publish, written from a tiny model.

- compressed-tensors (`llmcompressor`'s FP8 / FP8-dynamic schemes): every Linear but `lm_head` stored as
  ``weight`` (float8_e4m3fn) and ``weight_scale`` (float32, ``[1]`` per tensor or ``[out, 1]`` per channel),
  plus ``input_scale`` (``[1]``) for static activations; `config.json` gets the library's
  `quantization_config` (`format: float-quantized`, one config group targeting `Linear`).
- block FP8 (transformers' FineGrainedFP8, DeepSeek's layout): ``weight`` float8 and ``weight_scale_inv``
  ``[out / rows, in / cols]``, multiplied in: ``w = q * scale_inv`` block by block.

The references dequantize them with the libraries' own code (transformers with compressed-tensors
installed, or transformers' FineGrainedFP8 dequantization), never ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The projections every family here names its linear layers after (not the LM head: kept, as published).
LINEAR_SUFFIXES = ("_proj.weight", "query_key_value.weight", "dense.weight", "dense_h_to_4h.weight",
                   "dense_4h_to_h.weight", "c_attn.weight", "c_proj.weight", "c_fc.weight")


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(LINEAR_SUFFIXES) and "lm_head" not in name and "embed" not in name


def _per_channel(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True) if strategy == "channel" else wf.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out, cols = w.shape
    r, c = block
    blocks = w.float().reshape(out // r, r, cols // c, c)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(out, cols), scale


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
    """Rewrite a tiny model as a block-scaled FP8 checkpoint (quant_method fp8, weight_block_size)."""
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
