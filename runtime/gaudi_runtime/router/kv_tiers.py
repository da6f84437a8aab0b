"""The prefix cache's tiers below the device: which block hashes host memory and the disk hold, and the
copies that move blocks between them (--kv-offloading-size, --kv-offloading-disk-path).

The router owns every map, as it owns the device's (router/blocks.py); the shards only copy
(shard/kv_tiers.py). A registered block the device evicts is copied to a host slot instead of
dropped (taking the least recently used one's), and written through to disk when there is a disk
tier, so that the disk holds all that host memory held: what a restarted server finds. A prompt whose chain goes on past the device's blocks into host memory gets fresh device
blocks with the host slots copied onto them, and counts them as cached: only the rest is computed.

Copies ride on the next Prefill (`drain`), one `Copies` per admission, which the shards run before
its forward pass in call order: a block only ever enters a tier once it is registered (full and
final), and every copy reads what the calls before it wrote. Disk blocks never go on that path: a
waiting request whose chain goes on on disk waits while every shard reads them into staging memory
(`FetchBlocks`, beside the forward passes); the hashes every shard loaded and checked are staged,
and a later admission copies them onto device blocks as it does host slots.

Tiers are inclusive: a block copied back keeps its host slot and its file, so a second eviction
copies nothing. KV events announce each tier's changes with vLLM's `medium` (CPU, DISK); their
`token_ids` are empty, as only the hashes are kept below the device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, fields

from gaudi_runtime.kv_files import STAGED_PART
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.kv_events import MEDIUM_CPU, MEDIUM_DISK, KvEvents, removed, stored

GIB = 1 << 30
# The counts /info's `kv_offloading` always shows (EngineMetrics.kv_offload keys: metric_label).
INFO_COUNTS = ("hits_host", "hits_disk", "bytes_device_to_host", "bytes_host_to_device", "bytes_host_to_disk",
               "bytes_disk_to_device", "copy_seconds_copy", "copy_seconds_disk_read", "faults_corrupt",
               "faults_write_failed", "faults_fetch_failed", "blocks_host", "blocks_disk", "blocks_staged")


class LruSlots:
    """hash -> slot among `capacity` slots (1..capacity), least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))
        self._slot: OrderedDict[bytes, int] = OrderedDict()
        self.pinned: set[bytes] = set()  # may not be evicted now (an admission is reading them)

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def get(self, h: bytes) -> int:
        self._slot.move_to_end(h)
        return self._slot[h]

    def put(self, h: bytes) -> tuple[int, bytes | None] | None:
        """A slot for `h` -> (slot, the hash evicted from it or None); None when every slot is pinned."""
        if self._free:
            slot, victim = self._free.pop(), None
        else:
            victim = next((v for v in self._slot if v not in self.pinned), None)
            if victim is None:
                return None
            slot = self._slot.pop(victim)
        self._slot[h] = slot
        return slot, victim


class LruSet:
    """Hashes, least recently used first, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, h: bytes) -> list[bytes]:
        """Add (or touch) `h`; returns the hashes dropped to stay within capacity."""
        self._keys[h] = None
        self._keys.move_to_end(h)
        out = []
        while len(self._keys) > self.capacity:
            out.append(self._keys.popitem(last=False)[0])
        return out

    def discard(self, h: bytes) -> bool:
        return self._keys.pop(h, False) is None


@dataclass
class Copies:
    """One admission's copies, as the shards' `KvCopies` names them."""

    save_blocks: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    staged_hashes: list[bytes] = field(default_factory=list)
    staged_blocks: list[int] = field(default_factory=list)
    spill_slots: list[int] = field(default_factory=list)
    spill_hashes: list[bytes] = field(default_factory=list)
    drop_hashes: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KvTiers:
    """The host index, the disk index and the staged disk blocks, and the copies they need."""

    def __init__(self, host_slots: int, block_bytes: int, world_size: int, metrics: EngineMetrics,
                 disk_blocks: int | None = None, block_size: int = 16):
        self.host = LruSlots(host_slots)
        self.disk = None if disk_blocks is None else LruSet(disk_blocks)
        # The shards' staging memory: the rest of each one's share (STAGED_PART of it).
        self.staged = LruSet(max(1, int(host_slots * STAGED_PART / (1 - STAGED_PART))))
        self.block_bytes = block_bytes * world_size  # one block on every shard
        self.block_size = block_size
        self.metrics = metrics
        self.events: KvEvents | None = None
        self.discards: list[bytes] = []  # staged blocks dropped: the next fetch tells the shards
        self._copies = Copies()
        self._pending: list[Copies] = []

    # ---- the device evicts --------------------------------------------

    def evicted(self, block: int, h: bytes) -> None:
        """Device block `block`, registered under `h`, is being given other content: keep a copy (written
        through to disk, so that the disk holds whatever host memory held: what a restart finds)."""
        if h in self.host:
            self.host.get(h)
            return
        got = self.host.put(h)
        if got is None:
            return
        slot, victim = got
        if victim is not None:
            self._announce_removed([victim], MEDIUM_CPU)
        self._copies.save_blocks.append(block)
        self._copies.save_slots.append(slot)
        self.metrics.kv_offload_count("bytes", "device_to_host", self.block_bytes)
        self._announce_stored([h], MEDIUM_CPU)
        if self.disk is None:
            return
        if h in self.disk:
            self.disk.add(h)
            return
        self._copies.spill_slots.append(slot)
        self._copies.spill_hashes.append(h)
        self.metrics.kv_offload_count("bytes", "host_to_disk", self.block_bytes)
        self._announce_stored([h], MEDIUM_DISK)
        self._drop_files(self.disk.add(h))

    def _drop_files(self, hashes: list[bytes]) -> None:
        if hashes:
            self._copies.drop_hashes.extend(hashes)
            self._announce_removed(hashes, MEDIUM_DISK)

    # ---- a prompt's lookup continues below the device ------------------

    def run(self, hashes: list[bytes]) -> list[bytes]:
        """The longest run of `hashes` from the first that host memory or the staged blocks hold."""
        out = []
        for h in hashes:
            if h not in self.host and h not in self.staged:
                break
            out.append(h)
        return out

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these host blocks through an admission's evictions (see `admitted`)."""
        self.host.pinned.update(hashes)

    def take(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Copy the blocks `run` found onto the fresh device blocks `blocks`."""
        from_host = from_disk = 0
        for h, block in zip(hashes, blocks):
            if h in self.host:
                self._copies.load_slots.append(self.host.get(h))
                self._copies.load_blocks.append(block)
                from_host += 1
            else:
                self.staged.discard(h)
                self._copies.staged_hashes.append(h)
                self._copies.staged_blocks.append(block)
                if self.disk is not None and h in self.disk:
                    self.disk.add(h)
                from_disk += 1
        self.metrics.kv_offload_count("hits", "host", from_host * self.block_size)
        self.metrics.kv_offload_count("hits", "disk", from_disk * self.block_size)
        self.metrics.kv_offload_count("bytes", "host_to_device", from_host * self.block_bytes)
        self.metrics.kv_offload_count("bytes", "disk_to_device", from_disk * self.block_bytes)

    def admitted(self) -> None:
        """An admission's allocations are done: its copies form one step of the next Prefill's."""
        self.host.pinned.clear()
        if self._copies:
            self._pending.append(self._copies)
            self._copies = Copies()
        self.report()

    def drain(self) -> list[Copies]:
        """The copies the Prefill being made carries, in order."""
        self.admitted()
        out, self._pending = self._pending, []
        return out

    # ---- the disk tier -------------------------------------------------

    def on_disk(self, hashes: list[bytes]) -> list[bytes]:
        """The run of `hashes` from the first that only the disk holds, at most what staging may take."""
        if self.disk is None:
            return []
        out = []
        for h in hashes[:self.staged.capacity]:
            if h not in self.disk or h in self.host or h in self.staged:
                break
            out.append(h)
        return out

    def fetched(self, asked: list[bytes], loaded: list[set[bytes]], corrupt: int) -> int:
        """Every shard answered a fetch of `asked` with what it loaded: the blocks all of them hold are
        staged, the others leave the disk index (and their files go). Returns the blocks staged."""
        common = set.intersection(*loaded) if loaded else set()
        staged = 0
        for h in asked:
            if h in common:
                self.discards.extend(self.staged.add(h))
                staged += 1
            elif self.disk is not None and self.disk.discard(h):
                self._drop_files([h])
        self.metrics.kv_offload_count("faults", "corrupt", corrupt)
        self.report()
        return staged

    def take_discards(self) -> list[bytes]:
        out, self.discards = self.discards, []
        return out

    def found_on_disk(self, hashes: list[bytes]) -> None:
        """Blocks a restarted server finds on its disk tier, oldest first."""
        if self.disk is None:
            return
        for h in hashes:
            self._drop_files(self.disk.add(h))
        self._announce_stored(hashes, MEDIUM_DISK)
        self.report()

    # ---- reporting -----------------------------------------------------

    def report(self) -> None:
        self.metrics.kv_offload_blocks(len(self.host), len(self.disk) if self.disk is not None else 0,
                                       len(self.staged))

    def _announce_stored(self, hashes: list[bytes], medium: str) -> None:
        if self.events is not None and hashes:
            self.events.add(stored(hashes, None, [], self.block_size, medium=medium))

    def _announce_removed(self, hashes: list[bytes], medium: str) -> None:
        if self.events is not None and hashes:
            self.events.add(removed(hashes, medium))


def tier_sizes(size_gib: float, disk_gib: float | None, block_bytes: int, world_size: int) -> tuple[int, int | None]:
    """(host slots, disk blocks) for the GiB given, both for every shard together (`block_bytes`: one
    shard's slice of a block)."""
    host = max(1, int(size_gib / world_size * GIB * (1 - STAGED_PART)) // block_bytes)
    disk = None if disk_gib is None else max(1, int(disk_gib * GIB) // (block_bytes * world_size))
    return host, disk
