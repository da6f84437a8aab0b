"""Device backends behind one small interface: chosen automatically or by --device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    name: str  # "hpu" | "cuda" | "cpu"
    torch_device: torch.device
    distributed_backend: str  # hccl | nccl | gloo


def _hpu_available() -> bool:
    try:
        import habana_frameworks.torch.hpu as hthpu  # noqa: F401 - optional, Gaudi only
    except ImportError:
        return False
    return bool(hthpu.is_available())


def select_device(name: str = "auto", rank: int = 0) -> Device:
    if name == "hpu" or (name == "auto" and _hpu_available()):
        return Device("hpu", torch.device("hpu"), "hccl")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return Device("cuda", torch.device("cuda", rank % max(1, torch.cuda.device_count())), "nccl")
    return Device("cpu", torch.device("cpu"), "gloo")
