"""The disk tier's files on one shard: one file per KV block of this rank's slice, checked before use.

A file is `<dir>/rank<r>/<hash hex>`: a header (magic, the block's hash, the payload's length and
SHA-256) then the payload, the block's bytes layer by layer. A file that is truncated, names another
hash or fails its checksum is skipped (counted, logged, deleted), never loaded: a block is only ever
reused as the bytes its hash names. `<dir>` is `<disk path>/<layout key>`: the key salts in what
decides the bytes besides the hash chain (whose root already names the model, its revision, dtypes,
quantization, RoPE and block size): the tensor-parallel layout and the per-token KV shapes, so a
server with another layout never reads these files.

Writes are a thread's job (`DiskStore.write` queues a copy of the bytes): a slow, full or read-only
disk delays or fails writes, counted and logged, and never a forward pass.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

# The part of --kv-offloading-size each shard keeps for blocks read from disk (staging), the rest being
# host slots: the flag bounds all the host memory the tiers take, as the pod's memory request counts it.
STAGED_PART = 0.2

log = logging.getLogger(__name__)

MAGIC = b"GSKV\x01\x00"
HASH_BYTES = 32
HEADER_BYTES = len(MAGIC) + HASH_BYTES + 8 + 32


class CorruptBlock(ValueError):
    """A block file that must not be loaded; the message says why."""


def encode(key: bytes, payload: bytes) -> bytes:
    """A block file's bytes: the header naming `key`, then `payload`."""
    return MAGIC + key + len(payload).to_bytes(8, "big") + hashlib.sha256(payload).digest() + payload


def decode(key: bytes, data: bytes, expected_len: int | None = None) -> bytes:
    """The payload of a block file read for `key`, after every check; CorruptBlock when one fails."""
    if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
        raise CorruptBlock("short or no header")
    at = len(MAGIC)
    if data[at:at + HASH_BYTES] != key:
        raise CorruptBlock("names another block")
    at += HASH_BYTES
    length = int.from_bytes(data[at:at + 8], "big")
    digest = data[at + 8:at + 40]
    payload = data[HEADER_BYTES:]
    if len(payload) != length or (expected_len is not None and length != expected_len):
        raise CorruptBlock(f"payload of {len(payload)} bytes, {length} announced, {expected_len} expected")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptBlock("checksum mismatch")
    return payload


def layout_key(root: bytes, world_size: int, num_layers: int, token_shapes, kv_dtype: str) -> str:
    """The directory name shared by every server that would write the same bytes for a hash."""
    salt = f"{root.hex()}|tp{world_size}|layers{num_layers}|{token_shapes}|{kv_dtype}"
    return hashlib.sha256(salt.encode()).hexdigest()[:16]


def rank_dir(disk_dir: str | Path, rank: int) -> Path:
    return Path(disk_dir) / f"rank{rank}"


def list_complete(disk_dir: str | Path, world_size: int) -> list[tuple[float, bytes]]:
    """(mtime, hash) of every block every rank has a file for, oldest first: what a restarted router
    indexes. Files of a hash some rank lacks are left to the LRU (a rank's write failed)."""
    found: dict[bytes, float] = {}
    for rank in range(world_size):
        seen: dict[bytes, float] = {}
        try:
            entries = list(os.scandir(rank_dir(disk_dir, rank)))
        except OSError:
            return []
        for entry in entries:
            if len(entry.name) != 2 * HASH_BYTES:
                continue
            try:
                key, mtime = bytes.fromhex(entry.name), entry.stat().st_mtime
            except (ValueError, OSError):
                continue
            if rank == 0 or key in found:
                seen[key] = max(mtime, found.get(key, 0.0))
        found = seen
    return sorted((mtime, key) for key, mtime in found.items())


class DiskStore:
    """This rank's block files: written by a thread, read and checked on demand."""

    def __init__(self, disk_dir: str | Path, rank: int, block_bytes: int):
        self.dir = rank_dir(disk_dir, rank)
        self.block_bytes = block_bytes
        self.writes = self.write_failures = self.corrupt = 0
        self._queue: queue.Queue[tuple[str, bytes, bytes] | None] = queue.Queue()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("KV disk tier: cannot create %s (%s): blocks will not be written", self.dir, e)
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def write(self, key: bytes, payload: bytes) -> None:
        self._queue.put(("write", key, payload))

    def drop(self, key: bytes) -> None:
        """Delete `key`'s file once the writes queued before are done."""
        self._queue.put(("drop", key, b""))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every queued write and deletion (tests; shutdown); False if `timeout_s` passed first."""
        done = threading.Event()
        self._queue.put(("event", done, b""))  # type: ignore[arg-type]
        return done.wait(timeout_s)

    def read(self, key: bytes) -> bytes | None:
        """The checked payload of `key`'s file; None when it is absent or fails a check (then deleted)."""
        path = self.dir / key.hex()
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            return decode(key, data, self.block_bytes)
        except CorruptBlock as e:
            self.corrupt += 1
            log.warning("KV disk tier: %s skipped: %s", path, e)
            path.unlink(missing_ok=True)
            return None

    def _run(self) -> None:
        while True:
            kind, key, payload = self._queue.get()
            if kind == "event":
                key.set()  # type: ignore[attr-defined]
            elif kind == "write":
                self._write(key, payload)
            elif kind == "drop":
                (self.dir / key.hex()).unlink(missing_ok=True)

    def _write(self, key: bytes, payload: bytes) -> None:
        path = self.dir / key.hex()
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(encode(key, payload))
            os.replace(tmp, path)  # a reader never sees half a file under the block's name
            self.writes += 1
        except OSError as e:
            self.write_failures += 1
            if self.write_failures in (1, 10) or self.write_failures % 1000 == 0:  # a full disk fails every write
                log.warning("KV disk tier: writing %s failed (%s); %d failures so far", path, e, self.write_failures)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
