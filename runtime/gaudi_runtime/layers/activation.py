"""MLP activations by their ``transformers`` config name, with the same formulas (greedy parity needs them exact)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:  # GPT-2's tanh formula, written out
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str, setting: str = "activation") -> Callable[[torch.Tensor], torch.Tensor]:
    """The function for config value ``name``; an unknown one fails naming ``setting`` and the supported names."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"unsupported {setting} {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return fn
