"""Whatever ends a request (EOS, its token budget, a stop sequence, its caller leaving while it waits,
runs or is being prefilled, a shard failure), its KV blocks go back exactly once, and an idle engine
holds none."""

from __future__ import annotations

import asyncio
import time

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.router import engine as engine_module
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import FinishReason, GenerationError, StreamEvent, Token
from gaudi_runtime.tools.tiny_model import train_tokenizer
from tests.unit.scripted_shards import TOKEN, ScriptedShards, collect, make_engine, request


class CheckedAllocator(BlockAllocator):
    """Counts what is handed out and given back, and records any block given back while free."""

    def __init__(self, num_blocks: int, **kw):
        super().__init__(num_blocks, **kw)
        self.held: set[int] = set()
        self.double_frees: list[int] = []
        self.allocations = self.frees = 0

    def allocate(self, n: int) -> list[int]:
        taken = super().allocate(n)
        self.held.update(taken)
        self.allocations += 1
        return taken

    def free(self, blocks: list[int]) -> None:
        self.double_frees += [b for b in blocks if b not in self.held]
        self.held.difference_update(blocks)
        self.frees += 1
        super().free(blocks)


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


@pytest.fixture
def allocators(monkeypatch) -> list[CheckedAllocator]:
    """The engine's block allocator, checked (appended when the engine starts)."""
    made: list[CheckedAllocator] = []

    def checked(num_blocks: int, **kw) -> CheckedAllocator:
        made.append(CheckedAllocator(num_blocks, **kw))
        return made[-1]

    monkeypatch.setattr(engine_module, "BlockAllocator", checked)
    return made


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def blocks_free(engine) -> int:
    return engine.info()["kv_blocks_free"]


def assert_each_given_back_once(allocator: CheckedAllocator) -> None:
    assert allocator.double_frees == []
    assert allocator.frees == allocator.allocations > 0
    assert allocator.free_count == allocator.num_blocks


def test_ending_a_request_twice_or_while_it_waits_gives_back_nothing_more(tokenizer):
    requests = Requests(resolve(None, {"MODEL_ID": "unused"}), EngineMetrics(None))
    requests.allocator = CheckedAllocator(64)
    first, second = requests.add(request(10), tokenizer), requests.add(request(10), tokenizer)
    assert requests.take(1) == [first] and first.blocks
    last = StreamEvent(Token(TOKEN, "F", 0.0, False))
    requests.end(first, last)
    requests.end(first, GenerationError("the shards failed"))  # a failure noticed after it finished
    requests.end(second)  # its caller left while it waited
    assert list(requests.waiting) == [] and requests.get(first.id) is None and requests.get(second.id) is None
    assert first.events.get_nowait() is last and first.events.empty() and second.events.empty()
    assert_each_given_back_once(requests.allocator)


def test_every_way_a_request_ends_gives_its_blocks_back_once(tokenizer, allocators):
    eos = tokenizer.eos_token_ids[0]

    async def run():
        gate = asyncio.Event()  # cleared: the shards hold every call
        shards = ScriptedShards(eos, eos_at={3: 3}, gate=gate)
        engine = make_engine(shards, tokenizer)
        await engine.start()
        total = engine.info()["kv_blocks"]
        try:
            # Cancelled while its prefill runs (request 1).
            prefilled = asyncio.ensure_future(collect(engine, request(40)))
            await until(lambda: engine.queue_size() == 0 and blocks_free(engine) < total)
            prefilled.cancel()
            await asyncio.gather(prefilled, return_exceptions=True)
            assert blocks_free(engine) == total

            # Cancelled while it waits (request 2): the loop is still waiting on request 1's calls.
            waiting = asyncio.ensure_future(collect(engine, request(40)))
            await until(lambda: engine.queue_size() == 1)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            assert engine.queue_size() == 0 and blocks_free(engine) == total
            gate.set()

            # Finished: request 3 meets EOS at its 3rd token, 4 its budget of 5, 5 a stop sequence of two tokens.
            stop = tokenizer.decode([TOKEN]) * 2
            results = await asyncio.wait_for(asyncio.gather(
                collect(engine, request(10)), collect(engine, request(5)), collect(engine, request(10, (stop,)))), 30)
            reasons = [end.finish_reason for _, end in results]
            assert reasons == [FinishReason.EOS_TOKEN, FinishReason.LENGTH, FinishReason.STOP_SEQUENCE]
            await until(lambda: blocks_free(engine) == total)

            # Cancelled while running (request 6): its caller leaves after two tokens; the blocks go back at once.
            stream = engine.generate(request(40))
            await anext(stream)
            await anext(stream)
            assert blocks_free(engine) < total
            await stream.aclose()
            assert blocks_free(engine) == total

            assert 1 in shards.blocks and 2 not in shards.blocks  # 1's prefill ran (its tokens dropped), 2's never
            assert shards.stale_writes == []
        finally:
            gate.set()
            await engine.stop()
        return total

    total = asyncio.run(run())
    assert allocators[0].num_blocks == total
    assert_each_given_back_once(allocators[0])


def test_a_shard_failure_ends_every_request_with_an_error_and_gives_their_blocks_back(tokenizer, allocators):
    eos = tokenizer.eos_token_ids[0]

    async def run():
        # Room for three requests of 3 blocks: the fourth waits. The fourth call the shards get fails.
        shards = ScriptedShards(eos, eos_at={}, num_blocks=3 * 3, fail_at=3)
        engine = make_engine(shards, tokenizer)
        await engine.start()
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(collect(engine, request(40)) for _ in range(4)), return_exceptions=True), 30)
            assert all(isinstance(r, GenerationError) and "scripted shard crash" in str(r) for r in results), results
            assert engine.health()[1]["status"] == "failed"
            assert engine.queue_size() == 0 and blocks_free(engine) == engine.info()["kv_blocks"]
        finally:
            await engine.stop()

    asyncio.run(run())
    assert_each_given_back_once(allocators[0])
