"""GPTQ checkpoints (4 and 8 bit; any group size, -1 included; desc_act; symmetric or not), weights kept packed.

On disk (AutoGPTQ's `gptq` format): ``qweight`` int32 ``[in / p, out]`` with p = 32 / bits values of
consecutive input rows per word, lowest bits first; ``qzeros`` int32 ``[groups, out / p]`` packed along
the output, each stored one below the zero it means; ``scales`` ``[groups, out]``; ``g_idx`` int32
``[in]``, each input row's group. ``w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``.

Held per rank: ``qweight`` transposed to ``[out, in / p]`` (still packed: the layer's own loader slices
it like a weight, rows for column-parallel layers, packed columns for row-parallel ones), zeros unpacked
to int16 and scales as ``[out, groups]`` (small), and one ``g_idx`` row per fused projection (q, k, v
or gate, up each carry their own order under desc_act). A row-parallel layer keeps every group's
scales and zeros and slices only ``g_idx``: with desc_act a rank's input rows belong to any group.

The product dequantizes this one layer's weight to the activation dtype and multiplies, unless the
device gave the layer a kernel for these rows (CPU: ``device/cpu_gptq.py`` reads only the packed words).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from gaudi_runtime.config import ConfigError
from gaudi_runtime.layers.linear import (
    LazyWeight,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from gaudi_runtime.quant.checkpoint import CheckpointQuant
from gaudi_runtime.quant.packing import pack, unpack

log = logging.getLogger(__name__)


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               segments: list[tuple[int, int]], bits: int, dtype: torch.dtype, perms: list | None = None) -> torch.Tensor:
    """The ``[out, in]`` weight of packed ``[out, in / p]`` values, ``[out, groups]`` zeros and scales, and
    each output segment's ``g_idx`` row; a segment whose columns were sorted by group (``perms``, see
    ``quant.packing.sort_groups``) is put back in the input's order."""
    q = unpack(qweight, bits)
    w = torch.empty(q.shape, dtype=dtype, device=q.device)
    for seg, (start, size) in enumerate(segments):
        g = g_idx[seg].long()
        rows = slice(start, start + size)
        z, s = zeros[rows][:, g], scales[rows][:, g]
        values = ((q[rows].float() - z.float()) * s.float()).to(dtype)
        if perms is not None and perms[seg] is not None:
            w[rows][:, perms[seg]] = values  # stored column k is input column perm[k]
        else:
            w[rows] = values
    return w


class _Transposed:
    """A checkpoint tensor ``[a, b]`` seen as ``[b, a]`` (indexable by a tuple of two slices)."""

    def __init__(self, source):
        self.source = source

    def __getitem__(self, index):
        return self.source[(index[1], index[0])].t().contiguous()


class GptqMixin:
    qweight: nn.Parameter
    bits: int
    segments: list[tuple[int, int]]
    perms: list | None = None  # per segment: the input column of each stored column (``quant.packing.sort_groups``)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:  # the device's packed product (CPU: device/cpu_gptq.py), None: not these rows
            y = self.kernel(x, bias)
            if y is not None:
                return y
        w = dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.segments, self.bits, x.dtype,
                       self.perms)
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        return f"gptq int{self.bits} packed {tuple(self.qweight.shape)}, scales {tuple(self.scales.shape)}"


_CLASSES: dict[type, type] = {}


def _class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Gptq{cls.__name__}", (GptqMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _segments(m: LinearBase) -> tuple[list[tuple[int, int]], list]:
    """This rank's output rows per fused projection, and the projections' shard ids in that order."""
    if isinstance(m, QKVParallelLinear) and not hasattr(m, "total_rows"):
        return [(0, m.q_size), (m.q_size, m.kv_size), (m.q_size + m.kv_size, m.kv_size)], ["q", "k", "v"]
    if isinstance(m, MergedColumnParallelLinear):
        sizes = [s // m.tp.size for s in m.output_sizes]
        return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)], list(range(len(sizes)))
    return [(0, m.weight.shape[0])], [None]


def _materialize(loaded) -> torch.Tensor:
    return loaded.load() if isinstance(loaded, LazyWeight) else loaded


def gptq_zeros(bits: int):
    """GPTQ's zeros: packed along the output, each word stored as the packed zeros minus one in every field,
    borrows included (how gptqmodel, which makes these checkpoints, writes its `gptq` format); read as it
    reads them, one added to every field of the whole word with its carries. The same as one more per field
    unless a zero is 0: its field holds all ones and the field above one less."""
    ones = sum(1 << k for k in range(0, 32, bits))

    def read(t: torch.Tensor) -> torch.Tensor:
        word = (t.to(torch.int64) + ones) & 0xFFFFFFFF
        return unpack(torch.where(word >= 2**31, word - 2**32, word).to(torch.int32), bits).to(torch.int16)
    return read


def _group_loader(m: LinearBase, convert=None):
    """Zeros or scales, ``[groups, out]`` on disk once `convert`ed, into ``[out, groups]``: sliced by output
    like a weight; a row-parallel or replicated layer takes all."""
    def load(param: nn.Parameter, loaded, *shard) -> None:
        t = _materialize(loaded)
        t = (t if convert is None else convert(t)).t().contiguous()
        if isinstance(m, (RowParallelLinear, ReplicatedLinear)):
            if t.shape != param.shape:
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(t.shape)}")
            param.data.copy_(t)
        else:
            m.weight_loader(param, t, *shard)
    return load


def _g_idx_loader(m: LinearBase, shard_ids: list):
    def load(param: nn.Parameter, loaded, *shard) -> None:
        t = _materialize(loaded)
        if isinstance(m, RowParallelLinear):
            n = param.shape[1]
            t = t[m.tp.rank * n:(m.tp.rank + 1) * n]
        param.data[shard_ids.index(shard[0] if shard else None)] = t.to(param.dtype)
    return load


def _param(shape, dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def to_gptq(name: str, m: LinearBase, found: CheckpointQuant, in_total: int) -> None:
    """Replace `m`'s weight by GPTQ's packed parameters (in place), ready for the checkpoint."""
    bits = int(found.weights.removeprefix("int"))
    pack = 32 // bits
    out, cols = m.weight.shape
    group = in_total if found.group_size == -1 else found.group_size
    if cols % pack or in_total % group:
        raise ConfigError(f"layer {name}: {cols} input columns per rank do not fit {bits}-bit packing and "
                          f"groups of {group}")
    groups = in_total // group
    segments, shard_ids = _segments(m)
    device = m.weight.device
    loader = m.weight_loader
    del m.weight
    m.__class__ = _class(type(m))
    m.bits, m.segments = bits, segments

    def load_qweight(param, loaded, *shard):
        source = loaded._source if isinstance(loaded, LazyWeight) else loaded  # a whole checkpoint tensor
        loader(param, LazyWeight(_Transposed(source), tuple(reversed(loaded.shape))), *shard)

    m.qweight = _param((out, cols // pack), torch.int32, device, load_qweight)
    m.qzeros = _param((out, groups), torch.int16, device, _group_loader(m, gptq_zeros(bits)))
    m.scales = _param((out, groups), torch.float32, device, _group_loader(m))
    m.g_idx = _param((len(segments), cols), torch.int32, device, _g_idx_loader(m, shard_ids))


# AutoAWQ's GEMM layout packs 8 output columns per word in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 ``[n, out / 8]`` -> 4-bit values ``[n, out]`` (uint8) in output order."""
    nibbles = unpack(packed, 4).view(packed.shape[0], -1, 8)
    values = torch.empty_like(nibbles)
    values[:, :, list(AWQ_ORDER)] = nibbles
    return values.view(packed.shape[0], -1)


def to_awq(name: str, m: LinearBase, found: CheckpointQuant, in_total: int) -> None:
    """AWQ (4-bit GEMM: ``qweight`` ``[in, out / 8]`` and ``qzeros`` packed along the output in AWQ_ORDER,
    zeros as they are, groups of consecutive input rows): held as GPTQ's layout, repacked at load."""
    to_gptq(name, m, found, in_total)

    def load_qweight(param, loaded, *shard):
        m.weight_loader(param, pack(unpack_awq(_materialize(loaded)).t(), 4), *shard)

    m.qweight.weight_loader = load_qweight
    m.qzeros.weight_loader = _group_loader(m, lambda t: unpack_awq(t).to(torch.int16))
    group = in_total if found.group_size == -1 else found.group_size
    first = m.tp.rank * m.g_idx.shape[1] if isinstance(m, RowParallelLinear) else 0
    g_idx = ((first + torch.arange(m.g_idx.shape[1])) // group).to(torch.int32).expand_as(m.g_idx).contiguous()
    del m.g_idx  # AWQ stores no g_idx: a buffer, not a weight the checkpoint must hold
    m.register_buffer("g_idx", g_idx.to(m.qweight.device))


def prepare_gptq(model: nn.Module, found: CheckpointQuant) -> int:
    """Every linear layer but the LM head holds GPTQ's (or AWQ's) packed weights, as their libraries write them."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    convert = to_awq if found.method == "awq" else to_gptq
    for name, m in layers:
        in_total = m.weight.shape[1] * (m.tp.size if isinstance(m, RowParallelLinear) else 1)
        convert(name, m, found, in_total)
    log.info("%d linear layers hold %s weights packed (%s)", len(layers), found.weights, found.describe())
    return len(layers)
