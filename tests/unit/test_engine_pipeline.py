"""The router keeps the next decode step queued on the shards while one computes, and runs several
steps per call while no request waits; what users receive is unchanged by either: each request
gets exactly its tokens and its finish reason."""

from __future__ import annotations

import pytest

from gaudi_runtime.router.batching import PIPELINE_DEPTH
from gaudi_runtime.router.scheduler import DECODE_CALL_BUDGET_MS
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import FinishReason
from gaudi_runtime.tools.tiny_model import train_tokenizer
from tests.unit.scripted_shards import TOKEN, ScriptedShards, serve


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_next_step_is_queued_while_one_computes_and_each_request_gets_exactly_its_tokens(tokenizer, decode_steps):
    eos = tokenizer.eos_token_ids[0]
    shards = ScriptedShards(eos, eos_at={1: 3})  # request 1 meets EOS at its 3rd token
    (eos_tokens, eos_end), (len_tokens, len_end) = serve(shards, tokenizer, [10, 6], decode_steps)
    assert eos_tokens == [TOKEN, TOKEN, eos] and eos_end.finish_reason == FinishReason.EOS_TOKEN
    assert len_tokens == [TOKEN] * 6 and len_end.finish_reason == FinishReason.LENGTH
    assert eos_end.generated_tokens == 3 and len_end.generated_tokens == 6
    # The shards never waited on a round trip: each decode after the first was made before the one
    # ahead of it answered.
    assert max(unanswered for _, unanswered, _, _ in shards.decodes) == PIPELINE_DEPTH - 1
    # Two requests and none waiting: the calls ran up to decode_steps steps each.
    assert max(steps for *_, steps, _ in shards.decodes) == min(decode_steps, 6 - 1)
    # No call asks for a token past a request's max_new_tokens (the prefill gave the first) ...
    assert sum(steps for ids, _, steps, _ in shards.decodes if 2 in ids) == 6 - 1
    # ... and a request that met EOS is named at most by the rest of its call and the calls already
    # made when it did.
    assert shards.generated[1] <= 3 + (decode_steps - 1) + (PIPELINE_DEPTH - 1) * decode_steps


def test_one_step_per_call_while_a_request_waits(tokenizer):
    """Several steps per call would hold back a waiting prompt's prefill."""
    eos = tokenizer.eos_token_ids[0]
    n = 7

    # KV room for three requests (3 blocks each): the others wait for a prefill while those run,
    # and requests meet EOS one after another, so they join one by one.
    shards = ScriptedShards(eos, eos_at={rid: 2 * rid for rid in range(1, n + 1)}, num_blocks=3 * 3)
    results = serve(shards, tokenizer, [40] * n)
    assert [len(tokens) for tokens, _ in results] == [2 * rid for rid in range(1, n + 1)]
    assert any(waiting for *_, waiting in shards.decodes)
    for ids, _, steps, waiting in shards.decodes:
        if waiting:
            assert steps == 1, (ids, waiting)
    assert any(steps > 1 for *_, steps, _ in shards.decodes)  # once none waits


@pytest.mark.parametrize("step_ms, most_steps", [(2.0, 4), (8.0, 2), (30.0, 1)])
def test_slow_steps_run_one_per_call_so_a_new_prompt_waits_little(tokenizer, step_ms, most_steps):
    """A call's steps fit DECODE_CALL_BUDGET_MS at the step time the shards report: a prompt that
    arrives waits behind the calls already made, so long steps are not grouped."""
    eos = tokenizer.eos_token_ids[0]
    shards = ScriptedShards(eos, eos_at={}, step_ms=step_ms)
    results = serve(shards, tokenizer, [24, 24], decode_steps=4)
    assert [len(tokens) for tokens, _ in results] == [24, 24]
    # The first calls, made before any step was measured, take --decode-steps; the rest fit the budget.
    later = [steps for *_, steps, _ in shards.decodes[PIPELINE_DEPTH + 1:]]
    assert max(later) == most_steps == max(1, min(4, int(DECODE_CALL_BUDGET_MS // step_ms)))


def test_a_finished_requests_last_step_never_writes_into_blocks_a_new_request_took(tokenizer):
    """With room for two requests' blocks, each new request takes the blocks of one that met EOS
    while a decode naming it was still queued; that stale step must run before the new prefill."""
    eos = tokenizer.eos_token_ids[0]
    shards = ScriptedShards(eos, eos_at={rid: 2 + rid % 3 for rid in range(1, 9)}, num_blocks=2)
    results = serve(shards, tokenizer, [12] * 8)
    assert [len(tokens) for tokens, _ in results] == [2 + rid % 3 for rid in range(1, 9)]
    assert all(end.finish_reason == FinishReason.EOS_TOKEN for _, end in results)
    assert len(set(shards.owner)) == 2 and len(shards.blocks) == 8  # the blocks were taken over, again and again
    # Steps were computed past an EOS (a queued call named the request) ...
    assert sum(shards.generated.values()) > sum(len(tokens) for tokens, _ in results)
    # ... and each ran before the prefill of the request that took the blocks over.
    assert shards.stale_writes == []


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_tokens_stream_in_order_when_answers_arrive_out_of_order(tokenizer, decode_steps):
    eos = tokenizer.eos_token_ids[0]
    shards = ScriptedShards(eos, eos_at={1: 5}, swap_answers=True)
    (first, first_end), (second, second_end) = serve(shards, tokenizer, [10, 12], decode_steps)
    assert first == [TOKEN + n for n in range(1, 5)] + [eos] and first_end.finish_reason == FinishReason.EOS_TOKEN
    assert second == [TOKEN + n for n in range(1, 13)] and second_end.finish_reason == FinishReason.LENGTH


def test_a_request_the_shards_protocol_cannot_carry_fails_alone(tokenizer):
    """Validation refuses such values; should one get through, its request ends with an error and
    the engine goes on serving the others."""
    import asyncio
    from dataclasses import replace

    from gaudi_runtime.router.types import GenerationError
    from tests.unit.scripted_shards import collect, make_engine, request

    eos = tokenizer.eos_token_ids[0]
    engine = make_engine(ScriptedShards(eos, eos_at={}), tokenizer)
    bad = request(4)
    bad = replace(bad, sampling=replace(bad.sampling, top_k=2**32))  # a uint32 on the wire

    async def run():
        await engine.start()
        try:
            results = await asyncio.wait_for(asyncio.gather(collect(engine, bad), collect(engine, request(4)),
                                                            return_exceptions=True), 30)
            return results, engine.health()
        finally:
            await engine.stop()

    (failed, (tokens, end)), (ok, _) = asyncio.run(run())
    assert isinstance(failed, GenerationError) and "cannot be sent to the shards" in str(failed)
    assert tokens == [TOKEN] * 4 and end.finish_reason == FinishReason.LENGTH
    assert ok
