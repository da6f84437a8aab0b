"""Time a mixture-of-experts layer's experts on the CPU: the one-call kernel (``device/cpu_moe.c``) against
the per-expert torch calls (``layers/moe.grouped_experts`` with the few-row kernel), as the CPU backend
would run each.

    python -m gaudi_runtime.bench.moe_layer [--tokens 16 128 256 512] [--experts 64 --top-k 8
        --hidden 512 --inter 192] [--layers 8] [--dtype bfloat16] [--threads 1]

Random weights for `--layers` layers, cycled so that they stream from memory as a model's do; the
minimum over the repetitions of one pass over all layers, in ms.
"""

from __future__ import annotations

import argparse
import time

import torch

from gaudi_runtime.device import cpu_gemv, cpu_moe
from gaudi_runtime.device.cpu import experts_kernel
from gaudi_runtime.layers.moe import route


def best_ms(fn, layers, x, weights, ids, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w13, w2 in layers:
            fn(x, weights, ids, w13, w2)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.moe_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 256, 512])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    one_call = cpu_moe.kernel()
    if one_call is None:
        raise SystemExit("the experts kernel could not be built here (see the warning above)")
    per_expert = experts_kernel(cpu_gemv.kernel())
    dtype = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    layers = [((torch.randn(a.experts, 2 * a.inter, a.hidden, generator=gen) * 0.05).to(dtype),
               (torch.randn(a.experts, a.hidden, a.inter, generator=gen) * 0.05).to(dtype)) for _ in range(a.layers)]
    print(f"tokens  one call ms  per expert ms  ratio   ({a.layers} layers, {a.dtype}, {a.threads} thread(s))")
    for tokens in a.tokens:
        x = torch.randn(tokens, a.hidden, generator=gen).to(dtype)
        weights, ids = route(torch.randn(tokens, a.experts, generator=gen), a.top_k)
        fused = best_ms(one_call, layers, x, weights, ids, a.repeats)
        grouped = best_ms(per_expert, layers, x, weights, ids, a.repeats)
        print(f"{tokens:6d}  {fused:11.1f}  {grouped:13.1f}  {fused / grouped:5.2f}")


if __name__ == "__main__":
    main()
