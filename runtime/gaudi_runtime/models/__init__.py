"""Our own model implementations, the interface the shard drives them through, and the loader."""

from .interface import CausalLM, TakesImages
from .registry import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    load_model,
    read_config,
    resolve_architecture,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "TakesImages",
    "UnsupportedModelError",
    "load_model",
    "read_config",
    "resolve_architecture",
]
