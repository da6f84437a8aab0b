"""Time one layer's decode attention on a CPU: the paged C kernel against the gather path.

    python -m gaudi_runtime.bench.decode_attention [--batch 1 4 16 48] [--context 128 512 1600] [--threads 1 2]

The shapes default to the reference ``small`` model's (8 layers, 8 query heads, 4 KV heads, head
size 64, bfloat16, blocks of 16). Each sequence's blocks are spread over the cache in random order,
and each call goes to the next layer's cache, as a decode step does (so that a cache that fits the
CPU's last-level cache alone is not read from there every time). The two paths are
`Attention._decode` with and without the kernel, alternated repetition by repetition so that a busy
machine hurts them alike; the minimum and the median per call are printed with the load average
(docs/performance.md, "Paged decode attention on CPU"). glibc's malloc is tuned as the shard tunes
it, so that the gather's copies do not fault in fresh pages every call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gaudi_runtime.buckets import ceil_div
from gaudi_runtime.device import cpu_paged_attention
from gaudi_runtime.device.cpu_attention import CpuAttention
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.attention import Attention, AttentionMetadata


def problem(batch: int, context: int, heads: int, kv_heads: int, head_size: int, block: int, dtype: torch.dtype,
            layers: int = 1):
    """q, `layers` (k, v) caches and the metadata of one decode step: every row at `context` tokens, its
    blocks in random order."""
    nb = ceil_div(context, block)
    blocks = 1 + batch * nb
    caches = [(torch.randn(blocks, block, kv_heads, head_size).to(dtype),
               torch.randn(blocks, block, kv_heads, head_size).to(dtype)) for _ in range(layers)]
    tables = (torch.randperm(blocks - 1) + 1)[: batch * nb].view(batch, nb)
    q = torch.randn(batch, 1, heads, head_size).to(dtype)
    return q, caches, tables, torch.full((batch,), context)


def time_paths(layer: Attention, inputs, repeats: int, steps: int) -> dict[str, list[float]]:
    """Milliseconds per layer of each path, alternated; a step is one call per layer's cache."""
    q, caches, tables, lens = inputs
    kernel = cpu_paged_attention.kernel()  # None (warned) without a compiler
    paths = {"gather": CpuAttention()}
    if kernel is not None:
        paths["paged"] = CpuAttention(kernel)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, backend in paths.items():
            layer.backend = backend
            start = time.perf_counter()
            for _ in range(steps):
                # One metadata object per step: its first layer builds the gather path's mask.
                meta = AttentionMetadata(is_prefill=False, slots=tables[:, :1], block_tables=tables,
                                         context_lens=lens)
                for k_cache, v_cache in caches:
                    layer._decode(q, k_cache, v_cache, meta)
            times[name].append((time.perf_counter() - start) / (steps * len(caches)) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 48])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512, 1600])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps (a call per layer) timed per repetition")
    args = ap.parse_args()
    tune_host_allocator()
    layer = Attention(args.heads, args.kv_heads, args.head_size)
    print(f"{'threads':>7} {'batch':>5} {'context':>7} {'path':<7} {'min ms':>8} {'median ms':>9}  load  (per layer)")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                for context in args.context:
                    inputs = problem(batch, context, args.heads, args.kv_heads, args.head_size, args.block_size,
                                     getattr(torch, args.dtype), args.layers)
                    time_paths(layer, inputs, 1, 1)  # first calls: allocations, the kernel's library
                    times = time_paths(layer, inputs, args.repeats, args.steps)
                    load = os.getloadavg()[0]
                    for name, ts in times.items():
                        print(f"{threads:>7} {batch:>5} {context:>7} {name:<7} {min(ts):>8.3f} "
                              f"{statistics.median(ts):>9.3f}  {load:.1f}", flush=True)


if __name__ == "__main__":
    main()
