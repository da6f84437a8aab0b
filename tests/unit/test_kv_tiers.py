"""The KV cache's host and disk tiers (issue 47): the router's indexes and the copies they plan, the
engine over scripted shards that simulate every block's tokens through the tiers (a block read back
holds exactly its own tokens), a restart that finds the disk tier, the block file format, the
shard's copies on CPU and through the recording HPU fake, and the flags' checks."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest
import torch

from gaudi_runtime import kv_files
from gaudi_runtime.config import ConfigError, resolve
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.kv_tiers import KvTiers, LruSet, LruSlots, tier_sizes
from gaudi_runtime.router.prefix_cache import chain_hashes, root_hash
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.tools.tiny_model import train_tokenizer
from tests.fake_modules import load_fake
from tests.unit.scripted_shards import BLOCK_SIZE, ScriptedShards, make_engine
from tests.unit.test_prefix_cache import converse

BS = BLOCK_SIZE


@pytest.fixture(scope="module")
def tokenizer():
    return RouterTokenizer(train_tokenizer(256))


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# ---- the router's indexes --------------------------------------------------------------------

def test_host_slots_are_reused_least_recently_used_first_and_pinned_ones_are_kept():
    slots = LruSlots(2)
    assert slots.put(h(1)) == (1, None) and slots.put(h(2)) == (2, None)
    slots.get(h(1))  # touched: h(2) is now the oldest
    assert slots.put(h(3)) == (2, h(2))
    slots.pinned = {h(1), h(3)}
    assert slots.put(h(4)) is None  # every slot is being read by an admission
    lru = LruSet(2)
    assert lru.add(h(1)) == [] and lru.add(h(2)) == [] and lru.add(h(1)) == [] and lru.add(h(3)) == [h(2)]


def test_a_device_eviction_becomes_a_save_written_through_to_disk_with_old_files_dropped():
    tiers = KvTiers(host_slots=2, block_bytes=100, world_size=2, metrics=EngineMetrics(None), disk_blocks=2)
    for i in range(1, 6):
        tiers.evicted(block=10 + i, h=h(i))
    tiers.evicted(block=99, h=h(5))  # already in host memory: nothing to copy
    [c] = tiers.drain()
    assert c.save_blocks == [11, 12, 13, 14, 15] and c.save_slots == [1, 2, 1, 2, 1]
    assert c.spill_hashes == [h(1), h(2), h(3), h(4), h(5)] and c.spill_slots == c.save_slots
    assert c.drop_hashes == [h(1), h(2), h(3)]  # the disk holds two blocks: the oldest files go
    assert tiers.metrics.kv_offload["bytes_device_to_host"] == 5 * 200  # both shards' slices
    assert tiers.drain() == []


def test_a_lookup_continues_into_host_memory_and_staged_blocks_and_a_fetch_keeps_what_all_shards_loaded():
    tiers = KvTiers(host_slots=16, block_bytes=100, world_size=2, metrics=EngineMetrics(None), disk_blocks=8)
    tiers.evicted(1, h(1))
    tiers.found_on_disk([h(2), h(3), h(4)])
    assert tiers.run([h(1), h(2)]) == [h(1)] and tiers.on_disk([h(2), h(3), h(4), h(9)]) == [h(2), h(3), h(4)]
    # Shard 0 loaded all three, shard 1 found h(4) corrupt: only the blocks every shard holds are usable.
    assert tiers.fetched([h(2), h(3), h(4)], [{h(2), h(3), h(4)}, {h(2), h(3)}], corrupt=1) == 2
    assert tiers.run([h(1), h(2), h(3), h(4)]) == [h(1), h(2), h(3)] and h(4) not in tiers.disk
    tiers.take([h(1), h(2), h(3)], [7, 8, 9])
    [c] = tiers.drain()
    assert (c.load_slots, c.load_blocks) == ([1], [7])
    assert (c.staged_hashes, c.staged_blocks) == ([h(2), h(3)], [8, 9]) and c.drop_hashes == [h(4)]
    m = tiers.metrics.kv_offload
    assert m["hits_host"] == 16 and m["hits_disk"] == 32 and m["faults_corrupt"] == 1


def test_each_tier_announces_its_blocks_with_vllms_medium():
    from gaudi_runtime.router.kv_events import KvEvents

    class Batches:
        def __init__(self):
            self.batches = []

        def publish(self, batch):
            self.batches.append(batch)

    publisher = Batches()
    tiers = KvTiers(host_slots=1, block_bytes=100, world_size=1, metrics=EngineMetrics(None), disk_blocks=1)
    tiers.events = KvEvents(publisher)  # no running loop: each event goes out at once
    tiers.evicted(1, h(1))
    tiers.evicted(2, h(2))  # takes h(1)'s slot; the disk holds one block: h(1)'s file goes
    seen = [(type(e).__name__, e.medium, e.block_hashes) for b in publisher.batches for e in b.events]
    assert seen == [("BlockStored", "CPU", [h(1)]), ("BlockStored", "DISK", [h(1)]),
                    ("BlockRemoved", "CPU", [h(1)]), ("BlockStored", "CPU", [h(2)]),
                    ("BlockStored", "DISK", [h(2)]), ("BlockRemoved", "DISK", [h(1)])]


def test_tier_sizes_share_host_memory_and_the_disk_among_the_shards():
    """vLLM's --kv-offloading-size is summed over tensor-parallel ranks; a fifth of each share stages disk reads."""
    assert tier_sizes(1.0, 2.0, 1 << 20, 2) == (409, 1024)
    assert tier_sizes(0.5, None, 1 << 20, 1) == (409, None)


# ---- the engine over scripted shards ----------------------------------------------------------

def run_tiers(tokenizer, shards: ScriptedShards, histories: dict[int, list[int]], order: list[int], turns: int,
              seed: int, **env: str):
    """Conversations `order` (each one turn at a time, all at once) over `shards`; returns the engine's
    /info after. `histories` keeps each conversation's tokens across calls (a restart)."""
    engine = make_engine(shards, tokenizer, KV_OFFLOADING_SIZE="0.001", **env)

    async def one(c: int):
        rng = random.Random(seed * 100 + c)
        await converse(engine, histories.setdefault(c, []), rng, turns)

    async def run():
        await engine.start()
        try:
            for c in order:  # one after another: the device holds about one conversation
                await asyncio.wait_for(one(c), 30)
            return engine.info()
        finally:
            await engine.stop()

    return asyncio.run(run())


def scripted(tokenizer, num_blocks: int, **kw) -> ScriptedShards:
    eos = tokenizer.eos_token_ids[0]
    return ScriptedShards(eos, eos_at={rid: 12 for rid in range(1, 400)}, num_blocks=num_blocks, varied=True, **kw)


class History(dict):
    """Each conversation's tokens so far; `converse` extends the list it is given."""

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = [random.Random(key).randrange(50, 250) for _ in range(3 * BS)]
        return self[key]


@pytest.mark.parametrize("env", [{}, {"MAX_BATCH_PREFILL_TOKENS": "32"}], ids=["whole", "chunked"])
def test_conversations_evicted_from_the_device_come_back_from_host_memory_with_their_own_tokens(tokenizer, env):
    shards = scripted(tokenizer, num_blocks=14, host_slots=64)
    info = run_tiers(tokenizer, shards, History(), order=[0, 1, 2, 3, 0, 2, 1, 3], turns=2, seed=1, **env)
    assert shards.bad_reads == [] and shards.stale_writes == []
    tiers = info["kv_offloading"]
    assert tiers["hits_host"] >= 4 * BS and tiers["host_blocks"] == 64 and tiers["blocks_host"] > 0
    assert any(c.save_blocks for c in shards.copy_log) and any(c.load_slots for c in shards.copy_log)
    assert max(shards.cached_tokens.values()) > 4 * BS  # a returning conversation's history was not computed
    assert (info["prefill_chunks"] > 0) == bool(env)


def test_a_restarted_server_reads_its_disk_tier_and_skips_a_corrupt_block(tokenizer, tmp_path):
    """A tiny host tier spills to disk; a new engine over new shards (empty device and host memory)
    lists the same directory, and a returning conversation reads its prefix from disk; one block whose
    file fails its checks is computed instead."""
    disk, histories, env = {}, History(), {"KV_OFFLOADING_DISK_PATH": str(tmp_path), "KV_OFFLOADING_DISK_SIZE": "1"}
    first = scripted(tokenizer, num_blocks=14, host_slots=16, disk_dir=tmp_path, disk=disk)
    run_tiers(tokenizer, first, histories, order=[0, 1, 2, 3], turns=2, seed=2, **env)
    assert first.bad_reads == [] and len(disk) > 4
    again = scripted(tokenizer, num_blocks=14, host_slots=16, disk_dir=tmp_path, disk=disk)
    # The third block of conversation 0's history fails its checks: it and the rest are computed.
    cfg = resolve(None, {"MODEL_ID": "unused"})
    again.corrupt = {chain_hashes(histories[0], BS, root_hash(cfg))[2]}
    assert again.corrupt <= set(disk)
    info = run_tiers(tokenizer, again, histories, order=[0, 1], turns=1, seed=3, **env)
    assert again.bad_reads == [] and again.stale_writes == []
    tiers = info["kv_offloading"]
    assert tiers["hits_disk"] >= 2 * BS and tiers["blocks_disk"] > 0 and tiers["faults_corrupt"] == 1
    assert any(c.staged_blocks for c in again.copy_log)


# ---- the disk files --------------------------------------------------------------------------

def test_a_block_file_is_only_read_back_whole_for_its_own_key():
    data = kv_files.encode(h(1), b"x" * 100)
    assert kv_files.decode(h(1), data, 100) == b"x" * 100
    for bad, key in ((data[:-1], h(1)), (data[:10], h(1)), (data, h(2)),
                     (data[:-1] + b"y", h(1)), (b"junk" + data[4:], h(1))):
        with pytest.raises(kv_files.CorruptBlock):
            kv_files.decode(key, bad, 100)


def test_the_disk_store_writes_in_the_background_skips_corrupt_files_and_survives_a_read_only_directory(tmp_path):
    store = kv_files.DiskStore(tmp_path, 0, 8)
    store.write(h(1), b"12345678")
    store.write(h(2), b"abcdefgh")
    store.flush()
    assert store.read(h(1)) == b"12345678" and store.writes == 2
    path = tmp_path / "rank0" / h(2).hex()
    path.write_bytes(path.read_bytes()[:-3])  # truncated under the server
    assert store.read(h(2)) is None and store.corrupt == 1 and not path.exists()
    assert kv_files.list_complete(tmp_path, 1) == [(os.stat(tmp_path / "rank0" / h(1).hex()).st_mtime, h(1))]
    assert kv_files.list_complete(tmp_path, 2) == []  # rank 1 has nothing: no block is complete
    # A write that fails (here its temporary name is taken by a directory: as a full or read-only disk
    # would fail it, even for root) is counted, and the store goes on.
    (tmp_path / "rank0" / (h(3).hex() + ".tmp")).mkdir()
    store.write(h(3), b"zzzzzzzz")
    store.write(h(4), b"wwwwwwww")
    store.flush()
    assert store.write_failures == 1 and store.read(h(3)) is None and store.read(h(4)) == b"wwwwwwww"


def test_a_flush_waits_for_the_queued_writes_up_to_its_limit(tmp_path, monkeypatch):
    """What a stopping shard does (ShardServicer.close): every queued block reaches the disk, and a stuck
    disk does not hold the shutdown past the limit."""
    store = kv_files.DiskStore(tmp_path, 0, 8)
    for i in range(50):
        store.write(h(i), bytes([i]) * 8)
    assert store.flush(timeout_s=60) and store.writes == 50
    release = threading.Event()
    monkeypatch.setattr(store, "_write", lambda key, payload: release.wait())
    store.write(h(99), b"stuck...")
    assert store.flush(timeout_s=0.2) is False  # the limit, not the stuck write, ends the wait
    release.set()
    assert store.flush(timeout_s=60)


# ---- the shard's copies ----------------------------------------------------------------------

def shard_tiers(backend, tmp_path=None, dtype=torch.float32):
    from gaudi_runtime.shard.kv_tiers import KvTiers as ShardTiers

    kv = [((torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 1, 3) + 10 * layer).to(dtype),
           torch.zeros(5, 2, 1, 3, dtype=dtype)) for layer in range(2)]
    block_bytes = 2 * 2 * 2 * 3 * kv[0][0].element_size()
    return kv, ShardTiers(kv, backend, 4 * block_bytes / (1 << 30), block_bytes,
                          None if tmp_path is None else str(tmp_path), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_shard_saves_before_it_loads_so_a_reused_block_keeps_its_old_bytes_in_host_memory(tmp_path, dtype):
    from gaudi_runtime.device.base import Backend

    kv, tiers = shard_tiers(Backend(torch.device("cpu")), tmp_path, dtype)
    before = [t[2].clone() for pair in kv for t in pair]
    tiers.apply([pb.KvCopies(save_blocks=[2], save_slots=[1])])
    # Block 2 is given other content and gets slot 1's bytes back in the same admission: both orders hold.
    tiers.apply([pb.KvCopies(save_blocks=[3], save_slots=[2], load_slots=[1], load_blocks=[3])])
    assert all(torch.equal(t[3].view(torch.uint8), b.view(torch.uint8))
               for t, b in zip([t for pair in kv for t in pair], before))
    tiers.apply([pb.KvCopies(spill_slots=[1], spill_hashes=[h(7)])])
    tiers.disk.flush()
    assert tiers.fetch([h(7), h(8)], []) == ([h(7)], 0, tiers.block_bytes)
    tiers.apply([pb.KvCopies(staged_hashes=[h(7)], staged_blocks=[4])])
    assert all(torch.equal(t[4].view(torch.uint8), b.view(torch.uint8))
               for t, b in zip([t for pair in kv for t in pair], before))


def test_hpu_copies_run_on_padded_static_shapes_through_the_recording_fake(monkeypatch):
    for record in load_fake(monkeypatch, "habana_frameworks", "habana_frameworks.torch"):
        hpu_copies(record)


def hpu_copies(record) -> None:
    from gaudi_runtime.device import hpu

    backend = hpu.HpuBackend(torch_device=torch.device("cpu"))
    kv, tiers = shard_tiers(backend)
    steps = record["mark_step"]
    blocks = [1, 2, 3, 4] * 5  # 20 blocks: two copies of KV_COPY_BLOCKS each way
    host = tiers.host[0][0]
    backend.copy_blocks(host, [1] * 20, kv[0][0], blocks)
    saved = backend.gather_blocks(kv[0][0], blocks)
    assert saved.shape[0] == 20 and record["mark_step"] - steps == 4
    assert hpu.padded_chunks([5, 6], 4) == [[5, 6, 0, 0]]


# ---- the flags -------------------------------------------------------------------------------

@pytest.mark.parametrize("env, message", [
    ({"KV_OFFLOADING_DISK_PATH": "/tmp/x"}, "--kv-offloading-disk-size"),
    ({"KV_OFFLOADING_SIZE": "1", "KV_OFFLOADING_DISK_SIZE": "1"}, "--kv-offloading-disk-path"),
    ({"KV_OFFLOADING_DISK_PATH": "/tmp/x", "KV_OFFLOADING_DISK_SIZE": "1"}, "needs --kv-offloading-size"),
    ({"KV_OFFLOADING_SIZE": "1", "PREFIX_CACHING": "false"}, "needs --prefix-caching"),
    ({"KV_OFFLOADING_SIZE": "0"}, "positive"),
])
def test_offloading_settings_that_do_not_fit_together_are_refused_in_one_line(env, message):
    with pytest.raises(ConfigError, match=message):
        resolve(None, {"MODEL_ID": "m", "DEVICE": "cpu", **env})
    cfg = resolve(None, {"MODEL_ID": "m", "DEVICE": "cpu", "KV_OFFLOADING_SIZE": "2",
                         "KV_OFFLOADING_DISK_PATH": "/d", "KV_OFFLOADING_DISK_SIZE": "10"})
    assert (cfg.scheduling.kv_offloading_size, cfg.scheduling.kv_offloading_disk_path) == (2.0, "/d")
