"""A prompt longer than --max-batch-prefill-tokens is prefilled in chunks, each between two decode
steps of the running requests; every chunk reads exactly the KV the chunks before it wrote, and each
request still gets exactly its tokens (the scripted shards check every KV read and write)."""

from __future__ import annotations

import asyncio

import pytest

from gaudi_runtime import buckets
from gaudi_runtime.config import resolve
from gaudi_runtime.router.scheduler import Waiting, chunk_end, needs_chunks, select_prefill
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.tools.tiny_model import train_tokenizer
from tests.unit.scripted_shards import TOKEN, ScriptedShards, collect, make_engine, request

LONG = list(range(100, 200))  # 100 prompt tokens: chunks of 32 (two blocks of 16) end at 32, 64, 96, 100
CHUNKED = {"MAX_BATCH_PREFILL_TOKENS": "40"}  # 40 tokens hold two whole blocks: chunks of 32


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


def cfg(**env: str):
    return resolve(None, {"MODEL_ID": "unused", **CHUNKED, **env})


def test_chunks_are_whole_blocks_and_the_last_one_takes_what_fits():
    c = cfg()
    ends, done = [], 0
    while done < len(LONG):
        done = chunk_end(done, len(LONG), c)
        ends.append(done)
    assert ends == [32, 64, 100]  # 36 tokens left after 64 fit one prefill's 40
    assert chunk_end(16, 60, c) == 48 and chunk_end(16, 56, c) == 56 and chunk_end(0, 40, c) == 40


def test_a_long_prompt_goes_alone_and_only_when_no_other_is_being_chunked():
    c = cfg()
    short, long = Waiting(20, 8), Waiting(len(LONG), 8)
    assert needs_chunks(long, c) and not needs_chunks(short, c)
    assert not needs_chunks(Waiting(len(LONG), 8, chunkable=False), c)  # images, prompt log-probabilities
    assert not needs_chunks(Waiting(len(LONG), 8, cached_tokens=64), c)  # what is left fits one prefill
    assert select_prefill([long, short], running=0, free_blocks=100, cfg=c) == 1
    assert select_prefill([short, long], running=0, free_blocks=100, cfg=c) == 1  # it waits for the next
    assert select_prefill([long, short], running=0, free_blocks=100, cfg=c, chunks=False) == 0
    assert select_prefill([long], running=0, free_blocks=3, cfg=c) == 0  # its blocks do not fit yet


def test_chunks_are_warmed_as_prefills_over_cached_blocks_with_prefix_caching_off_too():
    assert buckets.prefill_context_buckets(cfg(PREFIX_CACHING="false", MAX_INPUT_TOKENS="100"))
    assert not buckets.prefill_context_buckets(cfg(PREFIX_CACHING="false", MAX_INPUT_TOKENS="40"))


def run(shards: ScriptedShards, tokenizer, requests, **env: str):
    """Serve `requests` (each starting once the one before it streamed a token), all through an engine
    over `shards` with chunks of 32; returns each one's (token ids, end)."""
    engine = make_engine(shards, tokenizer, decode_steps=1, **{**CHUNKED, **env})

    async def go():
        await engine.start()
        try:
            tasks = []
            for req in requests:
                tasks.append(asyncio.create_task(collect(engine, req)))
                while not shards.generated and not tasks[-1].done():
                    # Yield to the engine, no timer: the others arrive right after the first token, at
                    # the same point of the loop every run (a timed poll lets it run on a varying number
                    # of steps). go() as a whole is bounded by wait_for.
                    await asyncio.sleep(0)
            return await asyncio.gather(*tasks)
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(go(), 30))


def prefills_of(shards: ScriptedShards, rid: int) -> list[tuple[int, int]]:
    return [p[rid] for kind, p in shards.calls if kind == "prefill" and rid in p]


def test_a_long_prompt_is_prefilled_chunk_by_chunk_between_decode_steps(tokenizer):
    shards = ScriptedShards(tokenizer.eos_token_ids[0], eos_at={})
    (short_tokens, _), (long_tokens, long_end) = run(
        shards, tokenizer, [request(24), request(6, prompt=LONG)])
    assert short_tokens == [TOKEN] * 24 and long_tokens == [TOKEN] * 6 and long_end.generated_tokens == 6
    assert prefills_of(shards, 2) == [(0, 32), (32, 64), (64, 100)]  # each over the KV the ones before wrote
    assert not shards.bad_reads and not shards.stale_writes
    # Between two chunks the running request got a decode step: it never waited for the whole prompt.
    order = [kind if kind != "prefill" else ("chunk" if 2 in p else "prefill") for kind, p in shards.calls]
    chunk_at = [i for i, kind in enumerate(order) if kind == "chunk"]
    for a, b in zip(chunk_at, chunk_at[1:], strict=False):
        assert "decode" in order[a:b], order
    assert sum(1 for kind, p in shards.calls if kind == "clear") >= 2  # the first two chunks' batches dropped


def test_a_second_prompt_with_the_same_start_reads_the_blocks_the_chunks_wrote(tokenizer):
    """The blocks of a chunk are offered to other requests once that chunk's prefill is made, not
    before: the same long prompt, sent again while the first is being chunked, finds the blocks of the
    two chunks made by then and computes the rest, which now fits one prefill."""
    shards = ScriptedShards(tokenizer.eos_token_ids[0], eos_at={})
    results = run(shards, tokenizer, [request(24), request(4, prompt=LONG), request(4, prompt=LONG)])
    assert [len(tokens) for tokens, _ in results] == [24, 4, 4]
    assert prefills_of(shards, 3) == [(64, 100)]
    assert not shards.bad_reads and not shards.stale_writes
    # Sent once the first has ended, the prompt finds every full block but its last token's.
    shards = ScriptedShards(tokenizer.eos_token_ids[0], eos_at={})
    engine_run = run(shards, tokenizer, [request(2, prompt=LONG)])
    assert [len(tokens) for tokens, _ in engine_run] == [2]


def test_without_prefix_caching_chunks_still_read_what_they_wrote(tokenizer):
    shards = ScriptedShards(tokenizer.eos_token_ids[0], eos_at={})
    results = run(shards, tokenizer, [request(8), request(3, prompt=LONG)], PREFIX_CACHING="false")
    assert [len(tokens) for tokens, _ in results] == [8, 3]
    assert prefills_of(shards, 2) == [(0, 32), (32, 64), (64, 100)]
    assert not shards.bad_reads and not shards.stale_writes
