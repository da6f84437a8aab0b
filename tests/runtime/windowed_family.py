"""Checks shared by the families with sliding-window layers (tests/runtime/test_family_gemma2.py, _gemma3.py):
chunked prefill and prefix caching on prompts longer than the window, whose later chunks and cached
turns attend to cached blocks partly out of the local layers' window."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.runtime.launched import get_json, greedy_reference, serve_small
from tests.runtime.prefix_checks import SYSTEM, check_conversations, generate

CHUNKS = ("--max-batch-prefill-tokens", "16")  # four blocks of 4: prompts of 17 tokens or more are chunked


def check_chunked_and_cached(model_dir, tmp, window: int, *args: str) -> None:
    """`args`: more server flags (speculation: its verify passes attend over cached blocks too)."""
    srv = serve_small(model_dir, tmp, *CHUNKS, "--prefix-caching", "true", *args)
    try:
        prompt = SYSTEM + " the gaudi card shard router token batch cache serve request stream answer"

        async def run():
            async with aiohttp.ClientSession() as s:
                return await generate(s, srv.url, prompt, 3 * window)

        ids, _ = asyncio.run(run())
        assert ids == greedy_reference(model_dir, prompt, 3 * window)
        assert get_json(srv.url + "/info")[1]["prefill_chunks"] >= 1
        check_conversations(srv, conversations=3, turns=3)  # each turn's prompt: the cached turns, then new
    finally:
        srv.stop()
