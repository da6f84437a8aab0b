"""Pre-quantized checkpoints: `config.json`'s `quantization_config` read into one typed description.

Torch-free, so the launcher checks a model before it spawns anything. What is read (docs/quantization.md):

- `quant_method: "compressed-tensors"` with one FP8 weight scheme (`float-quantized`: 8-bit float weights,
  per-tensor, per-channel or block scales; activations dynamic per token / per tensor or static per tensor);
- `quant_method: "fp8"` (transformers' FineGrainedFP8, as DeepSeek publishes): E4M3 weights with
  `weight_scale_inv` per `weight_block_size` block;
- `quant_method: "gptq"` (4 or 8 bit) / `"awq"` (4-bit GEMM): packed integer weights (`quant/gptq.py`).

Anything else (another method, bit width, strategy or option) is a `ConfigError` naming the field.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi_runtime.config import ConfigError

# Which --quantize names a checkpoint's format answers to.
FLAG_MATCHES = {"compressed-tensors": ("compressed-tensors", "fp8"), "fp8": ("fp8",), "gptq": ("gptq",),
                "awq": ("awq",)}
PACKED_TENSORS = {"gptq": ("qzeros", "scales", "g_idx"), "awq": ("qzeros", "scales")}
SCALE_NAMES = ("weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's linear weights are stored."""

    method: str  # quant_method as written: compressed-tensors, fp8, gptq, awq
    weights: str  # "fp8" or "int4" / "int8"
    scales: str = ""  # fp8: tensor, channel or block; gptq/awq: group
    block: tuple[int, int] | None = None  # fp8 block scales: (rows, columns) of weights per scale
    activations: str = "none"  # dynamic-token, dynamic-tensor, static-tensor, or none (weight-only)
    group_size: int = 0  # gptq/awq: columns per scale; -1 one group per row
    desc_act: bool = False
    sym: bool = True
    ignore: tuple[str, ...] = ()  # checkpoint module names (or "re:" patterns) kept unquantized

    def describe(self) -> str:
        """What /info and the start-up log say, e.g. ``compressed-tensors fp8 (per-channel weight scales, ...)``."""
        if self.weights == "fp8":
            scales = f"{self.block[0]}x{self.block[1]} block" if self.block else f"per-{self.scales}"
            acts = {"none": "weight-only", "dynamic-token": "dynamic per-token activations",
                    "dynamic-tensor": "dynamic per-tensor activations",
                    "static-tensor": "static activation scales"}[self.activations]
            name = "compressed-tensors FP8" if self.method == "compressed-tensors" else "block FP8 (quant_method fp8)"
            return f"{name} e4m3: {scales} weight scales, {acts}"
        group = "per-row" if self.group_size == -1 else f"group {self.group_size}"
        extra = (", desc_act" if self.desc_act else "") + ("" if self.sym else ", asymmetric")
        return f"{self.method} {self.weights} ({group}{extra})"

    def ignored(self, module: str) -> bool:
        """Whether checkpoint module `module` stays unquantized (`ignore` names, exact or ``re:`` patterns)."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif pattern == module or module.endswith("." + pattern):
                return True
        return False


def _err(field: str, problem: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config.{field}: {problem}")


def parse_quantization(qc: dict[str, Any]) -> CheckpointQuant:
    method = qc.get("quant_method")
    parsers = {"compressed-tensors": _compressed_tensors, "fp8": _block_fp8, "gptq": _gptq, "awq": _awq}
    if method not in parsers:
        raise _err("quant_method", f"{method!r} is not a format gaudi-serve reads (it reads: {', '.join(parsers)})")
    return parsers[method](qc)


def _fp8_weights(w: dict[str, Any], field: str) -> tuple[str, tuple[int, int] | None]:
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise _err(f"{field}.weights", f"{w.get('num_bits')}-bit {w.get('type')} weights are not read "
                   "(gaudi-serve reads 8-bit float weights from compressed-tensors checkpoints)")
    if w.get("symmetric") is False or w.get("dynamic"):
        raise _err(f"{field}.weights", "only symmetric, static FP8 weight scales are read")
    strategy = w.get("strategy")
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _err(f"{field}.weights.block_structure", f"{block!r} is not [rows, columns]")
        return strategy, (block[0], block[1])
    if strategy not in ("tensor", "channel"):
        raise _err(f"{field}.weights.strategy", f"{strategy!r} is not read (tensor, channel or block)")
    return strategy, None


def _fp8_activations(a: dict[str, Any] | None, field: str) -> str:
    if not a:
        return "none"
    if a.get("num_bits") != 8 or a.get("type") != "float":
        raise _err(f"{field}.input_activations", f"{a.get('num_bits')}-bit {a.get('type')} activations are not read")
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if dynamic and strategy in ("token", "tensor"):
        return f"dynamic-{strategy}"
    if not dynamic and strategy == "tensor":
        return "static-tensor"
    raise _err(f"{field}.input_activations", f"strategy {strategy!r} with dynamic={dynamic} is not read "
               "(dynamic token or tensor, or static tensor)")


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise _err("format", f"{fmt!r} is not read (gaudi-serve reads float-quantized FP8 checkpoints)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _err("config_groups", f"{len(groups)} groups; gaudi-serve reads one scheme for every layer")
    (name, group), = groups.items()
    field = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _err(f"{field}.targets", f"{group.get('targets')!r} is not read (only [\"Linear\"])")
    if qc.get("kv_cache_scheme"):
        raise _err("kv_cache_scheme", "a quantized KV cache in the checkpoint is not read (use --kv-cache-dtype)")
    scales, block = _fp8_weights(group.get("weights") or {}, field)
    acts = _fp8_activations(group.get("input_activations"), field)
    ignore = qc.get("ignore") or []
    return CheckpointQuant("compressed-tensors", "fp8", scales, block, acts, ignore=tuple(ignore))


def _block_fp8(qc: dict[str, Any]) -> CheckpointQuant:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _err("fmt", f"{qc.get('fmt')!r} is not read (e4m3)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _err("weight_block_size", f"{block!r} is not [rows, columns]")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _err("activation_scheme", f"{scheme!r} is not read (dynamic)")
    ignore = qc.get("modules_to_not_convert") or []
    return CheckpointQuant("fp8", "fp8", "block", (block[0], block[1]), "dynamic-token", ignore=tuple(ignore))


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _err("bits", f"{bits!r}-bit GPTQ is not served (4 or 8)")
    if qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise _err("checkpoint_format", f"{qc.get('checkpoint_format')!r} is not read (gptq)")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise _err("group_size", f"{group!r} (a positive number of columns, or -1)")
    return CheckpointQuant("gptq", f"int{bits}", "group", group_size=group, desc_act=bool(qc.get("desc_act")),
                           sym=bool(qc.get("sym", True)))


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise _err("bits", f"{bits!r}-bit AWQ is not served (4)")
    if version != "gemm":
        raise _err("version", f"{version!r} is not read (gemm)")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise _err("group_size", f"{group!r} (a positive number of columns, or -1)")
    if not qc.get("zero_point", True):
        raise _err("zero_point", "AWQ without zero points is not read")
    return CheckpointQuant("awq", "int4", "group", group_size=group, sym=False)


def checkpoint_quant(cfg: dict[str, Any]) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: not quantized), from config.json's dict; ConfigError if unreadable."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("config.json quantization_config: not an object")
    return parse_quantization(qc)


def check_against_flag(found: CheckpointQuant | None, quantize: str | None, quant_config: str | None) -> None:
    """The --quantize / QUANT_CONFIG settings against what the checkpoint holds: one-line errors."""
    if found is None:
        if quantize not in (None, "fp8"):
            raise ConfigError(f"--quantize {quantize}: the checkpoint has no quantization_config in config.json "
                              f"(it is not a {quantize} checkpoint)")
        return
    if quant_config:
        raise ConfigError(f"QUANT_CONFIG: the checkpoint is already quantized ({found.describe()}); calibrating "
                          "it again is not supported")
    if quantize is not None and quantize not in FLAG_MATCHES[found.method]:
        raise ConfigError(f"--quantize {quantize} does not match the checkpoint (quantization_config.quant_method "
                          f"{found.method!r}); pass --quantize {found.method} or leave it unset")


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table (name -> {dtype, shape, ...}), without reading a tensor."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def quantized_modules(tensors: dict[str, dict], found: CheckpointQuant) -> set[str]:
    """Checkpoint module names whose weight is float8; ConfigError for one stored without its scale."""
    names = set(tensors)
    modules = set()
    for name, meta in tensors.items():
        if not name.endswith(".weight") or not str(meta.get("dtype", "")).startswith("F8"):
            continue
        module = name[: -len(".weight")]
        if not any(f"{module}.{s}" in names for s in SCALE_NAMES):
            wanted = "weight_scale_inv" if found.method == "fp8" else "weight_scale"
            raise ConfigError(f"checkpoint tensor {name!r} is float8 but {module}.{wanted} is missing")
        modules.add(module)
    return modules


def check_checkpoint(model_dir: str | Path, cfg: dict[str, Any], files: list[Path], quantize: str | None,
                     quant_config: str | None) -> CheckpointQuant | None:
    """Everything a start checks about a (possibly) quantized checkpoint, reading only headers."""
    found = checkpoint_quant(cfg)
    check_against_flag(found, quantize, quant_config)
    if found is None:
        return found
    tensors: dict[str, dict] = {}
    for f in files:
        tensors.update(read_header(f))
    if found.weights == "fp8" and not quantized_modules(tensors, found):
        raise ConfigError(f"{model_dir}: config.json says {found.describe()} but no weight is float8")
    if found.method in PACKED_TENSORS:
        check_packed_tensors(model_dir, tensors, found.method)
    return found


def check_packed_tensors(model_dir, tensors: dict[str, dict], method: str) -> None:
    """Every packed GPTQ / AWQ weight comes with its zeros, scales (and GPTQ's g_idx)."""
    modules = [n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")]
    if not modules:
        raise ConfigError(f"{model_dir}: config.json says {method} but no tensor is a qweight")
    for module in modules:
        for part in PACKED_TENSORS[method]:
            if f"{module}.{part}" not in tensors:
                raise ConfigError(f"checkpoint tensor {module}.{part} is missing ({method} layer {module})")
