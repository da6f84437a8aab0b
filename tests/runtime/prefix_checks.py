"""Prefix caching as users meet it, for the test files whose servers it runs against: conversations
that resend their whole history behind a shared system prompt, several at once, and a request whose
client leaves mid-answer. Every answer must be the one computed from scratch (transformers' greedy
tokens, or the same server's answer with the cache bypassed), and the cache must have been hit."""

from __future__ import annotations

import asyncio
import functools
import random

import aiohttp

from tests.runtime.launched import get_json, greedy_reference

SYSTEM = "kubernetes pod operator cluster node graph warmup bucket prefill decode hello world:"
WORDS = "the a gaudi card shard router token batch cache serve request stream answer question".split()


async def generate(session, url: str, prompt: str, max_new_tokens: int, **params) -> tuple[list[int], str]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True, **params}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return [t["id"] for t in out["details"]["tokens"]], out["generated_text"]


def too_long(model_dir, prompt: str, limit: int = 48) -> bool:
    """Whether a conversation has grown too long for another turn within the test servers' 64 tokens."""
    return len(_tokenizer(str(model_dir))(prompt).input_ids) > limit


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def cache_hits(url: str) -> int:
    code, info = get_json(url + "/info")
    assert code == 200
    return info["prefix_cache_hits"]


def check_conversations(srv, conversations: int = 3, turns: int = 3, seed: int = 0, reference=None) -> None:
    """Conversations behind one system prompt run at once, each starting while the others stream and
    answering with its own length (they finish in any order); each turn resends the history. Every
    answer equals `reference(prompt, n)` (default: transformers' greedy tokens)."""
    reference = reference or (lambda prompt, n: greedy_reference(srv.model_dir, prompt, n))
    before = cache_hits(srv.url)

    async def converse(session, c: int, started: asyncio.Event):
        rng, history, turns_out = random.Random(seed * 31 + c), SYSTEM, []
        for _ in range(turns):
            history += " " + " ".join(rng.choice(WORDS) for _ in range(3))
            n = rng.randint(3, 8)
            ids, text = await generate(session, srv.url, history, n)
            started.set()
            turns_out.append((history, n, ids))
            history += text
            if too_long(srv.model_dir, history):
                break
        return turns_out

    async def run():
        async with aiohttp.ClientSession() as s:
            tasks = []
            for c in range(conversations):
                started = asyncio.Event()
                tasks.append(asyncio.create_task(converse(s, c, started)))
                await started.wait()
            return await asyncio.gather(*tasks)

    for turns_out in asyncio.run(run()):
        for prompt, n, ids in turns_out:
            assert ids == reference(prompt, n), prompt
    assert cache_hits(srv.url) > before  # later turns, and the system prompt, were cached
    code, info = get_json(srv.url + "/info")
    assert info["kv_blocks_free"] == info["kv_blocks"] and info["unwarmed_shapes"] == 0


def check_cancelled_request_leaves_valid_blocks(srv, reference=None) -> None:
    """A streaming request whose client leaves after two tokens: the next request starting with the
    same prompt reads its blocks and answers as computed from scratch."""
    reference = reference or (lambda prompt, n: greedy_reference(srv.model_dir, prompt, n))
    prompt = SYSTEM + " serve request stream answer question cache"

    async def run():
        async with aiohttp.ClientSession() as s:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 40}}
            async with s.post(srv.url + "/generate_stream", json=body) as r:
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data:")
                    if seen == 2:
                        break  # the client goes away mid-answer
            before = cache_hits(srv.url)
            ids, _ = await generate(s, srv.url, prompt + " token", 6)
            return ids, cache_hits(srv.url) - before

    ids, hits = asyncio.run(run())
    assert hits > 0
    assert ids == reference(prompt + " token", 6)


def bypassed(srv):
    """The server's own answer with every prompt token computed: a request wanting its prompt's
    log-probabilities looks nothing up in the cache."""
    async def run(prompt: str, n: int):
        async with aiohttp.ClientSession() as s:
            ids, _ = await generate(s, srv.url, prompt, n, decoder_input_details=True)
            return ids

    return lambda prompt, n: asyncio.run(run(prompt, n))
