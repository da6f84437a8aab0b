"""Offline throughput of the engine: N random-token prompts submitted at once, EOS ignored.

    python -m gaudi_runtime.bench.offline --model-id DIR [--prompts 64 --input-len 128 --output-len 128]

Runs the shards as `launch` does and drives them with the router's batching
engine in this process (no HTTP), then prints generated tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from gaudi_runtime import launcher
from gaudi_runtime.config import add_arguments, resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router.client import ShardClient
from gaudi_runtime.router.engine import BatchingEngine
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import StoppingParameters, ValidRequest


async def run(cfg, model_dir: str, prompts: int, input_len: int, output_len: int) -> dict:
    tokenizer = RouterTokenizer.load(model_dir, cfg.model)
    client = ShardClient([cfg.server.shard_socket(r) for r in range(cfg.device.num_shard)])
    engine = BatchingEngine(cfg, client, tokenizer)
    await engine.start()
    rng = random.Random(0)
    vocab = engine.shard_info.vocab_size
    special = set(tokenizer.special_ids)
    reqs = []
    for _ in range(prompts):
        ids = [t for t in (rng.randrange(vocab) for _ in range(input_len * 2)) if t not in special][:input_len]
        reqs.append(ValidRequest(input_ids=ids, inputs="", sampling=SamplingParameters(),
                                 stopping=StoppingParameters(max_new_tokens=output_len, ignore_eos_token=True)))

    async def one(r: ValidRequest) -> int:
        n = 0
        async for ev in engine.generate(r):
            n += 1
            if ev.end is not None:
                return ev.end.generated_tokens
        return n

    await asyncio.gather(*(one(r) for r in reqs[:2]))  # first-call effects out of the measurement
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(r) for r in reqs)))
    elapsed = time.perf_counter() - start
    await engine.stop()
    return {"prompts": prompts, "input_len": input_len, "output_len": output_len, "tokens": tokens,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    add_arguments(p)
    a = p.parse_args(argv)
    if a.max_total_tokens is None:
        a.max_total_tokens = str(max(a.input_len + a.output_len + 1, 2048))
    if a.max_batch_size is None:
        a.max_batch_size = str(a.prompts)
    cfg = resolve(a)
    model_dir = launcher.resolve_model_dir(cfg)
    launcher.check_model(model_dir)
    procs = launcher.spawn_shards(cfg, model_dir)
    try:
        r = asyncio.run(run(cfg, model_dir, a.prompts, a.input_len, a.output_len))
    finally:
        launcher.stop_all(procs)
    print(f"RESULT engine=gaudi-serve n={r['prompts']} in={r['input_len']} out={r['output_len']} "
          f"tokens={r['tokens']} seconds={r['seconds']} tok/s={r['tokens_per_s']}")


if __name__ == "__main__":
    main()
