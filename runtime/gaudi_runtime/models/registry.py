"""Architecture registry and the safetensors loader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import progress
from ..download import WEIGHTS_INDEX, DownloadError, weight_files
from ..layers.linear import LazyWeight, TPContext
from .base import CausalLMBase
from .deepseek_v3 import DeepseekV3ForCausalLM
from .falcon import FalconForCausalLM
from .gemma import GemmaForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from .gpt_bigcode import GPTBigCodeForCausalLM
from .granite import GraniteForCausalLM
from .interface import CausalLM
from .llama import LlamaForCausalLM
from .llava_next import LlavaNextForConditionalGeneration
from .mixtral import MixtralForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM
from .starcoder2 import Starcoder2ForCausalLM

# config.json "architectures" entry -> model class (Mistral and Qwen2 are Llama config variations).
# Every class is built by ``base.CausalLMBase`` from ``config_class.from_dict(cfg, arch)`` and
# implements ``interface.CausalLM``.
SUPPORTED_ARCHITECTURES: dict[str, type[CausalLMBase]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # its text model only
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


class UnsupportedModelError(ValueError):
    """The model's architecture is not one we implement."""


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def resolve_architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"unsupported model architecture {', '.join(archs) or '(none in config.json)'} "
        f"(model_type {cfg.get('model_type')!r}); supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def eos_token_ids(model_dir: str | Path, cfg: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (union, in order)."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(cfg.get("eos_token_id"))
    return ids


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files to load, chosen by the same rule `gaudi-serve download` fetches by."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX
    indexed = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    try:
        names = weight_files([p.name for p in model_dir.iterdir()], indexed)
    except DownloadError as e:
        raise FileNotFoundError(f"{model_dir}: {e}") from None
    if not names:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return [model_dir / n for n in names]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, LazyWeight]]:
    """``(name, LazyWeight)`` for every tensor; a layer's loader reads only its rank's slice."""
    from safetensors import safe_open

    for i, f in enumerate(files):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                yield name, LazyWeight(sl, sl.get_shape())
                progress.report("loading", i, len(files))  # a step of the start: a tensor read
    progress.report("loading", len(files), len(files))


def override_rope(cfg: dict[str, Any], scaling: str, factor: float) -> dict[str, Any]:
    """config.json with its RoPE scaling replaced (--rope-scaling / --rope-factor), in the transformers 4
    layout every model family reads; the base frequency (rope_theta) is kept."""
    from ..layers.rotary import rope_params_from_config

    theta, _ = rope_params_from_config(cfg)
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict) and "rope_theta" in local:  # Gemma 3's local layers keep their base
        out.setdefault("rope_local_base_freq", local["rope_theta"])
    out["rope_theta"] = theta
    out["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
    return out


def prepare_quantized(model: CausalLMBase, cfg: dict[str, Any], files: list[Path]) -> str | None:
    """Ready the layers of a pre-quantized checkpoint (config.json's quantization_config) for its tensors;
    returns how it is stored (for /info), None when it is not quantized."""
    from ..quant.checkpoint import checkpoint_quant
    from ..quant.gptq import prepare_gptq
    from ..quant.prequantized import prepare_fp8_checkpoint

    found = checkpoint_quant(cfg)
    if found is None:
        return None
    if found.method in ("gptq", "awq"):
        prepare_gptq(model, found)
    else:
        prepare_fp8_checkpoint(model, found, files)
    return found.describe()


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1,
               process_group=None, rope: tuple[str, float] | None = None) -> CausalLM:
    """Build the model for ``model_dir`` and load this rank's weight shard from its safetensors files.

    ``rope`` = (scaling type, factor) overrides the model's RoPE scaling."""
    cfg_dict = read_config(model_dir)
    if rope is not None:
        cfg_dict = override_rope(cfg_dict, *rope)
    arch = resolve_architecture(cfg_dict)
    model_cls = SUPPORTED_ARCHITECTURES[arch]
    cfg = model_cls.config_class.from_dict(cfg_dict, arch)
    cfg.eos_token_ids = eos_token_ids(model_dir, cfg_dict)
    tp = TPContext(rank=tp_rank, size=tp_size, group=process_group)
    model = model_cls(cfg, tp, dtype, torch.device(device))
    files = safetensors_files(model_dir)
    model.quantization = prepare_quantized(model, cfg_dict, files)  # a pre-quantized checkpoint's layers
    with torch.no_grad():
        model.load_weights(iter_safetensors(files))
        if model.quantization:
            from ..quant.prequantized import finish_fp8_checkpoint

            finish_fp8_checkpoint(model)  # what a float8 checkpoint's compute reads dense (MLA's kv_b_proj)
    model.eval()
    model.requires_grad_(False)
    return model
