"""Chunked prefill on the real server (tiny model, CPU): with --max-batch-prefill-tokens below the prompts'
length, prompts are prefilled in chunks between decode steps, and every answer is still the one computed
whole: transformers' greedy tokens, or the same server's answer with every prompt token computed in one
prefill (a request wanting its prompt's log-probabilities is never chunked). With prefix caching on and
off, on 2 shards over a float8 KV cache, and under a grammar."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import (
    alive,
    get_json,
    greedy_reference,
    run_in_slices,
    serve_small,
    shard_of,
    stream_ids,
)
from tests.runtime.prefix_checks import SYSTEM, bypassed, check_conversations, generate

pytestmark = pytest.mark.slow

CHUNKS = ("--max-batch-prefill-tokens", "16")  # four blocks of 4: prompts of 17 tokens or more are chunked


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def chunks(srv) -> int:
    return get_json(srv.url + "/info")[1]["prefill_chunks"]


def chunks_in_step(srv) -> int:
    return get_json(srv.url + "/info")[1]["prefill_chunks_in_step"]


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


def test_chunks_ride_the_decode_steps_of_a_running_stream(model_dir, tmp_path):
    """A long prompt that arrives while a stream runs is prefilled in chunks computed in the forward passes of
    the stream's decode steps (one pass for both, not a chunk's pass and then a step's), its last chunk too:
    both answers are still transformers' greedy tokens."""
    srv = serve_small(model_dir, tmp_path, *CHUNKS)
    try:
        short, long = "hello world", SYSTEM + " the gaudi card shard router token batch cache serve request stream answer" * 2
        assert len(greedy_reference(model_dir, short, 40)) == 40  # the stream outlasts the long prompt's chunks
        streamed, answered = asyncio.run(_stream_while_a_long_prompt_arrives(srv, short, long))
        assert streamed == greedy_reference(model_dir, short, 40)
        assert answered == greedy_reference(model_dir, long, 8)
        assert chunks(srv) >= 2 and chunks_in_step(srv) == chunks(srv) + 1  # every chunk, the last one too
    finally:
        srv.stop()


async def _stream_while_a_long_prompt_arrives(srv, short: str, long: str) -> tuple[list[int], list[int]]:
    """The stream's tokens and the long prompt's. The shard runs in slices of a few ms from before the stream
    until the stream runs, then stays stopped until the router has queued the long prompt: it joins a batch
    whose stream has tokens left however fast or loaded this machine is."""
    shard = shard_of(srv)
    async with aiohttp.ClientSession() as s:
        os.kill(shard, signal.SIGSTOP)
        try:
            stream = asyncio.ensure_future(stream_ids(s, srv.url, short, 40))
            await asyncio.to_thread(run_in_slices, lambda: [shard], lambda: gauge(srv.url, "running") >= 1, 120, 0.005)
            answer = asyncio.ensure_future(_generate(srv.url, long, 8))
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(gauge, srv.url, "waiting") < 1:
                assert time.monotonic() < deadline and not answer.done()
                await asyncio.sleep(0.02)  # poll interval of a deadline-bounded wait (the shard is stopped)
        finally:
            if alive(shard):
                os.kill(shard, signal.SIGCONT)
        return await stream, (await answer)[0]


def gauge(url: str, which: str) -> float:
    """vLLM's gauge of the requests `which` ("waiting" or "running")."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == f"vllm:num_requests_{which}")
