r"""`gaudi-serve benchmark`: static-batching latency and throughput of the shards, per batch size.

    gaudi-serve benchmark --model-id DIR --batch-size 1 --batch-size 8 --sequence-length 128 \
        --decode-length 128 --runs 10 --warmups 1 [--json out.json]

Like TGI's text-generation-benchmark, it drives the shards directly over gRPC
(no router, no HTTP): for each batch size and run, one Prefill of `batch-size`
requests of `sequence-length` random token ids, then `decode-length` Decode
calls, then ClearCache. KV blocks are allocated here, from the shards' Info.

By default it spawns the shards itself (as `launch` does, with the same
flags); `--attach` uses shards already listening at --shard-uds-path.

Definitions (per run; the table shows mean, min, max, p50, p90, p99 over runs):
  prefill latency        time of the Prefill call
  prefill throughput     batch-size / prefill latency (tokens generated per second; TGI's definition)
  decode token latency   time of all Decode calls / decode-length
  decode latency         time of all Decode calls
  decode throughput      batch-size * decode-length / decode latency = batch-size / token latency
  total latency          prefill latency + decode latency
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass

from gaudi_runtime import buckets
from gaudi_runtime.bench.stats import STAT_COLUMNS, fmt, summarize, table, write_json
from gaudi_runtime.config import FLAGS, Config, ConfigError, resolve
from gaudi_runtime.proto import generate_pb2 as pb


class BenchmarkError(RuntimeError):
    pass


@dataclass
class RunTimes:
    prefill_s: float
    decode_s: float
    generated: int


def check_fits(cfg: Config, batch_sizes: list[int], seq_len: int, decode_len: int) -> None:
    """Fail before spawning anything if a batch cannot run with this configuration."""
    if seq_len > cfg.limits.max_input_tokens:
        raise ConfigError(f"--sequence-length {seq_len} exceeds --max-input-tokens {cfg.limits.max_input_tokens}")
    if seq_len + decode_len > cfg.limits.max_total_tokens:
        raise ConfigError(f"--sequence-length + --decode-length ({seq_len + decode_len}) exceeds "
                          f"--max-total-tokens {cfg.limits.max_total_tokens}")
    padded = buckets.prefill_seq_bucket(seq_len, cfg)
    most = buckets.max_prefill_batch(padded, cfg)
    for b in batch_sizes:
        if b > cfg.scheduling.max_batch_size:
            raise ConfigError(f"--batch-size {b} exceeds --max-batch-size {cfg.scheduling.max_batch_size}")
        if b > most:
            raise ConfigError(f"--batch-size {b}: a prefill of {b} x {padded} padded tokens exceeds "
                              f"--max-batch-prefill-tokens {cfg.scheduling.max_batch_prefill_tokens}")


def derive_flags(a: argparse.Namespace, environ=os.environ) -> None:
    """Defaults sized to the benchmark for settings neither a flag nor the environment gives."""
    seq, dec, most = a.sequence_length, a.decode_length, max(a.batch_size)
    pad = int(environ.get("PAD_SEQUENCE_TO_MULTIPLE_OF", 128))

    def default(name: str, value) -> None:
        if getattr(a, name) is None and name.upper() not in environ:
            setattr(a, name, str(value))

    default("max_input_tokens", seq)
    default("max_total_tokens", seq + dec)
    default("max_batch_size", most)
    default("max_batch_prefill_tokens", most * buckets.round_up(seq, pad))


def random_ids(rng: random.Random, n: int, vocab: int, avoid: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab)
        if t not in avoid:
            out.append(t)
    return out


class Bench:
    def __init__(self, client, info: pb.InfoResponse, seq_len: int, decode_len: int, seed: int = 0,
                 top_n_tokens: int = 0, temperature: float | None = None):
        from gaudi_runtime.router.blocks import BlockAllocator

        self.client = client
        self.info = info
        self.seq_len = seq_len
        self.decode_len = decode_len
        self.rng = random.Random(seed)
        self.allocator = BlockAllocator(info.num_blocks)
        self.top_n_tokens = top_n_tokens
        self.temperature = temperature
        self.unwarmed_shapes = 0
        self._ids = 0

    def blocks_per_request(self) -> int:
        return buckets.ceil_div(self.seq_len + self.decode_len, self.info.block_size)

    def _params(self) -> pb.NextTokenChooserParameters:
        if self.temperature is None:
            return pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0,
                                                 repetition_penalty=1.0)
        return pb.NextTokenChooserParameters(temperature=self.temperature, top_p=1.0, typical_p=1.0,
                                             repetition_penalty=1.0, do_sample=True,
                                             seed=self.rng.randrange(1 << 31))

    async def run_once(self, batch_size: int) -> RunTimes:
        need = self.blocks_per_request() * batch_size
        if need > self.allocator.free_count:
            raise BenchmarkError(f"batch size {batch_size} needs {need} KV blocks, the shards hold "
                                 f"{self.info.num_blocks}; lower --batch-size or raise --max-batch-total-tokens")
        avoid = set(self.info.eos_token_ids)
        reqs, blocks = [], []
        for _ in range(batch_size):
            self._ids += 1
            b = self.allocator.allocate(self.blocks_per_request())
            blocks.append(b)
            reqs.append(pb.Request(id=self._ids, input_ids=random_ids(self.rng, self.seq_len,
                                                                      self.info.vocab_size, avoid),
                                   parameters=self._params(), top_n_tokens=self.top_n_tokens, blocks=b))
        self._ids += 1
        batch_id = self._ids
        generated = 0
        try:
            t0 = time.perf_counter()
            resp = await self.client.prefill(pb.Batch(id=batch_id, requests=reqs))
            t1 = time.perf_counter()
            generated += len(resp.generations.token_ids)
            self.unwarmed_shapes = max(self.unwarmed_shapes, resp.unwarmed_shapes)
            cached = resp.batch
            for _ in range(self.decode_len):
                d = await self.client.decode([cached])
                generated += len(d.generations.token_ids)
                self.unwarmed_shapes = max(self.unwarmed_shapes, d.unwarmed_shapes)
                cached = d.batch
            t2 = time.perf_counter()
        finally:
            await self.client.clear(None)
            for b in blocks:
                self.allocator.free(b)
        return RunTimes(t1 - t0, t2 - t1, generated)


def summarize_runs(batch_size: int, seq_len: int, decode_len: int, runs: list[RunTimes]) -> dict:
    prefill_ms = [r.prefill_s * 1000 for r in runs]
    decode_ms = [r.decode_s * 1000 for r in runs]
    token_ms = [d / decode_len for d in decode_ms]
    return {
        "batch_size": batch_size,
        "runs": len(runs),
        "generated_tokens": [r.generated for r in runs],
        "prefill": {
            "latency_ms": summarize(prefill_ms),
            "throughput_tokens_per_s": summarize(batch_size / r.prefill_s for r in runs),
            "prompt_tokens_per_s": summarize(batch_size * seq_len / r.prefill_s for r in runs),
        },
        "decode": {
            "token_latency_ms": summarize(token_ms),
            "latency_ms": summarize(decode_ms),
            "throughput_tokens_per_s": summarize(batch_size * decode_len / r.decode_s for r in runs),
        },
        "total_latency_ms": summarize(p + d for p, d in zip(prefill_ms, decode_ms)),
    }


def render(report: dict) -> str:
    out = []
    head = (f"model {report['model_id']} on {report['device']} ({report['dtype']}), "
            f"{report['num_shard']} shard(s); sequence length {report['sequence_length']}, "
            f"decode length {report['decode_length']}, {report['runs']} runs after {report['warmups']} warmup(s)")
    out.append(head)
    for r in report["results"]:
        lines = (("Prefill", "Latency (ms)", r["prefill"]["latency_ms"], 2),
                 ("", "Throughput (tokens/s)", r["prefill"]["throughput_tokens_per_s"], 1),
                 ("Decode (token)", "Latency (ms)", r["decode"]["token_latency_ms"], 2),
                 ("Decode (total)", "Latency (ms)", r["decode"]["latency_ms"], 2),
                 ("", "Throughput (tokens/s)", r["decode"]["throughput_tokens_per_s"], 1),
                 ("Total", "Latency (ms)", r["total_latency_ms"], 2))
        rows = [[step, metric, *(fmt(s[c], digits) for c in STAT_COLUMNS)] for step, metric, s, digits in lines]
        out.append(f"\nBatch size {r['batch_size']}")
        out.append(table(["Step", "Metric", "Mean", "Min", "Max", "p50", "p90", "p99"], rows, left=2))
    out.append(f"\nunwarmed shapes: {report['unwarmed_shapes']}")
    return "\n".join(out)


async def run(cfg: Config, args, on_step=None) -> dict:
    from gaudi_runtime.router.client import ShardClient

    client = ShardClient([cfg.server.shard_socket(r) for r in range(cfg.device.num_shard)], numbered=False)
    await client.connect(args.connect_timeout, alive=getattr(args, "_alive", lambda: True))
    try:
        if not args.skip_warmup:
            await client.warmup(lambda done, total, phase: on_step and on_step("warmup", done, total))
        info = await client.info()
        await client.clear(None)
        bench = Bench(client, info, args.sequence_length, args.decode_length, args.seed,
                      args.top_n_tokens, args.temperature)
        results = []
        for b in args.batch_size:
            for _ in range(args.warmups):
                await bench.run_once(b)
                on_step and on_step("run", 1, None)
            runs = []
            for _ in range(args.runs):
                runs.append(await bench.run_once(b))
                on_step and on_step("run", 1, None)
            results.append(summarize_runs(b, args.sequence_length, args.decode_length, runs))
    finally:
        await client.close()
    return {
        "tool": "gaudi-serve benchmark",
        "model_id": cfg.model.model_id,
        "device": info.device_type,
        "dtype": info.dtype,
        "num_shard": info.world_size,
        "block_size": info.block_size,
        "kv_blocks": info.num_blocks,
        "sequence_length": args.sequence_length,
        "decode_length": args.decode_length,
        "runs": args.runs,
        "warmups": args.warmups,
        "sampling": "greedy" if args.temperature is None else f"temperature {args.temperature}",
        "unwarmed_shapes": bench.unwarmed_shapes,
        "results": results,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaudi-serve benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=int, action="append", help="repeat for several (default: 1 2 4 8)")
    g.add_argument("--sequence-length", type=int, default=10, help="prompt tokens per request")
    g.add_argument("--decode-length", type=int, default=8, help="Decode calls per run")
    g.add_argument("--runs", type=int, default=10, help="measured runs per batch size")
    g.add_argument("--warmups", type=int, default=1, help="unmeasured runs per batch size first")
    g.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    g.add_argument("--top-n-tokens", type=int, default=0, help="also return this many top tokens per step")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--json", dest="json_path", help="write the report as JSON to this file ('-': stdout)")
    g.add_argument("--attach", action="store_true",
                   help="use shards already serving at --shard-uds-path instead of spawning them")
    g.add_argument("--skip-warmup", action="store_true", help="do not run the shards' Warmup first")
    g.add_argument("--connect-timeout", type=float, default=600.0, help="seconds to wait for the shards")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_server_arguments(p.add_argument_group("shards (the flags of `gaudi-serve launch` that matter here)"))
    return p


# Router/HTTP settings of `launch` that have no effect on the shards.
ROUTER_ONLY = {"--hostname", "--port", "--api-key", "--cors-allow-origin", "--max-concurrent-requests",
               "--max-stop-sequences", "--max-top-n-tokens", "--max-best-of", "--max-client-batch-size",
               "--max-waiting-tokens", "--waiting-served-ratio", "--model-name"}


def add_server_arguments(group) -> None:
    """The launch flags that shape the shards (env and defaults as `launch`); router-only ones left out."""
    for flag, env, _typ, default, help_ in FLAGS:
        if flag in ROUTER_ONLY:
            continue
        env = env or flag.lstrip("-").replace("-", "_").upper()
        shown = "derived" if default is None else default
        group.add_argument(flag, default=None, help=f"{help_} [env: {env}] [default: {shown}]")


def _checked_config(a: argparse.Namespace) -> Config:
    """The benchmark's flags checked and resolved into a runtime Config; ConfigError names the flag."""
    a.batch_size = a.batch_size or [1, 2, 4, 8]
    for name in ("sequence_length", "decode_length", "runs"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if a.warmups < 0 or min(a.batch_size) < 1:
        raise ConfigError("--warmups must be >= 0 and --batch-size >= 1")
    derive_flags(a)
    cfg = resolve(a)
    if "LOG_LEVEL" not in os.environ:  # the shards' info logs would interleave with the progress bar
        cfg = cfg.replace(log_level="warning")
    check_fits(cfg, a.batch_size, a.sequence_length, a.decode_length)
    return cfg


class _Progress:
    """Progress bars on stderr: the shards' warmup, then the benchmark's runs."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.bars = {}

    def __call__(self, kind: str, n: int, total: int | None) -> None:
        from tqdm import tqdm

        a, bars = self.a, self.bars
        if kind == "warmup":
            if "warmup" not in bars:
                bars["warmup"] = tqdm(total=total, desc="shard warmup", unit="shape", disable=a.no_progress,
                                      file=sys.stderr)
            bars["warmup"].n = n
            bars["warmup"].refresh()
            return
        if "run" not in bars:
            if "warmup" in bars:
                bars["warmup"].close()
            bars["run"] = tqdm(total=len(a.batch_size) * (a.runs + a.warmups), desc="benchmark", unit="run",
                               disable=a.no_progress, file=sys.stderr)
        bars["run"].update(n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from gaudi_runtime import launcher

    procs = []
    try:
        cfg = _checked_config(a)
        if not a.attach:
            model_dir = launcher.resolve_model_dir(cfg)
            launcher.check_model(model_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.attach:
        procs = launcher.spawn_shards(cfg, model_dir)
        a._alive = lambda: all(p.poll() is None for _, p in procs)
    progress = _Progress(a)
    try:
        report = asyncio.run(run(cfg, a, progress))
    except Exception as e:  # noqa: BLE001 - one line for the user, not a traceback
        from gaudi_runtime.router.client import ShardError

        if not isinstance(e, (ShardError, BenchmarkError, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        if procs:
            launcher.stop_all(procs)
    print(render(report))
    if a.json_path:
        write_json(report, a.json_path)
    return 0
