"""The memory-bandwidth floor of one decode step on this machine.

    python -m gaudi_runtime.bench.memory_floor --model-id DIR [--dtype bfloat16] [--context 192] [--threads 1 2]

A decode step at batch 1 reads every weight its linear layers and its head use once, plus the KV
cache of its context; nothing it computes comes close to the arithmetic the cores can do. Those
bytes divided by the read bandwidth the machine measures give the fastest a step can be, whatever
the engine: a measured time per token over this floor is what the engine spends besides reading
memory. The embedding table is not counted (a step reads one row of it) unless the head shares it.
"""

from __future__ import annotations

import argparse
import time

import torch

from gaudi_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gaudi_runtime.layers.kv_cache import cache_bytes_per_block, model_token_shapes
from gaudi_runtime.models.registry import load_model

BUFFER_BYTES = 1 << 30  # well past any last-level cache, so the sum streams from memory


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decode step reads: all but the input embedding, unless the head is tied to it."""
    total = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            continue  # a lookup; a head tied to it holds the same tensor and counts it
        for p in module.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    return cache_bytes_per_block(model.num_layers, 1, model_token_shapes(model), dtype)


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second a float32 sum streams from memory with `threads` torch threads (the best of `repeats`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return BUFFER_BYTES / best
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=192, help="tokens in the KV cache the step reads")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model_id, dtype, torch.device("cpu"))
    weights = weight_bytes_per_step(model)
    kv = kv_bytes_per_token(model, dtype) * args.context
    print(f"weights read per step {weights / 1e6:.1f} MB, KV cache at context {args.context} {kv / 1e6:.1f} MB")
    for threads in dict.fromkeys(args.threads):
        bw = read_bandwidth(threads)
        print(f"RESULT threads={threads} read_GBps={bw / 1e9:.1f} floor_ms={(weights + kv) / bw * 1e3:.2f}")


if __name__ == "__main__":
    main()
