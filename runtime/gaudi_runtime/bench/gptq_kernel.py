"""Time one GPTQ int4 layer's product on a CPU against the same shape in bfloat16.

    python -m gaudi_runtime.bench.gptq_kernel [--shapes 5632x2048 2048x5632] [--rows 1 4 16 17 64] [--threads 1]
    python -m gaudi_runtime.bench.gptq_kernel --threads 2 --wall     # wall time, on a quiet machine

Each shape is a Llama MLP projection (out x in): GPTQ 4-bit, groups of 128, symmetric, no desc_act, random
packed words, through the layer's ``matmul`` with the CPU kernel (``device/cpu_gptq``: up to GEMM_ROWS rows
over the packed words, more dequantized in C then oneDNN); the bfloat16 side is what a bfloat16 layer runs
(the few-row C kernel ``cpu_gemv`` where it takes the rows, else oneDNN over the weight reordered once, as
``cpu_gemm`` installs it). Activations are
bfloat16, as served (``--dtype float32``: the kernel's float path, what a float32 model or a CPU without the
bfloat16 dot product runs, against a float32 layer). Copies of each weight are cycled, enough that the
packed ones alone exceed ``--cache-mb`` (the last-level cache: a served model's weights stream from memory;
from L3 16 rows of int4 ran up to a third faster). Printed per call: the minimum over repetitions of the calling
thread's CPU time (on a shared machine wall time measures the neighbours; ``--wall``: wall time, what
several threads take) and the bytes of weights read per second of it; run with ``--threads 1`` that is one
core's speed. glibc's malloc is tuned as the shard tunes it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from gaudi_runtime.bench.stats import copies_beyond, least_ms
from gaudi_runtime.device import cpu_gemm, cpu_gemv, cpu_gptq
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.linear import ReplicatedLinear
from gaudi_runtime.quant.checkpoint import CheckpointQuant
from gaudi_runtime.quant.gptq import to_gptq


def gptq_layer(out: int, inp: int, group: int = 128) -> ReplicatedLinear:
    """A 4-bit GPTQ layer of random packed words, scales ~0.01, zeros 8, with the CPU kernel."""
    m = ReplicatedLinear(inp, out, bias=False)
    to_gptq("bench", m, CheckpointQuant("gptq", "int4", "group", group_size=group, desc_act=False, sym=True), inp)
    m.qweight.data = torch.randint(-2**31, 2**31 - 1, tuple(m.qweight.shape), dtype=torch.int32)
    m.qzeros.data.fill_(8)
    m.scales.data = torch.rand(tuple(m.scales.shape)) * 0.01
    m.g_idx.data = (torch.arange(inp) // group).to(torch.int32).expand_as(m.g_idx).contiguous()
    cpu_gptq.use_gptq_kernel(m)
    return m


def compare(out: int, inp: int, rows_list: list[int], copies: int, repeats: int,
            clock=time.thread_time, dtype: torch.dtype = torch.bfloat16) -> None:
    layers = [gptq_layer(out, inp) for _ in range(copies)]
    weights = [torch.randn(out, inp).to(dtype) for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemm.ROWS_HINT) for w in weights]
    gemv = cpu_gemv.kernel()
    for rows in rows_list:
        x = torch.randn(rows, inp).to(dtype)
        use_gemv = gemv is not None and cpu_gemm.kernel_first(gemv, rows, dtype, inp)

        def int4(x=x):
            for m in layers:
                m.matmul(x, None)

        def bf16(x=x, use_gemv=use_gemv):
            for w, pw in zip(weights, packed):
                gemv(x, w, None) if use_gemv else torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")

        q_ms, b_ms = least_ms(int4, copies, repeats, clock), least_ms(bf16, copies, repeats, clock)
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        q_gb, b_gb = out * inp / 2 / q_ms / 1e6, out * inp * dtype.itemsize / b_ms / 1e6
        print(f"{out}x{inp} rows={rows}: int4 {q_ms:.3f} ms ({q_gb:.1f} GB/s packed), {name} {b_ms:.3f} ms "
              f"({b_gb:.1f} GB/s), {name}/int4 time {b_ms / q_ms:.2f}x, load {os.getloadavg()[0]:.1f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["5632x2048", "2048x5632"], help="out x in")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 17, 64])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-mb", type=int, default=64, help="packed weights cycled per shape: more than this")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--wall", action="store_true", help="wall time instead of the calling thread's CPU time")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the activations' and the dense weight's type (float32: the kernel's float path)")
    args = p.parse_args(argv)
    tune_host_allocator()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for shape in args.shapes:
        out, inp = (int(v) for v in shape.split("x"))
        copies = copies_beyond(args.cache_mb, out * inp // 2)
        compare(out, inp, args.rows, copies, args.repeats, time.perf_counter if args.wall else time.thread_time,
                getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
