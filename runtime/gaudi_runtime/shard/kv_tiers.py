"""The KV cache's tiers below the device on one shard: host-memory slots, staged disk blocks, the disk.

The router decides every move (router/kv_tiers.py); a shard carries them out. Copies ride on a
Prefill (`KvCopies`, run before its forward pass, in call order); disk reads run beside the numbered
calls (`fetch`, into staging memory that a later Prefill copies onto the device). Each tensor of the
cache (`layers/kv_cache.py`: keys and values, or MLA's latent and rope key, in the KV dtype) has a
host twin of `host_slots + 1` blocks; slot 0 is padding, as device block 0 is. Each shard keeps its
own slice under tensor parallelism.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.kv_files import STAGED_PART, DiskStore, layout_key
from gaudi_runtime.kv_root import root_hash
from gaudi_runtime.layers.kv_cache import cache_bytes_per_block, model_token_shapes

log = logging.getLogger(__name__)

GIB = 1 << 30


class KvTiers:
    """The host tier (and the disk tier under it) of one shard's KV cache."""

    def __init__(self, kv_cache: list[tuple[torch.Tensor, ...]], backend: Backend, size_gib: float,
                 block_bytes: int, disk_dir: str | None = None, rank: int = 0):
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_bytes = block_bytes
        # A fifth of the shard's share stages blocks read from disk (kv_files.STAGED_PART).
        self.host_slots = max(1, int(size_gib * GIB * (1 - STAGED_PART)) // block_bytes)
        self.host = [tuple(backend.host_buffer((self.host_slots + 1, *t.shape[1:]), t.dtype) for t in pair)
                     for pair in kv_cache]
        self.disk_dir = disk_dir
        self.disk = None if disk_dir is None else DiskStore(disk_dir, rank, block_bytes)
        self.staged: dict[bytes, torch.Tensor] = {}  # hash -> one block's bytes read from disk
        log.info("KV host tier: %d blocks (%.2f GiB)%s", self.host_slots, self.host_slots * block_bytes / GIB,
                 f", disk tier under {disk_dir}" if disk_dir else "")

    def tensors(self):
        """(device, host) of each cache tensor; a float8 cache as its bytes (torch copies those by index)."""
        return [(_bytes(dev), _bytes(host)) for dpair, hpair in zip(self.kv_cache, self.host)
                for dev, host in zip(dpair, hpair)]

    # ---- one block as bytes (disk files, staging) ----------------------

    def slot_bytes(self, slot: int) -> bytes:
        return b"".join(host[slot].contiguous().view(torch.uint8).numpy().tobytes() for _, host in self.tensors())

    def _unpack(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """One block's bytes as a tensor per cache tensor (views into `payload`)."""
        out, at = [], 0
        for _, host in self.tensors():
            n = host[0].numel() * host.element_size()
            out.append(payload[at:at + n].view(host.dtype).view(host.shape[1:]))
            at += n
        return out

    # ---- the copies a Prefill carries ----------------------------------

    def apply(self, copies) -> int:
        """Run each `KvCopies` in order (see the protocol for the order inside one); returns the ns taken."""
        t0 = time.perf_counter_ns()
        for c in copies:
            self._apply_one(c)
        return time.perf_counter_ns() - t0

    def _apply_one(self, c) -> None:
        pairs = self.tensors()
        saved = [self.backend.gather_blocks(dev, list(c.save_blocks)) for dev, _ in pairs] if c.save_blocks else None
        if c.load_slots:
            for dev, host in pairs:
                self.backend.copy_blocks(host, list(c.load_slots), dev, list(c.load_blocks))
        if c.staged_hashes:  # the staged blocks, stacked per cache tensor, go the way host slots do
            parts = [self._unpack(self.staged.pop(bytes(key))) for key in c.staged_hashes]
            rows = list(range(len(parts)))
            for i, (dev, _) in enumerate(pairs):
                self.backend.copy_blocks(torch.stack([p[i] for p in parts]), rows, dev, list(c.staged_blocks))
        if saved is not None:
            slots = torch.tensor(list(c.save_slots), dtype=torch.long)
            for (_, host), blocks in zip(pairs, saved):
                host.index_copy_(0, slots, blocks)
        self.backend.mark_step()
        if self.disk is not None:
            for key in c.drop_hashes:
                self.disk.drop(bytes(key))
            for slot, key in zip(c.spill_slots, c.spill_hashes):
                self.disk.write(bytes(key), self.slot_bytes(slot))

    # ---- disk reads (beside the numbered calls) ------------------------

    def fetch(self, hashes: list[bytes], discard: list[bytes]) -> tuple[list[bytes], int, int]:
        """Read and check each hash's file into staging memory -> (loaded hashes, corrupt files, bytes)."""
        for key in discard:
            self.staged.pop(key, None)
        if self.disk is None:
            return [], 0, 0
        loaded, before = [], self.disk.corrupt
        for key in hashes:
            payload = self.disk.read(key)
            if payload is not None:
                self.staged[key] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                loaded.append(key)
        return loaded, self.disk.corrupt - before, len(loaded) * self.block_bytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def make_tiers(runner, rank: int, world_size: int) -> KvTiers | None:
    """The tiers --kv-offloading-size and --kv-offloading-disk-path ask for on `runner`'s cache; None: none."""
    cfg = runner.cfg
    sched = cfg.scheduling
    if not sched.kv_offloading_size:
        return None
    m = runner.model
    shapes = model_token_shapes(m)
    block_bytes = cache_bytes_per_block(m.num_layers, cfg.device.block_size, shapes, runner.kv_dtype)
    disk_dir = None
    if sched.kv_offloading_disk_path:
        key = layout_key(root_hash(cfg), world_size, m.num_layers, shapes, str(runner.kv_dtype))
        disk_dir = str(Path(sched.kv_offloading_disk_path) / key)
    share = sched.kv_offloading_size / world_size  # vLLM's size is summed over tensor-parallel ranks
    tiers = KvTiers(runner.kv_cache, runner.backend, share, block_bytes, disk_dir, rank)
    runner.backend.warm_copies(tiers.tensors())
    return tiers
