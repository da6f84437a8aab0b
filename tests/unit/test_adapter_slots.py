"""More adapters than device slots: which slot an adapter goes into (router/adapter_slots.py) and the
shard's host copies (shard/adapter_cache.py), least recently used first."""

from __future__ import annotations

from gaudi_runtime.router.adapter_slots import DeviceSlots, choose_slots
from gaudi_runtime.shard.adapter_cache import HostAdapters


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
