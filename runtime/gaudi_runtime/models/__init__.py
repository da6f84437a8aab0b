"""Our own model implementations (Llama family) and the loader."""

from .registry import (
    SUPPORTED_ARCHITECTURES,
    CausalLM,
    UnsupportedModelError,
    load_model,
    read_config,
    resolve_architecture,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "UnsupportedModelError",
    "load_model",
    "read_config",
    "resolve_architecture",
]
