"""The interface the shard drives a model through, whatever its family.

``ModelRunner`` (and the quantizer, the calibration and the benchmarks) rely on
these members only, so a new family is served by implementing them; every model
class here does so by deriving from ``base.CausalLMBase``. The per-rank numbers
size the KV cache; ``max_position_embeddings`` is the longest sequence the model
serves exactly, which the router enforces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from ..layers.attention import AttentionMetadata


@runtime_checkable
class CausalLM(Protocol):
    num_layers: int
    num_heads: int  # attention heads on this rank
    num_kv_heads: int  # key/value heads on this rank: the KV cache's shape
    head_dim: int
    # (heads, dim) per token of each of a layer's two cache tensors: what the KV cache is sized and
    # allocated by (keys and values; MLA's latent and rope key, ``layers/mla.py``)
    kv_token_shapes: tuple[tuple[int, int], tuple[int, int]]
    hidden_size: int
    vocab_size: int  # the model's own vocabulary (logits carry no tensor-parallel padding)
    eos_token_ids: list[int]
    max_position_embeddings: int  # positions, capped by the sliding window where there is one
    dtype: torch.dtype
    device: torch.device
    takes_images: bool  # True: the model is also a `TakesImages`

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S]`` ids and positions (or ``[B, S, hidden]`` embeddings) -> final hidden states."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 ``[N, vocab_size]``, the same on every rank."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint ``(name, tensor)`` pairs; each layer keeps this rank's slice."""
        ...


@runtime_checkable
class TakesImages(CausalLM, Protocol):
    image_token_id: int  # the placeholder token whose embeddings the image features replace

    def embed_prompt(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                     image_sizes: list[tuple[int, int]]) -> torch.Tensor:
        """Prompt embeddings ``[B, S, hidden]`` with the images' features at the placeholders."""
        ...
