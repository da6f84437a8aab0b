"""Fake habana_frameworks.torch.hpu: HPU graphs that record captures and replays per input shape."""

import torch

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


class _Graphed(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.shapes = set()

    def forward(self, *args):
        key = (getattr(self.module, "name", type(self.module).__name__), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        if key in self.shapes:
            RECORD["replays"].append(key)
        else:
            self.shapes.add(key)
            RECORD["captures"].append(key)
        return self.module(*args)


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, **kwargs):
    RECORD["wrapped"] += 1
    return _Graphed(module)
