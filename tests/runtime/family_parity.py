"""Greedy parity of a served model family with `transformers`, for the tests/runtime/test_family_*.py files.

A family's test file builds a tiny random-weight model, serves it with `gaudi-serve launch`
(1 and 2 shards) and runs these checks against it: one request at a time, then requests
joining a running batch while others stream, then a burst arriving at once. Every answer
must be transformers' greedy output in fp32 on the same weights, token for token; afterwards
every KV block is free and no forward pass ran on a shape warmup did not see.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp

from tests.runtime.launched import (
    SMALL_ARGS,
    SMALL_ENV,
    Launched,
    get_json,
    greedy_reference,
    launch,
    stream_ids,
)

PROMPTS = [
    "What is deep learning?",
    "kubernetes pod operator cluster node graph warmup bucket prefill decode hello world the a deep",
    "東京 数据",
    "a",
    "serve request stream answer question data train weight layer",
    "café naïve über",
    "shard router",
    "😀 🚀 model",
]


def serve(model_dir: Path, tmp: Path, shards: int, env: dict | None = None, args: tuple = SMALL_ARGS,
          base_env: dict = SMALL_ENV) -> Launched:
    """`gaudi-serve launch` on CPU (by default with the small test shapes), ready to serve (the caller stops it)."""
    srv = launch(model_dir, tmp, "--num-shard", str(shards), "--device", "cpu", *args,
                 env={**base_env, **(env or {})})
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    srv.model_dir, srv.shards = model_dir, shards
    return srv


async def generate_ids(session, url: str, prompt: str, max_new_tokens: int) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [t["id"] for t in (await r.json())["details"]["tokens"]]


def served_ids(srv: Launched, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """The server's greedy tokens for each prompt, asked one after the other."""
    async def run():
        async with aiohttp.ClientSession() as s:
            return [await generate_ids(s, srv.url, p, max_new_tokens) for p in prompts]

    return asyncio.run(run())


def served_ids_and_info(model_dir: Path, tmp: Path, shards: int, prompts: list[str],
                        max_new_tokens: int) -> tuple[list[list[int]], int, dict]:
    """A server started for these prompts alone: its greedy tokens for each, then /info's status and body."""
    tmp.mkdir()
    srv = serve(model_dir, tmp, shards)
    try:
        return (served_ids(srv, prompts, max_new_tokens), *get_json(srv.url + "/info"))
    finally:
        srv.stop()


def check_single_requests(srv: Launched, n_prompts: int = 3, max_new_tokens: int = 24) -> None:
    for prompt, got in zip(PROMPTS, served_ids(srv, PROMPTS[:n_prompts], max_new_tokens)):
        assert got == greedy_reference(srv.model_dir, prompt, max_new_tokens), prompt


def check_concurrent_requests(srv: Launched, seed: int = 3, attention: str = "decode: paged C kernel") -> None:
    """4 requests join a running batch one by one (streaming), then all prompts arrive at once; `attention`:
    what /info must say decoded them."""
    rng = random.Random(seed)
    lengths = [rng.randint(4, 32) for _ in PROMPTS]

    async def run():
        async with aiohttp.ClientSession() as s:
            staggered = []
            for prompt, n in list(zip(PROMPTS, lengths))[:4]:
                started = asyncio.Event()
                staggered.append(asyncio.create_task(stream_ids(s, srv.url, prompt, n, started)))
                await started.wait()
            burst = [asyncio.create_task(generate_ids(s, srv.url, p, n)) for p, n in zip(PROMPTS, lengths)]
            return await asyncio.gather(*staggered), await asyncio.gather(*burst)

    staggered, burst = asyncio.run(run())
    for prompt, n, got in zip(PROMPTS, lengths, staggered):
        assert got == greedy_reference(srv.model_dir, prompt, n), prompt
    for prompt, n, got in zip(PROMPTS, lengths, burst):
        assert got == greedy_reference(srv.model_dir, prompt, n), prompt
    code, info = get_json(srv.url + "/info")
    assert code == 200
    assert info["kv_blocks_free"] == info["kv_blocks"]
    assert info["unwarmed_shapes"] == 0
    # On a CPU with a C compiler decode reads the paged cache in place: that is what matched.
    assert attention in info["attention"], info["attention"]
