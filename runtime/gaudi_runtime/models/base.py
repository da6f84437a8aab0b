"""The build every model family goes through, so that a model file only declares its modules.

A family's class derives from ``CausalLMBase`` and gives

* ``config_class``: its parsed config.json, a ``ModelConfig``;
* ``build(cfg, tp)``: its modules, named as in the checkpoint (run on the meta
  device: nothing is allocated until this rank's slices are known);
* ``packed_modules_mapping``: checkpoint name fragment -> (parameter name
  fragment, shard id) for the projections it fuses, and ``unused_weight`` /
  ``checkpoint_name`` where its checkpoints hold tensors it has no use for or
  name things differently;
* where its decoder (the module from ids to final hidden states, holding the
  one token embedding) and its LM head sit, when not at the Llama names
  (``model``, ``lm_head``).

The base adds the LM head (sharing the embedding when the config ties them),
gives every parameter this rank's memory, and sets the attributes of the
``interface.CausalLM`` the shard drives, the context limit included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import TPContext
from ..layers.rotary import RotaryEmbedding
from .loading import load_checkpoint

_REQUIRED = object()  # a config field without a default

@dataclass(kw_only=True)
class ModelConfig:
    """The fields every family's config has."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int  # key/value heads in the checkpoint (before tensor parallelism)
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # The attention window config.json declares; None: every token sees the whole sequence.
    sliding_window: int | None = None
    # The leading features of each head RoPE rotates (partial_rotary_factor); None: all of head_dim.
    rotary_dim: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @staticmethod
    def shared_fields(cfg: dict[str, Any], architecture: str, names: dict[str, tuple[str, ...]] | None = None,
                      max_positions: int = 2048, tied: bool = False) -> dict[str, Any]:
        """These fields from a config.json dict, read the same way for every family (the attention
        window included, wherever a config declares one).

        ``names``: for a field a family's configs spell their own way (GPT-2's ``n_embd``), the keys
        to try, the first present wins. ``max_positions`` and ``tied``: the family's defaults for a
        config without ``max_position_embeddings`` / ``tie_word_embeddings``."""
        names = names or {}

        def value(name: str, default: Any = _REQUIRED) -> Any:
            for key in names.get(name, (name,)):
                if key in cfg:
                    return cfg[key]
            if default is _REQUIRED:
                raise KeyError(name)
            return default

        hidden, heads = value("hidden_size"), value("num_attention_heads")
        return dict(
            architecture=architecture, vocab_size=value("vocab_size"), hidden_size=hidden,
            num_hidden_layers=value("num_hidden_layers"), num_attention_heads=heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=int(value("max_position_embeddings", max_positions)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied)),
            sliding_window=cfg.get("sliding_window"),
        )

    @property
    def context_length(self) -> int:
        """The longest sequence served exactly. A family whose layers all share one window (Mistral,
        Qwen2, Starcoder2) runs without one, so a sequence past the window is refused rather than
        attended in full; Gemma 2/3 attend over their windows and serve their whole context."""
        if self.sliding_window:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings


def rotary_embedding(cfg, dtype: torch.dtype, device: torch.device) -> RotaryEmbedding:
    """The model's RoPE tables, for the config's full position range (the range llama3 and dynamic
    scaling are defined over). Computed on the host even while the model is built on the meta
    device, so that every device gets the same float32 tables."""
    with torch.device("cpu"):
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                               dtype=dtype, device=device, rotary_dim=cfg.rotary_dim)


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters by uninitialized ones on ``device`` in ``dtype`` (keeping ties and loaders)."""
    memo: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = memo.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
                if hasattr(p, "weight_loader"):
                    new.weight_loader = p.weight_loader
                memo[id(p)] = new
            mod._parameters[name] = new


class CausalLMBase(nn.Module):
    """A decoder and an LM head, built for one tensor-parallel rank."""

    config_class: ClassVar[type[ModelConfig]]
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {}
    takes_images: ClassVar[bool] = False
    # The attention module whose head counts the shard sizes the cache by (``layers/mla.MLAttention`` for MLA).
    attention_class: ClassVar[type[nn.Module]] = Attention
    # Where the decoder (ids -> final hidden states) and the LM head sit.
    decoder: ClassVar[str] = "model"
    head: ClassVar[str] = "lm_head"

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        self.device = torch.device(device)
        with torch.device("meta"):
            self.build(cfg, tp)
            self._add_head(cfg, tp)
        materialize(self, dtype, self.device)
        attn = self._first(self.attention_class)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = cfg.head_dim
        self.kv_token_shapes = getattr(attn, "kv_token_shapes", ((attn.num_kv_heads, cfg.head_dim),) * 2)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.max_position_embeddings = cfg.context_length

    def build(self, cfg: ModelConfig, tp: TPContext) -> None:
        """Declare the model's modules (all but the LM head) as attributes."""
        raise NotImplementedError

    def _first(self, kind: type[nn.Module]) -> nn.Module:
        """The decoder's first module of ``kind`` (its token embedding, its first attention)."""
        return next(m for m in self.get_submodule(self.decoder).modules() if isinstance(m, kind))

    def _add_head(self, cfg: ModelConfig, tp: TPContext) -> None:
        head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            head.weight = self._first(VocabParallelEmbedding).weight
        owner, _, name = self.head.rpartition(".")
        (self.get_submodule(owner) if owner else self).add_module(name, head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[B, S]`` -> final-normed hidden states ``[B, S, hidden]``."""
        return self.get_submodule(self.decoder)(input_ids, positions, kv_caches, meta, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 ``[N, vocab_size]`` (gathered over ranks, padding dropped)."""
        return self.get_submodule(self.head)(hidden)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Load from an iterable of ``(name, tensor)`` (full checkpoint tensors; each layer slices its part)."""
        tied_head = f"{self.head}.weight" if self.config.tie_word_embeddings else None

        def skip(name: str) -> bool:
            return name == tied_head or self.unused_weight(name)

        load_checkpoint(self, weights, self.packed_modules_mapping, skip, self.checkpoint_name)

    def unused_weight(self, name: str) -> bool:
        """A checkpoint tensor the model holds nothing for (asked after ``checkpoint_name``)."""
        return "rotary_emb.inv_freq" in name

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in this model's naming."""
        return name
