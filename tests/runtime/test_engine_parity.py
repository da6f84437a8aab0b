"""The real server (launcher, shard, router) against `transformers` on the same weights.

Greedy output must equal `generate` token for token, alone and while requests
join and leave a running batch; afterwards every KV block is free again.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, get_json, greedy_reference, launch, stream_ids
from tests.runtime.prefix_checks import check_cancelled_request_leaves_valid_blocks, check_conversations

FAMILIES = ["llama", "llama31", "mistral", "qwen2"]

PROMPTS = [
    "What is deep learning?",
    "the gaudi card",
    "hello world",
    "kubernetes pod operator cluster node graph warmup bucket prefill decode hello world the a deep",
    "東京 数据",
    "a",
    "serve request stream answer question data train weight layer",
    "why when how",
    "token batch cache",
    "the a the a the a",
    "attention head vector",
    "café naïve über",
    "shard router",
    "😀 🚀 model",
]


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, tmp_path_factory):
    family = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp(family), family)
    srv = launch(model_dir, tmp_path_factory.mktemp(f"{family}-run"), *SMALL_ARGS, env=SMALL_ENV)
    try:
        srv.wait_ready()
        srv.model_dir = model_dir
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(server):
    return lambda prompt, n: greedy_reference(server.model_dir, prompt, n)


async def generate_ids(session, url, prompt, max_new_tokens):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    return [t["id"] for t in data["details"]["tokens"]]


def test_greedy_single_request_matches_transformers(server, reference):
    async def run():
        async with aiohttp.ClientSession() as s:
            for prompt in PROMPTS[:4]:
                assert await generate_ids(s, server.url, prompt, 24) == reference(prompt, 24), prompt

    asyncio.run(run())


def test_greedy_concurrent_requests_joining_and_leaving_match(server, reference):
    """14 requests of different lengths; each starts once the previous one is streaming."""
    rng = random.Random(7)
    lengths = [rng.randint(4, 40) for _ in PROMPTS]

    async def run():
        async with aiohttp.ClientSession() as s:
            tasks = []
            for prompt, n in zip(PROMPTS, lengths):
                started = asyncio.Event()
                tasks.append(asyncio.create_task(stream_ids(s, server.url, prompt, n, started, after=2)))
                await started.wait()
            # and a burst arriving all at once
            burst = [asyncio.create_task(generate_ids(s, server.url, p, n)) for p, n in zip(PROMPTS, lengths)]
            return await asyncio.gather(*tasks), await asyncio.gather(*burst)

    staggered, burst = asyncio.run(run())
    for prompt, n, got in zip(PROMPTS, lengths, staggered):
        assert got == reference(prompt, n), prompt
    for prompt, n, got in zip(PROMPTS, lengths, burst):
        assert got == reference(prompt, n), prompt

    code, info = get_json(server.url + "/info")
    assert code == 200
    assert info["kv_blocks_free"] == info["kv_blocks"]
    assert "decode: paged C kernel" in info["attention"], info["attention"]  # decode read the cache in place
    assert "tgi_queue_size 0.0" in _metrics(server.url)


def test_conversations_read_their_cached_history_and_still_match(server):
    """Prefix caching (on by default): each turn resends the conversation, whose earlier turns and
    shared system prompt are cached; concurrent conversations, and a request cancelled mid-answer."""
    check_conversations(server)
    check_cancelled_request_leaves_valid_blocks(server)


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        return r.read().decode()
