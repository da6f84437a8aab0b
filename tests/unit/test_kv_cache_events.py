"""KV-cache events without sockets: what --kv-events-config accepts, which events the prefix cache
makes as requests take, fill and give back blocks, and the wire layout of a batch (that vLLM's own
decoder reads it is tests/runtime/test_kv_events.py's job)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gaudi_runtime.config import ConfigError, kv_events_config, resolve
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.kv_events import (
    AllBlocksCleared,
    KVEventBatch,
    KvEvents,
    ZmqPublisher,
    binds,
    removed,
    stored,
)
from gaudi_runtime.router.live_requests import Requests
from gaudi_runtime.router.prefix_cache import chain_hashes
from tests.unit.test_prefix_cache import BS, finish, take_one, tokens, valid


def test_the_flag_takes_vllms_json_and_fills_vllms_defaults():
    cfg = kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                   "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000,
                   "topic": "kv"}
    assert kv_events_config(None) is None and kv_events_config('{"enable_kv_cache_events": false}') is None
    assert kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    env = {"MODEL_ID": "m", "DEVICE": "cpu", "KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true}'}
    assert resolve(None, env).scheduling.kv_events_config["endpoint"] == "tcp://*:5557"


@pytest.mark.parametrize("raw, names", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"enable_kv_cache_events": true, "port": 1}', "port"),
    ('{"enable_kv_cache_events": true, "hwm": "1"}', "hwm"),
    ('{"enable_kv_cache_events": true, "buffer_steps": true}', "buffer_steps"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kafka"),
    ('{"enable_kv_cache_events": true, "max_queue_size": 0}', "max_queue_size"),
])
def test_a_wrong_setting_fails_naming_it(raw, names):
    with pytest.raises(ConfigError, match=names):
        kv_events_config(raw)


def test_the_endpoint_is_bound_or_connected_as_vllm_decides():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://picker.example:5557") and not binds("tcp://127.0.0.1:5557")


class Recorded:
    """A sink that keeps the events (KvEvents' interface)."""

    def __init__(self):
        self.events = []

    def add(self, event):
        self.events.append(event)


def registry_with_events(num_blocks: int = 32) -> tuple[Requests, Recorded]:
    requests = Requests(resolve(None, {"MODEL_ID": "unused", "DEVICE": "cpu"}), EngineMetrics(None))
    sink = requests.prefix.events = Recorded()
    requests.allocator = BlockAllocator(num_blocks, on_removed=requests.prefix.removed)
    return requests, sink


def test_a_prompt_then_its_answer_are_stored_as_one_chain():
    requests, sink = registry_with_events()
    prompt = tokens(2 * BS + 3)
    state = take_one(requests, valid(prompt))
    hashes = chain_hashes(prompt, BS, requests.prefix.root)
    assert sink.events == [stored(hashes, None, prompt[:2 * BS], BS)]
    answer = [7] * (BS + 1)
    finish(requests, state, answer)  # the last token was never fed back: one more full block
    whole = prompt + answer[:-1]
    more = chain_hashes(whole, BS, requests.prefix.root)[2:3]
    assert sink.events[1:] == [stored(more, hashes[-1], whole[2 * BS:3 * BS], BS)]


def test_a_hit_stores_only_what_follows_it_chained_onto_the_blocks_it_read():
    requests, sink = registry_with_events()
    first = tokens(2 * BS + 1)
    finish(requests, take_one(requests, valid(first)), [])
    sink.events.clear()
    longer = first[:2 * BS] + tokens(2 * BS, start=500)
    take_one(requests, valid(longer))
    hashes = chain_hashes(longer, BS, requests.prefix.root)
    assert sink.events == [stored(hashes[2:], hashes[1], longer[2 * BS:4 * BS], BS)]


def test_eviction_and_a_failed_request_remove_what_was_stored():
    requests, sink = registry_with_events(num_blocks=4)
    prompt = tokens(2 * BS + 1)
    finish(requests, take_one(requests, valid(prompt, max_new_tokens=2)), [])  # 2 blocks stay cached
    hashes = chain_hashes(prompt, BS, requests.prefix.root)
    sink.events.clear()
    take_one(requests, valid(tokens(3 * BS, start=900), max_new_tokens=BS))  # needs all 4 blocks
    assert sink.events[0] == removed(hashes[::-1])  # in eviction order (a request's tail first), in one event

    requests, sink = registry_with_events()
    state = take_one(requests, valid(prompt))
    requests.end(state, RuntimeError("the shards failed"))
    assert sink.events[1:] == [removed([hashes[0]]), removed([hashes[1]])]  # its blocks may hold anything


def test_a_batch_is_an_array_and_each_event_a_map_tagged_with_its_class():
    batch = KVEventBatch(ts=1.5, events=[stored([b"h"], None, [1, 2], 2), removed([b"h"])], data_parallel_rank=0)
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert (ts, rank) == (1.5, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None,
                         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "group_idx": 0}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [b"h"], "medium": "GPU", "group_idx": 0}


class Batches:
    """A publisher that keeps what it is given (ZmqPublisher's interface)."""

    def __init__(self):
        self.batches = []

    def publish(self, batch):
        self.batches.append(batch)


async def test_the_events_of_one_loop_turn_go_out_as_one_batch():
    publisher = Batches()
    sink = KvEvents(publisher)
    sink.add(stored([b"a"], None, [1], 1))
    sink.add(removed([b"b"]))
    assert publisher.batches == []  # sent once this turn of the loop is over
    await asyncio.sleep(0)  # one turn: the flush the sink scheduled with call_soon runs
    sink.add(AllBlocksCleared())
    await asyncio.sleep(0)
    assert [b.events for b in publisher.batches] == [[stored([b"a"], None, [1], 1), removed([b"b"])],
                                                     [AllBlocksCleared()]]
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in publisher.batches)


def test_an_endpoint_that_cannot_be_opened_fails_naming_the_flag():
    with pytest.raises(ValueError, match="--kv-events-config: cannot open tcp://\\*:notaport"):
        ZmqPublisher("tcp://*:notaport")


def test_an_adapters_blocks_are_stored_under_its_lora_id_and_name():
    requests = Requests(resolve(None, {"MODEL_ID": "unused", "DEVICE": "cpu", "LORA_ADAPTERS": "sql=/x,chat=/y"}),
                        EngineMetrics(None))
    sink = requests.prefix.events = Recorded()
    requests.allocator = BlockAllocator(32, on_removed=requests.prefix.removed)
    prompt = tokens(BS + 1)
    take_one(requests, valid(prompt, adapter=2))
    take_one(requests, valid(prompt))
    [chat, base] = sink.events
    assert (chat.lora_id, chat.lora_name, base.lora_id, base.lora_name) == (2, "chat", None, None)
    assert chat.block_hashes != base.block_hashes  # the adapter's root: its blocks are its own
