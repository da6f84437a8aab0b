"""Checkpoint tensors into a built model, by name.

A model class declares ``packed_modules_mapping`` (checkpoint name fragment ->
(parameter name fragment, shard id)) for the projections it fuses, and each
parameter carries a ``weight_loader`` that takes its rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn


def load_checkpoint(model: nn.Module, weights: Iterable, packed: dict[str, tuple[str, object]],
                    skip: Callable[[str], bool] = lambda name: False,
                    rename: Callable[[str], str] = lambda name: name) -> None:
    """Load ``(name, tensor)`` pairs into ``model``; fail naming any unexpected or missing weight.

    ``rename`` maps a checkpoint name to the model's naming first. ``skip(name)``
    then drops checkpoint tensors the model does not hold (tied heads, cached
    rotary tables); it is also asked about the model's own parameter names, so a
    tied parameter is not reported missing.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    shards_of: dict[str, set] = {}
    for mine, shard_id in packed.values():
        shards_of.setdefault(mine, set()).add(shard_id)
    for name, tensor in weights:
        name = rename(name)
        if skip(name):
            continue
        target, shard = name, None
        for ckpt, (mine, shard_id) in packed.items():
            if f".{ckpt}." in name:
                target, shard = name.replace(f".{ckpt}.", f".{mine}."), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        loaded.add(target if shard is None else f"{target}:{shard}")
    missing = []
    for pname in params:
        if skip(pname):
            continue
        module_name = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if module_name in shards_of:
            missing += [f"{pname}:{s}" for s in shards_of[module_name] if f"{pname}:{s}" not in loaded]
        elif pname not in loaded:
            missing.append(pname)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
