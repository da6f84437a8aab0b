"""The router keeps the next decode step queued on the shards while one computes, and runs several
steps per call while no request waits; what users receive is unchanged by either: each request
gets exactly its tokens and its finish reason."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.engine import PIPELINE_DEPTH, BatchingEngine
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import FinishReason, StoppingParameters, ValidRequest
from gaudi_runtime.tools.tiny_model import train_tokenizer

TOKEN = 40  # what the scripted shards generate, until a request's scripted EOS


class ScriptedShards:
    """Stands in for ShardClient: runs calls (a decode of one or more steps) in the order they were
    made, as numbered calls do on real shards, and answers TOKEN for each request and step, or EOS at
    the step `eos_at` gives it."""

    def __init__(self, eos_id: int, eos_at: dict[int, int], num_blocks: int = 64, swap_answers: bool = False):
        self.eos_id, self.eos_at, self.num_blocks = eos_id, eos_at, num_blocks
        # Answer calls in pairs, the second first (gRPC does not promise answers in call order); the
        # n-th token of a request is then TOKEN + n, so that its order shows.
        self.swap_answers = swap_answers
        self.answered: set[int] = set()
        self.made = 0
        self.blocks: dict[int, list[int]] = {}  # request id -> its KV blocks
        self.owner: dict[int, int] = {}  # block -> the request whose prefill wrote it last
        self.stale_writes: list[tuple[int, int]] = []  # (request, block another request owns) a step wrote
        self.generated: dict[int, int] = {}  # request id -> tokens computed for it
        # Each decode call: the requests it names, decodes unanswered when it was made, its steps, and
        # how many requests waited for a prefill then.
        self.decodes: list[tuple[list[int], int, int, int]] = []
        self.engine: BatchingEngine | None = None
        self.unanswered = 0
        self._turns = itertools.count()
        self._done = 0
        self._changed = asyncio.Condition()

    async def connect(self, timeout_s, alive=None):
        pass

    async def info(self):
        return pb.InfoResponse(block_size=16, num_blocks=self.num_blocks, eos_token_ids=[self.eos_id],
                               max_position_embeddings=4096, dtype="float32", device_type="cpu")

    async def warmup(self, on_progress):
        on_progress(0, 0, "done")

    async def close(self):
        pass

    def _turn(self) -> int:
        self.made += 1
        return next(self._turns)

    async def _in_turn(self, turn: int, work):
        async with self._changed:
            await self._changed.wait_for(lambda: self._done == turn)
            result = work()
            self._done += 1
            self._changed.notify_all()
            if self.swap_answers and turn % 2 == 0:  # wait for the next call's answer, if it was made
                await self._changed.wait_for(lambda: turn + 1 in self.answered or self.made == turn + 1)
            self.answered.add(turn)
            self._changed.notify_all()
        return result

    def _tokens(self, ids: list[int]) -> pb.Generations:
        out = []
        for rid in ids:
            self.generated[rid] = self.generated.get(rid, 0) + 1
            token = TOKEN + self.generated[rid] if self.swap_answers else TOKEN
            out.append(self.eos_id if self.generated[rid] == self.eos_at.get(rid) else token)
        return pb.Generations(request_ids=ids, token_ids=out, logprobs=[0.0] * len(ids))

    def _write_kv(self, ids: list[int]) -> None:
        for rid in ids:
            self.stale_writes += [(rid, b) for b in self.blocks[rid] if self.owner[b] != rid]

    def prefill(self, batch: pb.Batch):
        ids = [r.id for r in batch.requests]
        blocks = {r.id: list(r.blocks) for r in batch.requests}

        def answer():
            self.blocks.update(blocks)
            self.owner.update({b: rid for rid, bs in blocks.items() for b in bs})
            return pb.PrefillResponse(generations=self._tokens(ids), batch=pb.CachedBatch(id=batch.id, request_ids=ids))
        return self._in_turn(self._turn(), answer)

    def decode(self, batches: list[pb.CachedBatch], steps: int = 1):
        ids = [rid for b in batches for rid in b.request_ids]
        self.decodes.append((ids, self.unanswered, steps, len(self.engine.waiting)))
        self.unanswered += 1

        def answer():
            self.unanswered -= 1
            gens = []
            for _ in range(steps):
                self._write_kv(ids)
                gens.append(self._tokens(ids))
            return pb.DecodeResponse(generations=gens[0], next_steps=gens[1:],
                                     batch=pb.CachedBatch(id=batches[0].id, request_ids=ids))
        return self._in_turn(self._turn(), answer)

    def clear(self, batch_id=None):
        return self._in_turn(self._turn(), lambda: None)


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


def request(max_new_tokens: int) -> ValidRequest:
    return ValidRequest(input_ids=[5, 6, 7], inputs="abc", sampling=SamplingParameters(),
                        stopping=StoppingParameters(max_new_tokens=max_new_tokens))


def serve(shards: ScriptedShards, tokenizer, max_new_tokens: list[int], decode_steps: int = 4):
    """Run one request per entry of `max_new_tokens`, all at once, through an engine over `shards`;
    returns each request's (token ids, end)."""
    engine = BatchingEngine(resolve(None, {"MODEL_ID": "unused", "DECODE_STEPS": str(decode_steps)}), shards,
                            tokenizer)
    shards.engine = engine

    async def run():
        await engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(collect(engine, request(n)) for n in max_new_tokens)), 30)
        finally:
            await engine.stop()

    return asyncio.run(run())


async def collect(engine: BatchingEngine, req: ValidRequest):
    tokens, end = [], None
    async for ev in engine.generate(req):
        tokens.append(ev.token.id)
        end = ev.end
    return tokens, end


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
