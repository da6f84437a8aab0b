"""Prefix caching in the router: a request that starts with tokens another request already computed
gets those KV blocks instead of fresh ones, and the shards compute only the rest; whatever the
traffic (conversations resending their history, requests ending early, cancelled, or waiting for
room), every block a request reads holds that request's own tokens, and an idle engine holds none."""

from __future__ import annotations

import asyncio
import random

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests
from gaudi_runtime.router.prefix_cache import chain_hashes, image_extras, root_hash
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import StoppingParameters, ValidRequest
from gaudi_runtime.tools.tiny_model import train_tokenizer
from tests.unit.scripted_shards import BLOCK_SIZE, ScriptedShards, make_engine

BS = BLOCK_SIZE


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


def valid(ids: list[int], max_new_tokens: int = 8, **kw) -> ValidRequest:
    return ValidRequest(input_ids=list(ids), inputs="x", sampling=SamplingParameters(),
                        stopping=StoppingParameters(max_new_tokens=max_new_tokens), **kw)


def registry(num_blocks: int = 32, **env) -> Requests:
    cfg = resolve(None, {"MODEL_ID": "unused", "DEVICE": "cpu", **env})
    requests = Requests(cfg, EngineMetrics(None))
    requests.allocator = BlockAllocator(num_blocks)
    return requests


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- the allocator and the hashes ------------------------------------------------------------

def test_a_cached_block_stays_until_its_room_is_needed_least_recently_used_first():
    a = BlockAllocator(4)
    first, second = a.allocate(2), a.allocate(2)
    assert a.register(first[0], b"h0") and a.register(second[0], b"h1")
    a.free(first)
    a.free(second)
    assert a.free_count == 4 and a.cached_count == 2
    assert a.lookup([b"h0"]) == [first[0]]
    a.acquire([first[0]])  # a hit revives it: no longer free
    assert a.free_count == 3
    fresh = a.allocate(3)  # the plain free blocks first, then the cached one no request holds
    assert second[0] in fresh and first[0] not in fresh
    assert a.lookup([b"h1"]) == [] and a.lookup([b"h0"]) == [first[0]]
    with pytest.raises(ValueError):
        a.allocate(1)


def test_a_shared_block_is_freed_by_its_last_holder_and_a_forgotten_one_is_plain_again():
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    a.register(b, b"h")
    a.acquire([b])
    a.free([b])
    assert a.free_count == 1  # still held once
    assert not a.register(b, b"other") and not a.register(a.allocate(1)[0], b"h")  # one block per hash
    a.forget(b)
    a.free([b])
    assert a.lookup([b"h"]) == [] and a.cached_count == 0


def test_a_block_hash_names_its_tokens_everything_before_them_and_the_images_in_them():
    root = root_hash(resolve(None, {"MODEL_ID": "m"}))
    ids = tokens(3 * BS)
    base = chain_hashes(ids, BS, root)
    assert len(base) == 3 and chain_hashes(ids + [1, 2], BS, root) == base  # a partial block has no hash
    changed = chain_hashes(ids[:BS] + [7] + ids[BS + 1:], BS, root)
    assert changed[0] == base[0] and changed[1:] != base[1:] and changed[2] != base[2]
    assert chain_hashes(ids, BS, root_hash(resolve(None, {"MODEL_ID": "m", "KV_CACHE_DTYPE": "fp8_e4m3fn"})))[0] \
        != base[0]
    cat, dog = image_extras([BS + 3], [b"cat"], BS), image_extras([BS + 3], [b"dog"], BS)
    with_cat, with_dog = chain_hashes(ids, BS, root, cat), chain_hashes(ids, BS, root, cat)
    assert with_cat == with_dog and with_cat[0] == base[0] and with_cat[1] != base[1]
    assert chain_hashes(ids, BS, root, dog)[1:] != with_cat[1:]


# ---- which blocks a request takes --------------------------------------------------------------

def take_one(requests: Requests, req: ValidRequest):
    requests.add(req, None)
    [taken] = requests.take(1)
    return taken


def finish(requests: Requests, state, output: list[int]) -> None:
    state.output_ids, state.sent = list(output), len(output)
    requests.end(state)


def test_a_prompt_cached_whole_still_computes_its_last_block():
    requests = registry()
    prompt = tokens(3 * BS)  # ends on a block boundary
    first = take_one(requests, valid(prompt))
    assert first.cached_tokens == 0
    second = take_one(requests, valid(prompt))
    assert second.cached_tokens == 2 * BS and second.blocks[:2] == first.blocks[:2]
    assert second.blocks[2] != first.blocks[2]  # the last prompt token's block is computed again, privately
    longer = take_one(requests, valid(prompt + [5]))
    assert longer.cached_tokens == 3 * BS  # the third block is whole and final: shared from the first


def test_prompt_logprobs_are_computed_for_every_token_but_the_blocks_still_serve_others():
    requests = registry()
    prompt = tokens(3 * BS + 4)
    details = take_one(requests, valid(prompt, decoder_input_details=True))
    assert details.cached_tokens == 0
    again = take_one(requests, valid(prompt, decoder_input_details=True))
    assert again.cached_tokens == 0
    plain = take_one(requests, valid(prompt))
    assert plain.cached_tokens == 3 * BS and plain.blocks[:3] == details.blocks[:3]


def test_requests_of_one_prefill_share_the_blocks_the_first_of_them_fills():
    requests = registry()
    prompt = tokens(2 * BS + 5)
    for _ in range(3):
        requests.add(valid(prompt), None)
    first, *others = requests.take(3)
    assert first.cached_tokens == 0
    for s in others:
        assert s.cached_tokens == 2 * BS and s.blocks[:2] == first.blocks[:2]
    per_request = -(-(len(prompt) + 8) // BS)
    assert requests.allocator.free_count == 32 - per_request - 2 * (per_request - 2)


def test_generated_blocks_are_cached_only_where_every_token_was_fed_back():
    requests = registry()
    prompt = tokens(BS + 10)
    first = take_one(requests, valid(prompt, max_new_tokens=40))
    answer, blocks = [7] * 30, list(first.blocks)
    finish(requests, first, answer)  # 30 tokens streamed; the calls made fed back all but the last
    # prompt + 29 fed tokens = 55 positions: 3 full blocks
    assert requests.allocator.cached_count == 3
    turn2 = take_one(requests, valid(prompt + answer + tokens(20, 200)))
    assert turn2.cached_tokens == 3 * BS and turn2.blocks[:3] == blocks[:3]


def test_a_request_that_failed_leaves_nothing_cached():
    from gaudi_runtime.router.types import GenerationError

    requests = registry()
    prompt = tokens(3 * BS)
    failed = take_one(requests, valid(prompt))
    requests.end(failed, GenerationError("shards failed"))
    assert requests.allocator.cached_count == 0 and requests.allocator.free_count == 32
    assert take_one(requests, valid(prompt)).cached_tokens == 0


def test_admission_counts_only_the_blocks_a_request_must_fill():
    requests = registry(num_blocks=8)
    prompt = tokens(4 * BS + 3)
    running = take_one(requests, valid(prompt, max_new_tokens=8))  # 5 blocks held
    requests.add(valid(prompt, max_new_tokens=8), None)
    [view] = requests.waiting_view(1)
    assert (view.cached_tokens, view.held_blocks) == (4 * BS, 4)  # 4 of its 5 blocks are the running one's
    [second] = requests.take(1)
    assert second.blocks[:4] == running.blocks[:4] and requests.allocator.free_count == 2


def test_caching_off_looks_up_and_registers_nothing():
    requests = registry(PREFIX_CACHING="false")
    prompt = tokens(3 * BS)
    first = take_one(requests, valid(prompt))
    finish(requests, first, [7] * 5)
    assert requests.allocator.cached_count == 0
    assert take_one(requests, valid(prompt)).cached_tokens == 0


# ---- the engine over scripted shards: every block read holds the reader's own tokens ---------

async def converse(engine, system: list[int], rng: random.Random, turns: int, cancel_at: int | None = None):
    """A conversation: each turn sends the whole history (its answers included) and a new message."""
    history = list(system)
    for turn in range(turns):
        history += [rng.randrange(50, 250) for _ in range(rng.randint(3, 30))]
        answer = []
        agen = engine.generate(valid(history, max_new_tokens=rng.randint(1, 20)))
        async for ev in agen:
            answer.append(ev.token.id)
            if turn == cancel_at and len(answer) == 2:  # its client goes away mid-answer
                await agen.aclose()
                break
        history += answer


def run_conversations(tokenizer, *, conversations: int, turns: int, num_blocks: int, decode_steps: int = 4,
                      seed: int = 0) -> ScriptedShards:
    eos = tokenizer.eos_token_ids[0]
    rng = random.Random(seed)
    shards = ScriptedShards(eos, eos_at={rid: rng.randint(2, 25) for rid in range(1, 400)}, num_blocks=num_blocks,
                            varied=True)
    engine = make_engine(shards, tokenizer, decode_steps)
    system = [rng.randrange(50, 250) for _ in range(2 * BS + 7)]

    async def run():
        await engine.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(
                converse(engine, system, random.Random(seed * 100 + c), turns, cancel_at=1 if c % 3 == 0 else None)
                for c in range(conversations))), 60)
            alloc = engine.requests.allocator
            assert alloc.free_count == alloc.num_blocks  # idle: every block free or merely cached
            assert not alloc._refs and alloc.cached_count == len(alloc._evictable)
            info = engine.info()
            assert info["kv_blocks_free"] == info["kv_blocks"] and info["prefix_caching"] is True
        finally:
            await engine.stop()

    asyncio.run(run())
    return shards


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_concurrent_conversations_behind_one_system_prompt_read_only_their_own_tokens(tokenizer, decode_steps):
    shards = run_conversations(tokenizer, conversations=6, turns=4, num_blocks=200, decode_steps=decode_steps)
    assert shards.bad_reads == [] and shards.stale_writes == []
    cached = [c for c in shards.cached_tokens.values() if c]
    assert len(cached) > 12  # the system prompt, and each conversation's earlier turns, were not computed again
    assert max(cached) > 4 * BS
    # Steps past a request's end were computed (queued calls named it): their writes went nowhere read.
    assert any(shards.generated[rid] > shards.eos_at[rid] for rid in shards.generated)


def test_under_memory_pressure_cached_blocks_are_evicted_and_nothing_fails_or_reads_wrong(tokenizer):
    """Room for about three conversations at a time, nine of them: cached prefixes are evicted and
    taken over again and again."""
    shards = run_conversations(tokenizer, conversations=9, turns=4, num_blocks=3 * 11, seed=5)
    assert shards.bad_reads == [] and shards.stale_writes == []
    assert any(shards.cached_tokens.values())
    assert len(shards.owner) == 3 * 11  # every block was filled by some request's prefill


def test_a_request_sharing_the_prompt_of_one_the_shards_cannot_carry_waits_and_reads_no_empty_block(tokenizer):
    """The two share a prompt and one prefill; the first cannot be sent (validation should have
    refused it), so the blocks the second was to read from it are never written: the second waits
    for the next prefill and computes them itself."""
    from dataclasses import replace

    from gaudi_runtime.router.types import GenerationError
    from tests.unit.scripted_shards import collect

    shards = ScriptedShards(tokenizer.eos_token_ids[0], eos_at={}, varied=True)
    engine = make_engine(shards, tokenizer)
    prompt = tokens(3 * BS + 5)
    bad = valid(prompt, max_new_tokens=4)
    bad = replace(bad, sampling=replace(bad.sampling, top_k=2**32))  # a uint32 on the wire

    async def run():
        await engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(collect(engine, bad), collect(engine, valid(prompt, 4)),
                                                         return_exceptions=True), 30)
        finally:
            await engine.stop()

    failed, (answer, end) = asyncio.run(run())
    assert isinstance(failed, GenerationError) and len(answer) == 4 and end is not None
    assert shards.bad_reads == [] and list(shards.cached_tokens.values()) == [0]
    assert engine.requests.allocator.free_count == engine.requests.allocator.num_blocks
