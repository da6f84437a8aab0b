"""Fake habana_frameworks.torch.hpu: HPU graphs that record captures and replays per input shape.

A capture compiles a recipe: with a recipe cache configured (PT_HPU_RECIPE_CACHE_CONFIG when the bridge
loaded), one already in its directory is a hit, else it is compiled and written there."""

import hashlib
from pathlib import Path

import torch

import habana_frameworks
from habana_frameworks.torch import RECORD

MEMORY = {"Limit": 8 << 30, "InUse": 1 << 30}


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def synchronize() -> None:
    RECORD["synchronize"] += 1


def memory_stats() -> dict:
    return dict(MEMORY)


def _compile(key) -> None:
    config = habana_frameworks.RECIPE_CACHE_CONFIG_AT_IMPORT
    if not config:
        RECORD["recipe_compiles"] += 1
        return
    recipe = Path(config.split(",")[0]) / (hashlib.sha1(repr(key).encode()).hexdigest() + ".recipe")
    if recipe.exists():
        RECORD["recipe_hits"] += 1
        return
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_bytes(b"fake recipe")
    RECORD["recipe_compiles"] += 1


class _Graphed(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.shapes = set()

    def forward(self, *args):
        key = (getattr(self.module, "name", type(self.module).__name__), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        RECORD["events"].append(("graph", key[0]))
        if key in self.shapes:
            RECORD["replays"].append(key)
        else:
            self.shapes.add(key)
            RECORD["captures"].append(key)
            _compile(key)
        return self.module(*args)


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, **kwargs):
    RECORD["wrapped"] += 1
    return _Graphed(module)
