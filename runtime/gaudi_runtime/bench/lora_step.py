"""Time a decode step and a prefill with LoRA adapters in this process: the base model's rows alone, the
adapters through the gathered bmm, and through the CPU's kernel.

    python -m gaudi_runtime.bench.lora_step --model-id DIR --adapters DIR/a1 DIR/a2 ... [--batch 16]

The model is set up as the CPU backend sets it up on a shard (its attention, reordered weights, the C
kernels); rows take the
adapters in turn (row i: slot i mod n + 1). Variants, interleaved repetition by repetition: ``base``
(no row has an adapter), ``bmm`` (every row's A and B gathered, two bmm: layers/lora.py), ``kernel``
(device/cpu_lora.py). Prints the minimum and the median per variant; ``--profile`` adds torch.profiler's
top operators of a ``bmm`` decode step; ``--layers`` times the kernel alone, call by call with warm caches,
on each kind of LoRA layer of the model (q/k/v, o, gate/up, down: every decoder layer has the same shapes),
for the decode step's tokens and the prefill's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from gaudi_runtime.bench.decode_step import BLOCK, step_inputs
from gaudi_runtime.buckets import ceil_div
from gaudi_runtime.device import cpu_lora
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.layers.attention import AttentionMetadata, use_attention
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.layers.linear import LinearBase
from gaudi_runtime.models.lora import attach_adapters
from gaudi_runtime.models.registry import load_model


def setup(model_id: str, adapters: list[str], dtype: torch.dtype, rank: int):
    model = load_model(model_id, dtype, torch.device("cpu"))
    config = json.loads((Path(model_id) / "config.json").read_text())
    rows = attach_adapters(model, [(f"a{i}", a) for i, a in enumerate(adapters, 1)], config, rank)
    backend = CpuBackend()
    use_attention(model, backend.attention())  # decode reads the paged cache in place, as on a shard
    backend.prepare_model(model)
    return model, rows


def variants(model, rows, slots: torch.Tensor):
    """name -> a function that sets the model up as that variant."""
    kernel = cpu_lora.kernel()

    def use(index, k):
        def set_up():
            rows.index = index
            cpu_lora.set_lora_kernel(model, k)
        return set_up
    return {"base": use(None, None), "bmm": use(slots, None), "kernel": use(slots, kernel)}


def timed(fn, setups: dict, repeats: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, set_up in setups.items():
            set_up()
            fn()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def best_us(fn, repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def print_layer_times(model, n: int, shapes: dict[str, tuple[int, int]], repeats: int) -> None:
    """The kernel alone on one LoRA layer of each name (µs per call, min of `repeats`), for each of `shapes`
    (label -> rows, tokens per row; rows take the adapters in turn), and their sum over the model's layers."""
    cpu_lora.set_lora_kernel(model, cpu_lora.kernel())
    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase) and m.lora is not None and m.lora.kernel is not None:
            layers.setdefault(name.rsplit(".", 1)[-1], m.lora)
    print(f"{'layer':<14}" + "".join(f"{label + ' us':>22}" for label in shapes))
    totals = dict.fromkeys(shapes, 0.0)
    for name, lora in layers.items():
        times = []
        for label, (rows, seq) in shapes.items():
            x = torch.randn(rows, seq, lora.a.shape[1]).to(lora.a.dtype)
            y = torch.zeros(rows, seq, lora.b.shape[2], dtype=lora.a.dtype)
            index = torch.arange(rows) % n + 1
            call = functools.partial(lora.kernel, lora, x, y, index)
            times.append(best_us(call, repeats, 50 if rows * seq <= 64 else 5))
            totals[label] += times[-1]
        print(f"{name:<14}" + "".join(f"{t:>22.1f}" for t in times))
    print(f"{'model (ms)':<14}" + "".join(f"{totals[label] * model.num_layers / 1e3:>22.2f}" for label in shapes))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--adapters", nargs="+", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--prefill", type=int, nargs=2, default=[2, 128], metavar=("PROMPTS", "TOKENS"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layers", action="store_true", help="only the kernel, per kind of LoRA layer")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model, rows = setup(args.model_id, args.adapters, dtype, args.max_lora_rank)
    n = len(args.adapters)
    if args.layers:
        prompts, length = args.prefill
        with torch.inference_mode():
            print_layer_times(model, n, {f"decode {args.batch}": (args.batch, 1),
                                         f"prefill {prompts} x {length}": (prompts, length)}, args.repeats)
        return
    kv = allocate_kv_cache(model.num_layers, 1 + args.batch * ceil_div(args.context, BLOCK), BLOCK,
                           model.num_kv_heads, model.head_dim, dtype, torch.device("cpu"))
    inputs = step_inputs(args.batch, args.context, model.vocab_size)

    def decode():
        ids, positions, slots, tables, ctx = inputs
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables, context_lens=ctx)
        return model.compute_logits(model(ids[:, None], positions[:, None], kv, meta)[:, -1])

    prompts, length = args.prefill
    ids = torch.randint(0, model.vocab_size, (prompts, length))

    def prefill():
        meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(ids.shape, dtype=torch.long))
        return model(ids, torch.arange(length).expand(ids.shape), kv, meta)

    print(f"{'step':<22} {'variant':<8} {'min ms':>8} {'median ms':>9}  ({args.dtype}, {n} adapters, "
          f"{torch.get_num_threads()} threads)")
    with torch.inference_mode():
        for label, fn, count in ((f"decode {args.batch} x ctx {args.context}", decode, args.batch),
                                 (f"prefill {prompts} x {length}", prefill, prompts)):
            setups = variants(model, rows, torch.arange(count) % n + 1)
            for name, ts in timed(fn, setups, args.repeats, args.steps).items():
                print(f"{label:<22} {name:<8} {min(ts):>8.2f} {statistics.median(ts):>9.2f}")
        if args.profile:
            variants(model, rows, torch.arange(args.batch) % n + 1)["bmm"]()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    decode()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
