"""Tensor-parallel linear layers (nano-vllm style).

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])``
that copies only this rank's slice of a full checkpoint tensor into the
parameter (casting dtype and moving to the parameter's device on the way).

With ``tp.size == 1`` no ``torch.distributed`` function is ever called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .lora import LoraWeights


@dataclass(frozen=True)
class TPContext:
    """Which tensor-parallel rank this process is, and the group to talk over."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


class LazyWeight:
    """A checkpoint tensor not read yet (a ``safetensors`` slice): ``narrow`` composes, ``load`` reads.

    Weight loaders accept either a real tensor or one of these, so each rank reads only its own slice.
    """

    def __init__(self, source, shape, index: tuple[slice, ...] | None = None):
        self._source = source  # anything indexable by a tuple of slices (safetensors PySafeSlice, tensor)
        self.shape = torch.Size(shape)
        self._index = index if index is not None else tuple(slice(0, n) for n in self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim = dim % self.dim()
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        base = self._index[dim].start
        index = list(self._index)
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyWeight(self._source, shape, tuple(index))

    def load(self) -> torch.Tensor:
        return self._source[self._index]


def materialize(x) -> torch.Tensor:
    return x.load() if isinstance(x, LazyWeight) else x


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def _param(*shape: int) -> nn.Parameter:
    # Created on whatever default device is active (the loader builds on "meta" and materializes later).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.data.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


class LinearBase(nn.Module):
    # ``(x, bias) -> x @ W.T + bias`` over a copy of the weight laid out for the device's kernels, set by
    # the backend after loading (``layers/kernels.install_kernels``); None: ``F.linear`` over ``self.weight``.
    kernel: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def __init__(self, tp: TPContext, tp_dim: int | None):
        super().__init__()
        self.tp = tp
        self.tp_dim = tp_dim
        self.lora: LoraWeights | None = None  # the adapters targeting this layer (models/lora.py attaches them)

    def _make(self, out_features: int, in_features: int, bias: bool) -> None:
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:  # pragma: no cover
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, bias)
        return F.linear(x, self.weight, bias)

    def with_adapters(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``, this layer's output for ``x``, plus each row's adapter's (layers/lora.py)."""
        return y if self.lora is None else self.lora.add(x, y)

    def lora_output_slices(self) -> list[tuple[object, int, int, int]] | None:
        """Where each fused projection's LoRA B goes: ``(shard id, offset in this rank's output, start in
        the checkpoint's output, size)``; None for a row-parallel layer (its A is sliced instead)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_adapters(x, self.matmul(x, self.bias))


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPContext = TPContext()):
        super().__init__(tp, None)
        self._make(output_size, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param, loaded)

    def lora_output_slices(self) -> list[tuple[object, int, int, int]]:
        n = self.weight.shape[0]
        return [(None, 0, 0, n)]


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPContext = TPContext()):
        super().__init__(tp, 0)
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, tp.size, "output size")
        self._make(self.output_size_per_rank, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.data.size(0)
        _copy(param, loaded.narrow(0, self.tp.rank * n, n))

    def lora_output_slices(self) -> list[tuple[object, int, int, int]]:
        n = self.output_size_per_rank
        return [(None, 0, self.tp.rank * n, n)]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate/up).

    The per-rank weight is ``[shard0_rank_slice; shard1_rank_slice; ...]``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPContext = TPContext()):
        self.output_sizes = list(output_sizes)
        for s in self.output_sizes:
            divide(s, tp.size, "output size")
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """One projection's checkpoint tensor (``shard_id``), or with None the checkpoint's own fused
        tensor (Phi-3's ``gate_up_proj``: the projections' rows one after the other), cut the same way."""
        if shard_id is None:
            if loaded.shape[0] != sum(self.output_sizes):
                raise ValueError(f"fused projection has {loaded.shape[0]} rows, expected "
                                 f"{' + '.join(map(str, self.output_sizes))}")
            start = 0
            for i, total in enumerate(self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, start, total), i)
                start += total
            return
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        size = self.output_sizes[shard_id] // self.tp.size
        _copy_into(param, offset, size, loaded.narrow(0, self.tp.rank * size, size))

    def lora_output_slices(self) -> list[tuple[object, int, int, int]]:
        out, offset = [], 0
        for shard_id, total in enumerate(self.output_sizes):
            size = total // self.tp.size
            out.append((shard_id, offset, self.tp.rank * size, size))
            offset += size
        return out


def _copy_into(param: nn.Parameter, offset: int, size: int, loaded: torch.Tensor) -> None:
    dst = param.data.narrow(0, offset, size)
    if dst.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    dst.copy_(materialize(loaded))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads.

    Query heads are split evenly. KV heads are split evenly when
    ``total_num_kv_heads >= tp.size``; otherwise each KV head is replicated on
    ``tp.size // total_num_kv_heads`` consecutive ranks (rank r holds KV head
    ``r // replicas``), which keeps every rank's query heads inside the GQA
    group of the KV head it holds.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, tp: TPContext = TPContext()):
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp.size, "number of attention heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "number of key/value heads")
            self.kv_replicas = 1
        else:
            if tp.size % total_num_kv_heads != 0:
                raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of the number of "
                                 f"key/value heads {total_num_kv_heads}")
            self.num_kv_heads = 1
            self.kv_replicas = tp.size // total_num_kv_heads
        self.kv_head_start = (tp.rank // self.kv_replicas) * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, tp, 0)
        self.input_size = hidden_size
        self.output_size_per_rank = self.q_size + 2 * self.kv_size
        self._make(self.output_size_per_rank, hidden_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size, start = self.q_size + self.kv_size, self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        _copy_into(param, offset, size, loaded.narrow(0, start, size))

    def lora_output_slices(self) -> list[tuple[object, int, int, int]]:
        kv_start = self.kv_head_start * self.head_dim
        return [("q", 0, self.tp.rank * self.q_size, self.q_size), ("k", self.q_size, kv_start, self.kv_size),
                ("v", self.q_size + self.kv_size, kv_start, self.kv_size)]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results all-reduced (tp > 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPContext = TPContext()):
        super().__init__(tp, 1)
        self.input_size_per_rank = divide(input_size, tp.size, "input size")
        self.output_size = output_size
        self._make(output_size, self.input_size_per_rank, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.data.dim() == 1:  # bias: full copy on every rank, added once (rank 0) in forward
            _copy(param, loaded)
            return
        n = param.data.size(1)
        _copy(param, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # This rank's share of the adapters' product joins the all-reduce with the layer's own.
        y = self.with_adapters(x, self.matmul(x, self.bias if self.tp.rank == 0 else None))
        return self.tp.all_reduce(y)
