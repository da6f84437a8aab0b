"""Rotary position embedding (Llama "rotate half" convention) with a precomputed cos/sin cache.

Supported ``rope_scaling`` types: default, ``llama3``, ``linear``, ``dynamic``, ``longrope`` (Phi-3's,
also spelled ``su``), ``yarn``. A ``rotary_dim`` below ``head_dim`` (``partial_rotary_factor``) rotates the first
``rotary_dim`` features of each head and passes the rest through.

``longrope`` choice: transformers picks one factor set per forward call, the long one when
``max(position_ids) + 1 > original_max_position_embeddings``, else the short one, and multiplies cos and
sin by the attention factor; Phi-3's ``generate()`` recomputes the whole cache with the long set at the
step a sequence first passes the original length. Here each row of a batch is such a call: the table
holds the short rows for positions ``[0, original)`` and after them the long rows for every position,
and a row whose largest position is at or past ``original`` reads the long rows. A whole prompt longer
than ``original`` is then rotated long throughout and a sequence that stays within it short, as in
transformers. A chunk of a prompt longer than ``original`` is marked long by its caller (``table_rows``),
and a sequence that passes ``original`` while decoding is prefilled again whole (router/batching.py), as
Phi-3's ``generate()`` does; docs/design.md ("Model code") says what is exact.

``yarn`` (DeepSeek-V2/V3, long-context Qwen): frequencies blended between the
original and the ``factor``-interpolated ones along a linear ramp, and cos/sin
multiplied by an attention factor (from ``mscale`` / ``mscale_all_dim`` where
the config gives them), as transformers does; a model whose softmax scale also
changes (DeepSeek's ``mscale_all_dim``) takes it from ``yarn_softmax_scale``.

``dynamic`` (NTK) choice: transformers recomputes the frequencies only when a
sequence grows past ``max_position_embeddings`` and uses the unscaled
frequencies below it. We precompute the cache once for positions
``[0, max_position_embeddings)`` with ``seq_len = max_position_embeddings``,
which is exactly the unscaled base, so results equal transformers for every
sequence the runtime accepts (it never serves more than
``max_position_embeddings`` tokens); dynamic scaling does not extend the
context here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "longrope", "yarn")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs


def rope_params_from_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, scaling)`` from a config.json dict.

    Handles both the transformers<5 layout (``rope_theta`` + ``rope_scaling``
    with key ``type`` or ``rope_type``) and the transformers 5 layout
    (``rope_parameters`` holding ``rope_theta`` and ``rope_type``). ``scaling``
    is None for plain RoPE, else a dict with a normalized ``rope_type`` key.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    merged: dict[str, Any] = {}
    if isinstance(scaling, dict):
        merged.update(scaling)
    if isinstance(params, dict):
        if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
            params = params["full_attention"]
        merged.update(params)
    if theta is None:
        theta = merged.get("rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    merged = dict(merged)
    merged["rope_type"] = rope_type
    if rope_type == "longrope" and cfg.get("original_max_position_embeddings"):
        # The top-level field wins over the dict's (Phi-3 writes it there), as transformers reads it.
        merged["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return float(theta), merged


def longrope_inv_freqs(dim: int, theta: float, scaling: dict[str, Any],
                       max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """LongRoPE's ``(short inv_freq, long inv_freq, attention factor, original length)``, computed as
    transformers computes them (float32; the factors divide the base frequencies)."""
    original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sets = []
    for name in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[name], dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"rope_scaling.{name} has {ext.numel()} entries; the rotary dimension "
                             f"{dim} needs {dim // 2}")
        sets.append(1.0 / (ext * theta ** shape))
    return sets[0], sets[1], float(attention), original


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                     max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "dynamic":
        seq_len = max_position_embeddings  # see module docstring
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope_type == "longrope":
        raise ValueError("longrope has two frequency sets: use longrope_inv_freqs")
    if rope_type == "llama3":
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """What cos and sin are multiplied by: 1 except for yarn."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_softmax_scale(scale: float, scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """A softmax scale corrected by ``mscale_all_dim`` squared (DeepSeek's yarn); unchanged otherwise."""
    if scaling is None or scaling["rope_type"] == "default" or not scaling.get("mscale_all_dim"):
        return scale
    m = yarn_mscale(_yarn_factor(scaling, max_position_embeddings), scaling["mscale_all_dim"])
    return scale * m * m


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int) -> torch.Tensor:
    factor = _yarn_factor(scaling, max_position_embeddings)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1 - ramp  # 1: keep the original frequency, 0: interpolate fully
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for positions ``[0, max_position)`` (longrope: both sets, ``table_rows``);
    ``forward(positions, q, k)`` rotates q and k.

    q: ``[..., num_heads, head_dim]``, k: ``[..., num_kv_heads, head_dim]``, positions: ``[...]``.
    Positions outside the cache are not checked (no host sync); the caller keeps them in range. (The
    CPU's call, which reads them on the host anyway, raises IndexError for them.)
    """

    # ``(positions, q, k, cos, sin)`` -> rotated ``(q, k)``, or None for tensors it does not take; set by the
    # backend after loading (the CPU's fused call, ``device/cpu_layer_ops.py``). None: torch's code.
    kernel = None

    def __init__(self, head_dim: int, max_position: int, theta: float = 10000.0,
                 scaling: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        # longrope: rows from this position on in the table are the long set's (see the module docstring).
        self.long_from: int | None = None
        t = torch.arange(max_position, dtype=torch.float32)
        if scaling is not None and scaling["rope_type"] == "longrope":
            short, long, attention, self.long_from = longrope_inv_freqs(self.rotary_dim, theta, scaling,
                                                                        max_position)
            freqs = torch.cat([torch.outer(t[:self.long_from], short), torch.outer(t, long)])
        else:
            attention = attention_factor(scaling, max_position)  # yarn's, else 1
            freqs = torch.outer(t, compute_inv_freq(self.rotary_dim, theta, scaling, max_position))  # fp32
        # Scaled (longrope, yarn), then cast, as transformers does (cos * attention_scaling, then .to(x.dtype)).
        self.register_buffer("cos", (freqs.cos() * attention).to(dtype).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention).to(dtype).to(device), persistent=False)

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The table row of each position ``[B, S]``: the position itself, or with longrope, in a row
        whose largest position reaches ``long_from``, the position's row in the long set. A position
        given plus ``max_position`` (`shard/inputs.py`, ``mark_long_rows``: a chunk of a prompt longer
        than the original length) names its long row, and makes its row long."""
        if self.long_from is None:
            return positions
        last = positions.amax(dim=-1, keepdim=True) if positions.dim() > 1 else positions
        marked = (positions >= self.max_position).to(positions.dtype)
        long = (last >= self.long_from).to(positions.dtype)
        return positions - marked * self.max_position + long * self.long_from

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        rows = self.table_rows(positions)
        if self.rotary_dim < self.head_dim:
            r = self.rotary_dim
            q_rot, k_rot = self._rotate_both(rows, q[..., :r], k[..., :r])
            return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return self._rotate_both(rows, q, k)

    def _rotate_both(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.kernel is not None:
            rotated = self.kernel(rows, q, k, self.cos, self.sin)
            if rotated is not None:
                return rotated
        # Looked up per layer, not cached across layers: a device graph captured on a cache hit would
        # bake in the rows of the positions it was captured with.
        cos = self.cos[rows].unsqueeze(-2)  # [..., 1, D/2]
        sin = self.sin[rows].unsqueeze(-2)
        # q and k rotated as one tensor: half the small operators a decode step runs per layer.
        heads = q.shape[-2]
        both = self._rotate(torch.cat((q, k), dim=-2), cos, sin)
        return both[..., :heads, :], both[..., heads:, :]
