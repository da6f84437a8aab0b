"""Online latency through HTTP: closed-loop streaming /v1/completions at a fixed concurrency.

    python -m gaudi_runtime.bench.online --url http://127.0.0.1:8080 --model-dir DIR \
        --requests 64 --concurrency 16 --input-len 128 --output-len 128

Prompts are random token ids decoded to text. Prints throughput and time to
first token / inter-token latency percentiles in milliseconds. `--json-schema N`
puts a JSON schema of N string properties in every request (`response_format`),
to measure constrained generation against none. `--models a1,a2,...` gives the
requests those `model` names in turn (LoRA adapters: request i asks for the
(i mod n)-th), each warmed by one short request first; without it every request
asks for the server's first model in /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def string_properties_schema(n: int) -> dict:
    """An object of `n` required string properties: long enough that outputs run to max_tokens."""
    props = {f"field_{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def one(session, url: str, prompt: str, max_tokens: int, ttft: list, itl: list, extra: dict | None = None) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    start = time.perf_counter()
    last = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            json.loads(line[5:])
            now = time.perf_counter()
            if last is None:
                ttft.append((now - start) * 1000)
            else:
                itl.append((now - last) * 1000)
            last = now
            tokens += 1
    return tokens


async def run(url: str, prompts: list[str], concurrency: int, output_len: int, extra: dict | None = None,
              models: list[str] | None = None) -> dict:
    """`models`: request i asks for models[i % n] (each warmed by one short request first); None: the
    server's first model."""
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def user(session):
        nonlocal tokens
        while queue:
            prompt, model = queue.pop()
            n = await one(session, url, prompt, output_len, ttft, itl, {**(extra or {}), "model": model})
            tokens += n  # not `tokens += await ...`: that reads tokens before the await

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        models = models or [await first_model(session, url)]
        for model in models:
            await one(session, url, prompts[0], 4, [], [], {"model": model})
        queue = [(p, models[i % len(models)]) for i, p in enumerate(prompts)][::-1]  # popped in order
        start = time.perf_counter()
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "concurrency": concurrency, "tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed,
            "ttft_ms": {q: percentile(ttft, q / 100) for q in (50, 90, 99)},
            "itl_ms": {q: percentile(itl, q / 100) for q in (50, 90, 99)}}


async def first_model(session, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.online", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model-dir", required=True, help="for its tokenizer")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-schema", type=int, default=0, metavar="N",
                   help="every request follows a JSON schema of N string properties (0: unconstrained)")
    p.add_argument("--models", default=None, help="comma-separated `model` names the requests take in turn "
                   "(default: the server's first model)")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    ids = [t for t in range(len(tok)) if t not in special]
    prompts = [tok.decode([rng.choice(ids) for _ in range(a.input_len)]) for _ in range(a.requests)]
    extra = None
    if a.json_schema:
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": string_properties_schema(a.json_schema)}}}
    models = [m for m in (a.models or "").split(",") if m] or None
    r = asyncio.run(run(a.url.rstrip("/"), prompts, a.concurrency, a.output_len, extra, models))
    print(f"RESULT requests={r['requests']} concurrency={r['concurrency']} tokens={r['tokens']} "
          f"seconds={r['seconds']:.2f} tok/s={r['tokens_per_s']:.1f} "
          f"ttft_ms p50={r['ttft_ms'][50]:.1f} p90={r['ttft_ms'][90]:.1f} p99={r['ttft_ms'][99]:.1f} "
          f"itl_ms p50={r['itl_ms'][50]:.1f} p90={r['itl_ms'][90]:.1f} p99={r['itl_ms'][99]:.1f} "
          f"ttft_p50_ms={r['ttft_ms'][50]:.1f} itl_p50_ms={r['itl_ms'][50]:.1f}")  # compare_vllm.sh's keys


if __name__ == "__main__":
    main()
