"""Time one decode step of the model in this process, per batch size and attention kernel.

    python -m gaudi_runtime.bench.decode_step --model-id DIR [--batch 1 16 64] [--context 256] [--profile]

No router, no gRPC: the shard's own step function over a KV cache filled with noise, so the
numbers are the model's forward pass and nothing else (docs/performance.md). Variants (decode
attention: ``paged`` reads the cache in place with the C kernel, ``sdpa`` and ``grouped`` run over
the gathered blocks; linear layers as the CPU backend sets them up, one-row products through the C
kernel, or ``no-gemv`` without it, or ``torch-linear`` F.linear for every product; ``batch-invariant``: every
product through the fixed-order kernel, as --batch-invariant runs them; ``plain``: the gather
and F.linear; norms, rotary and cache writes through one C call each, ``torch-layer-ops`` in torch) are
interleaved, repetition by repetition, so that a noisy machine hurts them alike; the minimum
and the median of the repetitions are printed. ``--profile`` adds torch.profiler's top
operators for each batch size with the kernels the CPU backend selects.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gaudi_runtime.buckets import ceil_div
from gaudi_runtime.device import cpu_gemm, cpu_gemv, cpu_gptq, cpu_layer_ops, cpu_moe, cpu_paged_attention
from gaudi_runtime.device.cpu import experts_kernel
from gaudi_runtime.device.cpu_attention import CpuAttention
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.attention import AttentionMetadata, use_attention
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.kernels import LayerKernels, install_kernels
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.models.registry import load_model

BLOCK = 16
# name: (attention: "paged" reads the cache in place, "grouped" the CPU's decode over the gathered blocks,
# "sdpa" torch SDPA over them; linear layers' kernels: "gemv" as the CPU backend sets them up, "no-gemv"
# without the one-row kernel, "fixed" the batch-invariant mode's, "torch" F.linear; norms, rotary and cache writes through the layer operations
# kernel)
VARIANTS = {"paged": ("paged", "gemv", True),
            "torch-layer-ops": ("paged", "gemv", False),
            "no-gemv": ("paged", "no-gemv", True),
            "torch-linear": ("paged", "torch", True),
            "batch-invariant": ("paged", "fixed", True),
            "sdpa": ("sdpa", "gemv", True),
            "grouped": ("grouped", "gemv", True),
            "plain": ("grouped", "torch", False)}


def attention_backends() -> dict[str, AttentionBackend]:
    """The attention VARIANTS name: without a compiler "paged" is the gather (warned once), as on a shard."""
    paged = cpu_paged_attention.kernel()
    return {"paged": CpuAttention(paged), "grouped": CpuAttention(), "sdpa": AttentionBackend()}


def step_inputs(batch: int, context: int, vocab: int):
    """A batch whose rows each hold `context` tokens in their own blocks (block 0 is the trash block)."""
    nb = ceil_div(context, BLOCK)
    tables = torch.arange(1, 1 + batch * nb).view(batch, nb)
    ctx = torch.full((batch,), context)
    slots = tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    return torch.randint(0, vocab, (batch,)), ctx - 1, slots, tables, ctx


def linear_variants(model):
    """A function that sets every linear layer's kernels as a VARIANTS entry names them (a GPTQ layer's
    packed-weight kernel in "gemv" and "no-gemv", as the CPU backend installs it)."""
    packed = cpu_gptq.gptq_kernels(model)
    kernels = {"no-gemv": {**cpu_gemm.linear_kernels(model, release=False, few_rows=False), **packed},
               "gemv": {**cpu_gemm.linear_kernels(model, release=False), **packed}, "torch": {}}
    gemv = cpu_gemv.kernel()
    if gemv is not None:
        kernels["fixed"] = cpu_gemm.fixed_order_kernels(model, gemv)

    def use_linears(name: str) -> None:
        install_kernels(model, LayerKernels(linear=kernels[name].get), clear=("linear",))
    return use_linears


def layer_ops(model):
    """A function that gives the model's norms, rotary and attention modules the layer operations kernel's
    calls (True) or leaves them to torch (False)."""
    ops = cpu_layer_ops.kernel()
    return lambda on: cpu_layer_ops.set_layer_ops(model, ops if on else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="steps timed per repetition")
    ap.add_argument("--default-allocator", action="store_true", help="keep glibc's malloc defaults")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = ap.parse_args()
    backends = attention_backends()
    if not args.default_allocator:
        tune_host_allocator()
    model = load_model(args.model_id, getattr(torch, args.dtype), torch.device("cpu"))
    use_linears = linear_variants(model)
    use_ops = layer_ops(model)
    # A MoE model's experts as the CPU backend runs them.
    install_kernels(model, LayerKernels(experts=experts_kernel(cpu_gemv.kernel(), cpu_moe.kernel())))
    blocks = 1 + max(args.batch) * ceil_div(args.context, BLOCK)
    kv = allocate_kv_cache(model.num_layers, blocks, BLOCK, model.num_kv_heads, model.head_dim,
                           getattr(torch, args.dtype), torch.device("cpu"))
    for k, v in kv:
        k.normal_()
        v.normal_()
    vocab = model.vocab_size

    def step(input_ids, positions, slots, tables, context_lens):
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables,
                                 context_lens=context_lens)
        return model.compute_logits(model(input_ids[:, None], positions[:, None], kv, meta)[:, -1])

    print(f"{'batch':>5} {'kernel':<12} {'min ms':>8} {'median ms':>9}  (context {args.context}, {args.dtype})")
    with torch.inference_mode():
        for batch in args.batch:
            inputs = step_inputs(batch, args.context, vocab)
            times: dict[str, list[float]] = {name: [] for name in args.variants}
            for _ in range(args.repeats):
                for name in args.variants:
                    kind, linears, ops = VARIANTS[name]
                    use_attention(model, backends[kind])
                    use_linears(linears)
                    use_ops(ops)
                    step(*inputs)
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        step(*inputs)
                    times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            for name, ts in times.items():
                print(f"{batch:>5} {name:<12} {min(ts):>8.2f} {statistics.median(ts):>9.2f}")
            if args.profile:
                use_attention(model, backends["paged"])
                use_linears("gemv")
                use_ops(True)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        step(*inputs)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
