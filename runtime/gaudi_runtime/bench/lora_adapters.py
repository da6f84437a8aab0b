"""Random PEFT LoRA adapters for a bench model: what `bench/compare_vllm.sh`'s `lora` workload serves.

    python -m gaudi_runtime.bench.lora_adapters MODEL_DIR OUT_DIR --count 4 --rank 16

Writes OUT_DIR/a1 ... OUT_DIR/aN, each a PEFT directory (`adapter_config.json`,
`adapter_model.safetensors`) targeting every attention and MLP projection of every layer, with
nonzero random A and B (seeded by the adapter's number), so both servers load the same files and
each adapter changes the outputs. Written with safetensors alone (no peft, no model load): the
shapes come from the model's config.json. An adapter already there is kept.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gaudi_runtime.adapters import CONFIG_FILE, TARGETS, WEIGHTS_FILE, expected_shapes

_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def adapter_tensors(model_config: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's keys -> A [rank, in] and B [out, rank], float32; B small enough to keep the logits sane."""
    g = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(model_config)
    out: dict[str, torch.Tensor] = {}
    for layer in range(model_config["num_hidden_layers"]):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            key = f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    return out


def adapter_config(model_dir: str, rank: int) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_dir, "r": rank,
            "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True}


def write_adapters(model_dir: str | Path, out: str | Path, count: int, rank: int) -> list[Path]:
    """`count` adapters under `out` (a1 ... aN); returns their directories."""
    from safetensors.torch import save_file

    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    dirs = []
    for i in range(1, count + 1):
        d = Path(out) / f"a{i}"
        dirs.append(d)
        if (d / WEIGHTS_FILE).is_file() and (d / CONFIG_FILE).is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in adapter_tensors(model_config, rank, seed=i).items()}
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
        (d / CONFIG_FILE).write_text(json.dumps(adapter_config(str(model_dir), rank), indent=2))
    return dirs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.lora_adapters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args(argv)
    for d in write_adapters(a.model_dir, a.out_dir, a.count, a.rank):
        print(d)


if __name__ == "__main__":
    main()
