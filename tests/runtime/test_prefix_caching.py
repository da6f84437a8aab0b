"""Prefix caching under memory pressure, and switched off, on the real server.

With a KV budget that holds a few conversations at a time and three times more distinct
conversations than fit, cached prefixes are evicted and their blocks taken over again and again:
nothing fails, every answer is still transformers' greedy output, and once idle every block is
free or merely cached. `--prefix-caching false` (TGI's PREFIX_CACHING) looks nothing up.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, greedy_reference, serve_small
from tests.runtime.prefix_checks import SYSTEM, WORDS, cache_hits, generate, too_long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_conversations_beyond_the_kv_budget_evict_cached_prefixes_and_still_match(model_dir, tmp_path):
    # 3 x 128 tokens: three requests of the longest kind at a time; nine conversations, four at once.
    srv = serve_small(model_dir, tmp_path, "--max-batch-total-tokens", "384")
    try:
        code, info = get_json(srv.url + "/info")
        assert info["kv_blocks"] == 96 and info["prefix_caching"] is True

        async def converse(session, c: int):
            rng, history, out = random.Random(c), f"{c} {SYSTEM} {c}", []
            for _ in range(3):
                history += " " + " ".join(rng.choice(WORDS) for _ in range(4))
                n = rng.randint(8, 30)
                ids, text = await generate(session, srv.url, history, n)
                out.append((history, n, ids))
                history += text
                if too_long(model_dir, history, limit=40):
                    break
            return out

        async def run():
            limit = asyncio.Semaphore(4)

            async def one(s, c):
                async with limit:
                    return await converse(s, c)

            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(one(s, c) for c in range(9)))

        for turns in asyncio.run(run()):
            for prompt, n, ids in turns:
                assert ids == greedy_reference(model_dir, prompt, n), prompt
        code, info = get_json(srv.url + "/info")
        assert info["kv_blocks_free"] == info["kv_blocks"]  # idle: every block free or merely cached
        assert 0 < info["kv_blocks_cached"] <= info["kv_blocks"]
        assert info["prefix_cache_hits"] > 0 and info["unwarmed_shapes"] == 0
    finally:
        srv.stop()


def test_prefix_caching_false_computes_every_prompt(model_dir, tmp_path):
    srv = serve_small(model_dir, tmp_path, env={"PREFIX_CACHING": "false"})
    try:
        code, info = get_json(srv.url + "/info")
        assert info["prefix_caching"] is False and info["warmup"]["prefill_context_shapes"] == 0
        check_conversations_without_hits(srv)
    finally:
        srv.stop()


def check_conversations_without_hits(srv) -> None:
    async def run():
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                ids, _ = await generate(s, srv.url, SYSTEM, 5)
                assert ids == greedy_reference(srv.model_dir, SYSTEM, 5)

    asyncio.run(run())
    assert cache_hits(srv.url) == 0
    code, info = get_json(srv.url + "/info")
    assert info["kv_blocks_cached"] == 0 and info["kv_blocks_free"] == info["kv_blocks"]
