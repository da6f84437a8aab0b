"""GPTQ and AWQ checkpoints dequantized by `gptqmodel` (the library that makes them), written back dense.

    python -m tests.runtime.gptqmodel_reference QUANTIZED_DIR DENSE_DIR [QUANTIZED_DIR DENSE_DIR ...]

Each quantized checkpoint is read from disk and every packed layer is dequantized by the library's own
code: GPTQ through its `TorchLinear` after its v1-to-v2 zero-point conversion (what its loader does to a
`checkpoint_format: gptq` file), AWQ through its GEMM-layout `dequantize_gemm`. The dense copy (float32,
no `quantization_config`) is what `transformers` then runs as the parity tests' reference.

Layer by layer rather than the library's whole-model loader: its CPU kernels only run in float16 or
bfloat16, and a half-precision model is no greedy-token reference for a float32 server; the dequantization
itself is dtype-agnostic. A separate process (the tests run this module with `-m`) because importing
`gptqmodel` patches transformers, safetensors and the environment, which the test process must not inherit.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PACKED = ("qweight", "qzeros", "scales", "g_idx")


def gptq_weight(t: dict, qc: dict) -> torch.Tensor:
    """The dense ``[out, in]`` weight of one GPTQ layer, by gptqmodel's `TorchLinear`."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    bits = qc["bits"]
    cols, out = t["qweight"].shape[0] * 32 // bits, t["qweight"].shape[1]
    layer = TorchLinear(bits=bits, group_size=qc["group_size"], sym=qc.get("sym", True),
                        desc_act=qc.get("desc_act", False), in_features=cols, out_features=out, bias=False)
    for name in (n for n in PACKED if n in t):  # without g_idx: the library's own ``i // group``
        value = t[name].float() if name == "scales" else t[name]
        getattr(layer, name).data = value.clone()
    if qc.get("checkpoint_format", "gptq") == "gptq":
        convert_gptq_v1_to_v2_format_module(layer, bits, torch.int32)
    layer.post_init()
    layer.eval()
    return layer.dequantize_weight().t()


def awq_weight(t: dict, qc: dict) -> torch.Tensor:
    """The dense ``[out, in]`` weight of one AWQ GEMM layer, by gptqmodel's `dequantize_gemm`."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    group = t["qweight"].shape[0] if qc["group_size"] == -1 else qc["group_size"]
    return dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), qc["bits"], group).t()


def dense_copy(model_dir: Path, out_dir: Path) -> Path:
    """Copy `model_dir` to `out_dir` with every packed layer replaced by the library's dense weight."""
    shutil.copytree(model_dir, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    dequantize = {"gptq": gptq_weight, "awq": awq_weight}[qc["quant_method"]]
    tensors = load_file(out_dir / "model.safetensors")
    layers = {n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")}
    dense = {n: t for n, t in tensors.items() if tuple(n.rsplit(".", 1)) not in
             {(layer, k) for layer in layers for k in PACKED}}
    for layer in layers:
        found = {k: tensors[f"{layer}.{k}"] for k in PACKED if f"{layer}.{k}" in tensors}
        dense[f"{layer}.weight"] = dequantize(found, qc).float().contiguous()
    save_file(dense, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 2:
        sys.exit("usage: python -m tests.runtime.gptqmodel_reference QUANTIZED_DIR DENSE_DIR [...]")
    # Its worker pool otherwise sizes itself for a large machine.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(min(2, os.cpu_count() or 1)))
    for src, dst in zip(argv[::2], argv[1::2]):
        dense_copy(Path(src), Path(dst))


if __name__ == "__main__":
    main(sys.argv[1:])
