"""Time the few-row C kernel (``cpu_gemv``) against oneDNN over the reordered weight, per shape and row
count, in bfloat16 (or float32): the measurement behind ``cpu_gemm.BF16_DOT_X_VALUES``.

    python -m gaudi_runtime.bench.few_rows [--shapes 8192x1536 1536x4096] [--rows 1 2 4 8] [--threads 2]

Copies of each weight are cycled, enough that they exceed ``--cache-mb`` (a served model's weights
stream from memory). Printed per product: the minimum wall time over repetitions, both engines, and
whether a layer now gives these rows to the kernel (``cpu_gemm.kernel_first``). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse

import torch

from gaudi_runtime.bench.stats import copies_beyond, least_ms
from gaudi_runtime.device import cpu_gemm, cpu_gemv
from gaudi_runtime.device.host_allocator import tune_host_allocator


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["8192x1536", "2560x1536", "1536x4096", "512x1536"],
                   help="out x in")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--cache-mb", type=int, default=96, help="weights cycled per shape: more than this")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    tune_host_allocator()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gemv = cpu_gemv.kernel()
    if gemv is None:
        raise SystemExit("the few-row kernel did not build here")
    for shape in args.shapes:
        out, inp = (int(v) for v in shape.split("x"))
        copies = copies_beyond(args.cache_mb, out * inp * dtype.itemsize)
        weights = [torch.randn(out, inp).to(dtype) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemm.ROWS_HINT) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, inp).to(dtype)
            kernel = least_ms(lambda x=x, ws=weights: [gemv(x, w, None) for w in ws], copies, args.repeats)
            onednn = least_ms(lambda x=x, ws=packed: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                     for w in ws], copies, args.repeats)
            print(f"{shape} rows={rows}: kernel {kernel:.3f} ms, oneDNN {onednn:.3f} ms, oneDNN/kernel time "
                  f"{onednn / kernel:.2f}, the layer takes the kernel: {cpu_gemm.kernel_first(gemv, rows, dtype, inp)}",
                  flush=True)


if __name__ == "__main__":
    main()
