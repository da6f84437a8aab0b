"""Chunked prefill on the real server (tiny model, CPU): with --max-batch-prefill-tokens below the prompts'
length, prompts are prefilled in chunks between decode steps, and every answer is still the one computed
whole: transformers' greedy tokens, or the same server's answer with every prompt token computed in one
prefill (a request wanting its prompt's log-probabilities is never chunked). With prefix caching on and
off, on 2 shards over a float8 KV cache, and under a grammar."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import get_json, greedy_reference, serve_small
from tests.runtime.prefix_checks import SYSTEM, bypassed, check_conversations, generate

pytestmark = pytest.mark.slow

CHUNKS = ("--max-batch-prefill-tokens", "16")  # four blocks of 4: prompts of 17 tokens or more are chunked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def chunks(srv) -> int:
    return get_json(srv.url + "/info")[1]["prefill_chunks"]


@pytest.mark.parametrize("caching", ["true", "false"])
def test_chunked_conversations_answer_as_transformers(model_dir, tmp_path, caching):
    srv = serve_small(model_dir, tmp_path, *CHUNKS, "--prefix-caching", caching)
    try:
        prompt = SYSTEM + " the gaudi card shard router token batch cache serve request stream answer"
        ids, _ = asyncio.run(_generate(srv.url, prompt, 8))
        assert ids == greedy_reference(model_dir, prompt, 8)
        assert chunks(srv) >= 1
        if caching == "true":
            check_conversations(srv, conversations=3, turns=3)
    finally:
        srv.stop()


async def _generate(url: str, prompt: str, n: int, **params):
    async with aiohttp.ClientSession() as s:
        return await generate(s, url, prompt, n, **params)


def test_two_shards_over_a_float8_kv_cache_answer_as_when_computed_whole(model_dir, tmp_path):
    srv = serve_small(model_dir, tmp_path, *CHUNKS, "--num-shard", "2", "--kv-cache-dtype", "fp8_e4m3fn")
    try:
        check_conversations(srv, conversations=2, turns=3, reference=bypassed(srv))
        assert chunks(srv) > 0
    finally:
        srv.stop()


def test_a_grammar_constrains_the_answer_after_the_last_chunk_only(model_dir, tmp_path):
    """The chunks before the last sample nothing the client sees, so a grammar's state starts at the
    answer's first token, as when the prompt is prefilled whole."""
    srv = serve_small(model_dir, tmp_path, *CHUNKS)
    try:
        prompt = SYSTEM + " answer with a number between the brackets please and stop"
        grammar = {"type": "regex", "value": "[0-9]{3,6}"}
        before = chunks(srv)
        chunked, text = asyncio.run(_generate(srv.url, prompt, 8, grammar=grammar))
        assert chunks(srv) > before
        whole, _ = asyncio.run(_generate(srv.url, prompt, 8, grammar=grammar, decoder_input_details=True))
        assert chunked == whole and text.isdigit() and 3 <= len(text) <= 6
    finally:
        srv.stop()
