"""LoRA adapters on the linear layers, many in one batch (punica / S-LoRA style).

Every row of a batch carries an adapter slot (0: none). A linear layer some adapter targets holds,
for every slot, the adapters' A and B stacked and padded to the largest rank, slot 0 all zeros, and
adds ``(x @ A[slot]) @ B[slot]`` per row: one gather and two batched matmuls, whatever the mix of
adapters in the batch, with shapes that depend only on the batch's (no host sync, nothing per row
in Python). The adapter's scale is folded into B when it is loaded.
A device may swap in a kernel of its own for this product (``LoraWeights.kernel``): the CPU's groups the
rows by slot and reads each adapter once (device/cpu_lora.py); the gathered bmm stays the static-shaped
path that graphs (HPU, CUDA) capture.

A fused layer (q/k/v, gate/up) has one LoRA per projection it fuses: their A matrices sit side by
side (``slices * max_rank`` columns) and their B matrices on the block diagonal, each writing its
own projection's output columns, so the fused layer still does one gather and two matmuls.

Tensor parallelism slices them as the layer: a column-parallel layer keeps the whole A and its
rank's output columns of B; a row-parallel layer keeps its rank's input rows of A and the whole B,
and its partial product is added before the layer's all-reduce (the sum over ranks is exact).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class AdapterRows:
    """Which adapter slot each row of the running step uses: one object shared by every LoRA layer of
    a model, set by the step function before the forward pass (so a captured graph takes it as an input)."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None  # [rows] int64; None: no row uses an adapter


class LoraWeights(nn.Module):
    """One linear layer's stacked adapters: ``a`` [slots, in, slices * rank], ``b`` [slots, slices * rank, out]."""

    # ``(lora, x, y, index) -> y`` with each row's adapter's product added (into `y` itself or not), set by
    # the device backend (``layers/kernels.install_kernels``); it returns None for tensors it does not take, and the
    # gathered bmm of `delta` runs instead. None: always that bmm.
    kernel: Callable[[LoraWeights, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, rows: AdapterRows, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.rows = rows
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``, the layer's output for ``x`` [rows, seq, in], plus each row's adapter's product (the
        layer's own output tensor may be added to in place: nothing else holds it)."""
        index = self.rows.index
        if index is None:
            return y
        if self.kernel is not None:
            out = self.kernel(self, x, y, index)
            if out is not None:
                return out
        return y + self.delta(x, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' addition to the layer's output for ``x`` [rows, seq, in]; None when no row has one."""
        index = self.rows.index
        return None if index is None else self.delta(x, index)

    def delta(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``(x @ A[slot]) @ B[slot]`` per row: one gather and two bmm, shapes fixed by the batch's."""
        a = self.a.index_select(0, index)
        b = self.b.index_select(0, index)
        return torch.bmm(torch.bmm(x, a), b)


def stacked(slots: int, in_features: int, out_features: int, slices: int, rank: int,
            dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero A and B for ``slots`` slots (slot 0 included) of a layer fusing ``slices`` projections."""
    a = torch.zeros(slots, in_features, slices * rank, dtype=dtype, device=device)
    b = torch.zeros(slots, slices * rank, out_features, dtype=dtype, device=device)
    return a, b
