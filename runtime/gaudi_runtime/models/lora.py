"""LoRA adapters into a loaded model: each targeted linear layer gets its stacked slots (layers/lora.py).

Slot i (1-based) is the i-th adapter of `--lora-adapters`/`--lora-modules`, in the order the router
numbers them; slot 0 is no adapter. Each rank copies the slices its layer holds (`lora_output_slices`
of a column-parallel layer, the input rows of a row-parallel one), so A and B split as the weight does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..adapters import WEIGHTS_FILE, AdapterFacts, check_adapter
from ..layers.linear import LinearBase
from ..layers.lora import AdapterRows, LoraWeights, stacked


def load_adapters(model, cfg, model_dir: str) -> AdapterRows | None:
    """The adapters of `cfg` (--lora-adapters, --lora-modules) into `model`; None when there are none."""
    if not cfg.lora_adapters:
        return None
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    adapters = [(a["name"], a["path"] or a["source"]) for a in cfg.lora_adapters]
    return attach_adapters(model, adapters, model_config, cfg.max_lora_rank)


def attach_adapters(model, adapters: list[tuple[str, str]], model_config: dict, max_rank: int) -> AdapterRows:
    """Check and load `(name, directory)` adapters into `model`; return the rows object its step sets.
    Every adapter is padded to `max_rank` (--max-lora-rank), so shapes do not depend on which are loaded."""
    rows = AdapterRows()
    facts = [check_adapter(name, path, model_config, max_rank) for name, path in adapters]
    layers: dict[str, list] = {}  # our module path -> [(slot, shard id, A, B, scale)]
    for slot, ((_, path), fact) in enumerate(zip(adapters, facts, strict=True), start=1):
        for module, shard, a, b in _tensors(model, Path(path), fact):
            layers.setdefault(module, []).append((slot, shard, a, b, fact.scale))
    for module, parts in layers.items():
        layer = model.get_submodule(module)
        if not isinstance(layer, LinearBase):
            raise ValueError(f"{module} is not a linear layer: it takes no adapter")
        layer.lora = _stack(layer, parts, len(adapters) + 1, max_rank, rows)
    return rows


def _tensors(model, path: Path, fact: AdapterFacts):
    """(our module path, shard id, A [r, in], B [out, r]) of every module the adapter targets."""
    from safetensors import safe_open

    packed = model.packed_modules_mapping
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for module, (a_key, b_key) in fact.modules.items():
            prefix, _, leaf = module.rpartition(".")
            mine, shard = packed.get(leaf, (leaf, None))
            yield f"{prefix}.{mine}", shard, f.get_tensor(a_key).float(), f.get_tensor(b_key).float()


def _stack(layer: LinearBase, parts: list, slots: int, rank: int, rows: AdapterRows) -> LoraWeights:
    """The layer's stacked A and B: each part in its slot, its projection's columns, this rank's slice."""
    out_features, in_features = layer.weight.shape
    slices = layer.lora_output_slices()
    shard_ids = [s[0] for s in slices] if slices is not None else [None]
    a, b = stacked(slots, in_features, out_features, len(shard_ids), rank, torch.float32, torch.device("cpu"))
    for slot, shard, lora_a, lora_b, scale in parts:
        s = shard_ids.index(shard)
        cols = slice(s * rank, s * rank + lora_a.shape[0])
        if slices is None:  # row-parallel: this rank's input features
            start = layer.tp.rank * in_features
            a[slot, :, cols] = lora_a[:, start:start + in_features].T
            b[slot, cols, :] = scale * lora_b.T
        else:
            _, offset, start, size = slices[s]
            a[slot, :, cols] = lora_a.T
            b[slot, cols, offset:offset + size] = scale * lora_b[start:start + size].T
    device, dtype = layer.weight.device, layer.weight.dtype
    return LoraWeights(rows, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
