"""LoRA adapters into a loaded model: each targeted linear layer gets its stacked slots (layers/lora.py).

There are --max-loras device slots besides slot 0 (no adapter); slot i (1-based) starts with the i-th
adapter of `--lora-adapters`/`--lora-modules`, in the order the router numbers them, up to that count.
An adapter in no slot is written into one while serving (`write_adapter`) when the router has a request
need it there. Each rank copies the slices its layer holds (`lora_output_slices` of a column-parallel
layer, the input rows of a row-parallel one), so A and B split as the weight does.

With `--allow-runtime-lora-updating` every linear layer an adapter may target gets its slots at start
(`--max-loras` of them besides slot 0), so that an adapter loaded later (`write_adapter`, in one slot,
whatever it targets) changes no tensor's shape: captured graphs stay valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..adapters import TARGETS, WEIGHTS_FILE, AdapterFacts, check_adapter
from ..layers.linear import LinearBase
from ..layers.lora import AdapterRows, LoraWeights, stacked


def load_adapters(model, cfg, model_dir: str) -> tuple[AdapterRows | None, list[dict[str, list]]]:
    """The adapters of `cfg`, the configuration's adapters part (--lora-adapters, --lora-modules), into
    `model`'s --max-loras device slots; the rows object (None when there are none and none may be loaded
    later) and every adapter read, in order (the shard keeps host copies of them: shard/adapter_cache.py)."""
    if not cfg.lora_adapters and not cfg.allow_runtime_lora_updating:
        return None, []
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    read = [read_adapter(model, a.name, a.path or a.source, model_config, cfg.max_lora_rank)
            for a in cfg.lora_adapters]
    rows = attach_read(model, read, cfg.max_lora_rank, cfg.max_loras, every_layer=cfg.allow_runtime_lora_updating)
    return rows, read


def attach_adapters(model, adapters: list[tuple[str, str]], model_config: dict, max_rank: int,
                    slots: int | None = None, every_layer: bool = False) -> AdapterRows:
    """Check and load `(name, directory)` adapters into `model`, the i-th in slot i of `slots` (default: as
    many as adapters); return the rows object its step sets."""
    read = [read_adapter(model, name, path, model_config, max_rank) for name, path in adapters]
    return attach_read(model, read, max_rank, slots or len(adapters), every_layer)


def attach_read(model, read: list[dict[str, list]], max_rank: int, slots: int, every_layer: bool = False) -> AdapterRows:
    """Give every linear layer that one of the `read` adapters targets `slots` + 1 stacked slots, the i-th
    adapter in slot i up to `slots` (the others were only read and checked). Every adapter is padded to `max_rank`
    (--max-lora-rank), so shapes do not depend on which are loaded. `every_layer`: every linear layer an
    adapter may target gets slots, not only those these adapters target (adapters loaded later)."""
    rows = AdapterRows()
    parts = {}  # our module path -> [(slot, shard id, A, B, scale)]
    for slot, adapter in enumerate(read, start=1):
        for module, part in adapter.items():
            parts.setdefault(module, []).extend((slot, *p) for p in part if slot <= slots)
    modules = set(parts) | (set(targetable(model)) if every_layer else set())
    for module in sorted(modules):
        layer = model.get_submodule(module)
        if not isinstance(layer, LinearBase):
            raise ValueError(f"{module} is not a linear layer: it takes no adapter")
        layer.lora = _stack(layer, parts.get(module, []), slots + 1, max_rank, rows)
    return rows


def targetable(model) -> list[str]:
    """Our path of every linear layer an adapter may target (the fused ones under their fused name)."""
    names = set(TARGETS) | {mine for mine, _ in model.packed_modules_mapping.values()}
    return [path for path, m in model.named_modules()
            if isinstance(m, LinearBase) and ".layers." in path and path.rpartition(".")[2] in names]


def read_adapter(model, name: str, path: str, model_config: dict, max_rank: int,
                 attached: bool = False) -> dict[str, list]:
    """Check an adapter (AdapterError says what is wrong) and read it: our module path -> its parts
    `(shard id, A [r, in], B [out, r], scale)`. Nothing of the model changes. `attached`: the model's
    LoRA layers exist (a load while serving), and every module the adapter targets must be one."""
    fact = check_adapter(name, path, model_config, max_rank)
    parts: dict[str, list] = {}
    for module, shard, a, b in _tensors(model, Path(path), fact):
        parts.setdefault(module, []).append((shard, a, b, fact.scale))
    missing = sorted(m for m in parts if getattr(model.get_submodule(m), "lora", None) is None)
    if attached and missing:
        raise ValueError(f"adapter {name!r} targets {missing[0]}, which has no adapter slots "
                         "(only layers given adapters at start have them without --allow-runtime-lora-updating)")
    return parts


def read_new_adapter(model, cfg, model_dir: str, name: str, path: str) -> dict[str, list]:
    """`read_adapter` for a slot written while serving (an adapter swapped into a device slot, or loaded
    with --allow-runtime-lora-updating): the model's slots exist. `cfg`: the configuration's adapters part."""
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    return read_adapter(model, name, path, model_config, cfg.max_lora_rank, attached=True)


@torch.no_grad()
def write_adapter(model, slot: int, parts: dict[str, list]) -> None:
    """Put a read adapter into `slot` of every LoRA layer: zeros first (layers it does not target, and
    ranks below the largest), then its parts, in place (graphs captured over these tensors see it)."""
    rank = None
    for module, layer in model.named_modules():
        if isinstance(layer, LinearBase) and layer.lora is not None:
            layer.lora.a[slot].zero_()
            layer.lora.b[slot].zero_()
            rank = layer.lora.a.shape[2] // _slices(layer)
            for shard, a, b, scale in parts.get(module, []):
                _place(layer, layer.lora.a, layer.lora.b, slot, shard, a, b, scale, rank)


def _tensors(model, path: Path, fact: AdapterFacts):
    """(our module path, shard id, A [r, in], B [out, r]) of every module the adapter targets."""
    from safetensors import safe_open

    packed = model.packed_modules_mapping
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for module, (a_key, b_key) in fact.modules.items():
            prefix, _, leaf = module.rpartition(".")
            mine, shard = packed.get(leaf, (leaf, None))
            yield f"{prefix}.{mine}", shard, f.get_tensor(a_key).float(), f.get_tensor(b_key).float()


def _slices(layer: LinearBase) -> int:
    slices = layer.lora_output_slices()
    return 1 if slices is None else len(slices)


def _stack(layer: LinearBase, parts: list, slots: int, rank: int, rows: AdapterRows) -> LoraWeights:
    """The layer's stacked A and B: each part in its slot, its projection's columns, this rank's slice."""
    out_features, in_features = layer.weight.shape
    a, b = stacked(slots, in_features, out_features, _slices(layer), rank, torch.float32, torch.device("cpu"))
    for slot, shard, lora_a, lora_b, scale in parts:
        _place(layer, a, b, slot, shard, lora_a, lora_b, scale, rank)
    device, dtype = layer.weight.device, layer.weight.dtype
    return LoraWeights(rows, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))


def _place(layer: LinearBase, a: torch.Tensor, b: torch.Tensor, slot: int, shard, lora_a: torch.Tensor,
           lora_b: torch.Tensor, scale: float, rank: int) -> None:
    """One projection's A [r, in] and B [out, r] into `slot` of the stacked `a` and `b`: its columns of
    the fused layer, this rank's slice, the scale folded into B."""
    slices = layer.lora_output_slices()
    s = 0 if slices is None else [x[0] for x in slices].index(shard)
    cols = slice(s * rank, s * rank + lora_a.shape[0])
    if slices is None:  # row-parallel: this rank's input features
        in_features = a.shape[1]
        start = layer.tp.rank * in_features
        a[slot, :, cols] = lora_a[:, start:start + in_features].T
        b[slot, cols, :] = scale * lora_b.T
    else:
        _, offset, start, size = slices[s]
        a[slot, :, cols] = lora_a.T
        b[slot, cols, offset:offset + size] = scale * lora_b[start:start + size].T
