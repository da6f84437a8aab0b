"""More adapters than device slots: which slot an adapter goes into (router/adapter_slots.py), the
write before the prefill (router/adapter_placement.py) and the shard's host copies
(shard/adapter_cache.py), least recently used first."""

from __future__ import annotations

import asyncio

from gaudi_runtime.config import resolve
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.adapter_placement import AdapterPlacement
from gaudi_runtime.router.adapter_slots import DeviceSlots, choose_slots
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.client import ShardError
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests
from gaudi_runtime.router.types import GenerationError
from gaudi_runtime.shard.adapter_cache import HostAdapters
from tests.unit.test_prefix_cache import valid


def test_an_adapter_in_a_slot_stays_there_and_another_takes_an_empty_slot_first():
    # Slot 1 holds load 7 (used at time 5), slot 2 load 8 (time 1), slot 3 nothing.
    held, used = [0, 7, 8, 0], [0, 5, 1, 0]
    assert choose_slots(held, used, [7], set()) == {7: 1}
    assert choose_slots(held, used, [9], set()) == {9: 3}
    assert choose_slots(held, used, [9, 10], set()) == {9: 3, 10: 2}  # then the least recently used


def test_a_slot_a_running_request_uses_is_never_taken():
    held, used = [0, 7, 8], [0, 1, 2]
    assert choose_slots(held, used, [9], {1}) == {9: 2}
    assert choose_slots(held, used, [9], {1, 2}) is None
    assert choose_slots(held, used, [7, 9], {2}) is None  # 7 keeps slot 1, 9 finds none
    assert choose_slots(held, used, [8], {1, 2}) == {8: 2}  # in a slot already: it joins the running ones


def test_device_slots_write_only_what_is_missing_and_evict_the_least_recently_used():
    slots = DeviceSlots(2, start=[1, 2, 3])  # three adapters given, two slots: the first two are written at start
    assert slots.held == [0, 1, 2]
    assert slots.plan([2], set()) == ({2: 2}, [])
    slots.used([2])
    at, writes = slots.plan([3], set())
    assert at == {3: 1} and writes == [(1, 3)]  # slot 1 was used least recently
    slots.written(1, 3)
    slots.used([1])
    assert slots.plan([1], {1}) == ({1: 2}, [(2, 1)])
    slots.written(2, 0)  # a failed write leaves the slot empty: the load is written again next time
    assert slots.plan([1], set()) == ({1: 2}, [(2, 1)])


def test_host_copies_keep_the_most_recently_used_and_count_hits_and_reads():
    cache = HostAdapters(2)
    cache.put(1, "one")
    cache.put(2, "two")
    assert cache.get(1) == "one"  # 2 is now the least recently used
    cache.put(3, "three")
    assert cache.held() == [1, 3] and cache.get(2) is None
    assert (cache.hits, cache.reads) == (1, 1)


class _Refused(Exception):
    """What gRPC raises when a shard answers INVALID_ARGUMENT."""

    def code(self):
        return type("Code", (), {"name": "INVALID_ARGUMENT"})()

    def details(self) -> str:
        return "no adapter_config.json"


class _Shards:
    """Every shard as one: records each slot write, refuses the adapters named in `refuse`."""

    def __init__(self, refuse: tuple[str, ...] = ()):
        self.writes: list[tuple] = []
        self.refuse = refuse

    async def load_adapter(self, slot: int, name: str, path: str, load_id: int):
        self.writes.append((slot, name, path, load_id))
        if name in self.refuse:
            raise ShardError("LoadAdapter failed") from _Refused()
        return pb.LoadAdapterResponse(host_hit=False)


def _placement(shards: _Shards):
    cfg = resolve(None, {"MODEL_ID": "unused", "DEVICE": "cpu", "LORA_ADAPTERS": "a=/x,b=/y,c=/z", "MAX_LORAS": "1"})
    requests = Requests(cfg, EngineMetrics(None))
    requests.allocator = BlockAllocator(32)
    return requests, AdapterPlacement(cfg.adapters.max_loras, shards, requests, EngineMetrics(None))


def _taken(requests, adapter: int):
    requests.add(valid([1, 2, 3], adapter=adapter, adapter_load=adapter), None)
    return requests.take(1)


def test_a_taken_request_gets_its_adapter_written_into_the_slot_first_and_a_refusal_ends_it():
    shards = _Shards(refuse=("c",))
    requests, placement = _placement(shards)
    [b] = asyncio.run(placement.place(_taken(requests, 2)))
    assert shards.writes == [(1, "b", "/y", 2)] and b.device_slot == 1
    assert asyncio.run(placement.place(_taken(requests, 2)))[0].device_slot == 1  # in the slot: no write
    requests.end(b)
    requests.end(requests.get(2))
    taken = _taken(requests, 3)
    assert asyncio.run(placement.place(taken)) == [] and taken[0].ended
    error = taken[0].events.get_nowait()
    assert isinstance(error, GenerationError) and "'c' could not be loaded: no adapter_config.json" in str(error)
    assert placement.slots.held == [0, 0]  # written again next time
    assert len(shards.writes) == 2
