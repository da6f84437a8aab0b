"""A checkpoint's single fused q/k/v projection (Falcon ``query_key_value``, GPTBigCode ``c_attn``), split by heads.

Two row layouts occur in checkpoints, in units of ``head_dim`` rows:

* ``grouped``: for each KV head in turn, the query heads of its group, then its
  key head, then its value head. Falcon's new decoder architecture
  (Falcon-40B/180B, group = heads / kv_heads) and the models without
  multi-query attention (group 1: q, k, v per head) store it this way.
* ``stacked``: every query head, then every key head, then every value head
  (Phi-3's ``qkv_proj``); ``multi_query`` is this layout with one key/value
  head (Falcon-7B, Starcoder).

Each rank keeps ``QKVParallelLinear``'s per-rank layout ``[its q heads; its k
heads; its v heads]`` (KV heads replicated when there are fewer than ranks),
so attention code splits it the same way; only the loader knows the layout.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import QKVParallelLinear, TPContext, _copy_into

LAYOUTS = ("grouped", "multi_query", "stacked")


def source_heads(layout: str, num_heads: int, num_kv_heads: int) -> tuple[list[int], list[int], list[int]]:
    """Checkpoint row block (in heads) of every query, key and value head, for ``layout``."""
    if layout in ("multi_query", "stacked"):
        if layout == "multi_query" and num_kv_heads != 1:
            raise ValueError(f"the multi_query layout has 1 key/value head, not {num_kv_heads}")
        k = [num_heads + g for g in range(num_kv_heads)]
        return list(range(num_heads)), k, [i + num_kv_heads for i in k]
    if layout != "grouped":
        raise ValueError(f"unknown fused qkv layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    q = [(h // group) * (group + 2) + h % group for h in range(num_heads)]
    k = [g * (group + 2) + group for g in range(num_kv_heads)]
    return q, k, [i + 1 for i in k]


def row_copies(sources: list[int], head_dim: int) -> list[tuple[int, int, int]]:
    """``(dst_row, src_row, rows)`` copies that put head block ``sources[i]`` at block ``i``, runs merged."""
    runs: list[list[int]] = []
    for dst, src in enumerate(sources):
        if runs and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [(d * head_dim, s * head_dim, n * head_dim) for d, s, n in runs]


class FusedQKVParallelLinear(QKVParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 layout: str, bias: bool = False, tp: TPContext = TPContext()):
        super().__init__(hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=bias, tp=tp)
        q, k, v = source_heads(layout, total_num_heads, total_num_kv_heads)
        mine_q = q[tp.rank * self.num_heads:(tp.rank + 1) * self.num_heads]
        kv = slice(self.kv_head_start, self.kv_head_start + self.num_kv_heads)
        self.layout = layout
        self.copies = row_copies(mine_q + k[kv] + v[kv], head_dim)
        self.total_rows = (total_num_heads + 2 * total_num_kv_heads) * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:  # type: ignore[override]
        if loaded.shape[0] != self.total_rows:
            raise ValueError(f"fused qkv ({self.layout}) has {loaded.shape[0]} rows, expected {self.total_rows} "
                             f"({self.total_num_heads} query + 2 x {self.total_num_kv_heads} key/value heads "
                             f"of {self.head_dim})")
        for dst, src, rows in self.copies:
            _copy_into(param, dst, rows, loaded.narrow(0, src, rows))
