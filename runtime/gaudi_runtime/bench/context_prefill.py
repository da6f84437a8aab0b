"""Time a prefill over cached blocks in this process, per attention kernel, against the same prompt
computed whole.

    python -m gaudi_runtime.bench.context_prefill --model-id DIR [--new 112] [--cached 1184] [--batch 1]

No router, no gRPC: the model's forward pass over a KV cache filled with noise. ``matmuls`` runs the
context attention as the CPU shard does on a CPU with native bfloat16 (`grouped_context_attention`),
``sdpa`` as torch's flash kernel; ``whole`` is a plain prefill of all ``cached + new`` tokens, what
the same prompt costs without the prefix cache, its causal attention run as the CPU shard runs it in
bfloat16 (`chunked_causal_attention`), and ``whole-flash`` the same through torch's flash kernel.
Variants are interleaved, repetition by repetition, so that a noisy machine hurts them alike; the
minimum and the median are printed (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gaudi_runtime.buckets import ceil_div
from gaudi_runtime.device.cpu_attention import CpuAttention
from gaudi_runtime.device.cpu_gemm import prepack_linears
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.attention import AttentionMetadata, use_attention
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.models.registry import load_model

BLOCK = 16


def context_inputs(batch: int, new: int, cached: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Rows of `new` tokens after `cached` ones, each row in its own blocks (block 0 is the trash block)."""
    nb = ceil_div(cached + new, BLOCK)
    tables = torch.arange(1, 1 + batch * nb).view(batch, nb)
    pos = cached + torch.arange(new)
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
    context = tables[:, : cached // BLOCK]
    return (torch.randint(0, vocab, (batch, new)), pos.expand(batch, new), slots, context,
            torch.full((batch,), cached))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=112, help="tokens computed")
    ap.add_argument("--cached", type=int, default=1184, help="tokens read from cached blocks (whole blocks)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.cached % BLOCK:
        ap.error(f"--cached must be a multiple of the block size ({BLOCK})")
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_host_allocator()
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model_id, dtype, torch.device("cpu"))
    prepack_linears(model, release=False)
    total = args.cached + args.new
    kv = allocate_kv_cache(model.num_layers, 1 + args.batch * ceil_div(total, BLOCK), BLOCK, model.num_kv_heads,
                           model.head_dim, dtype, torch.device("cpu"))
    for k, v in kv:
        k.normal_()
        v.normal_()
    ids, pos, slots, context, context_lens = context_inputs(args.batch, args.new, args.cached, model.vocab_size)
    whole = context_inputs(args.batch, total, 0, model.vocab_size)

    # The CPU backend's kernels with the matmul prefills (as on a CPU with native bfloat16) and without.
    matmuls, flash = CpuAttention(bf16_matmuls=True), CpuAttention()

    def over_cache(backend):
        use_attention(model, backend)
        meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=context, context_lens=context_lens)
        return model.compute_logits(model(ids, pos, kv, meta)[:, -1])

    def computed_whole(backend):
        use_attention(model, backend)
        meta = AttentionMetadata(is_prefill=True, slots=whole[2])
        return model.compute_logits(model(whole[0], whole[1], kv, meta)[:, -1])

    variants = {"matmuls": lambda: over_cache(matmuls), "sdpa": lambda: over_cache(flash),
                "whole": lambda: computed_whole(matmuls), "whole-flash": lambda: computed_whole(flash)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in variants.items():
                run()
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
    print(f"{'batch':>5} {'new':>5} {'cached':>6} {'kernel':<11} {'min ms':>8} {'median ms':>9}  ({args.dtype})")
    for name, ts in times.items():
        print(f"{args.batch:>5} {args.new:>5} {args.cached:>6} {name:<11} {min(ts):>8.2f} {statistics.median(ts):>9.2f}")


if __name__ == "__main__":
    main()
