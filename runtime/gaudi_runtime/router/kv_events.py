"""KV-cache events in vLLM's wire format, for a prefix-cache-aware router (--kv-events-config).

What a picker learns: which blocks this server's prefix cache holds (`BlockStored`, when a full
block is registered under its hash and becomes reusable), which it lost (`BlockRemoved`, when a
cached block is evicted for other content or its registration dropped) and that it holds none
(`AllBlocksCleared`, once the engine is ready: a picker that knew an earlier process at the same
address starts afresh). docs/operations.md ("Model-server protocol") has the full contract.

The structs mirror vllm/distributed/kv_events.py (vLLM 0.32) field for field, with the same msgspec
options, so vLLM's own `msgspec.msgpack.Decoder(KVEventBatch)` reads these bytes; the batch is an
array (`array_like`), each event a map tagged with its class name. Events made during one turn of
the event loop (a prefill's reservations, an answer's ends: one step of the engine) go out as one
batch. Sending is a background thread's job, so a slow or absent subscriber never blocks the loop;
like vLLM's publisher, each message is `[topic, sequence (8-byte big-endian), payload]`, and an
optional ROUTER socket replays the last `buffer_steps` batches from a sequence number on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's memory, whatever the device
MEDIUM_CPU = "CPU"  # vLLM's name for host memory (its offloading connector's tier)
MEDIUM_DISK = "DISK"  # the disk tier (--kv-offloading-disk-path)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache; encoded as a map whose `type` is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
           lora_id: int | None = None, lora_name: str | None = None, medium: str = MEDIUM_GPU) -> BlockStored:
    """Consecutive blocks of one sequence registered; `parent` is the hash of the block before the
    first (None: the sequence's first block). One KV-cache group (0); `lora_id` and `lora_name` are
    the LoRA adapter's whose sequence it is (None: the base model), as vLLM reports them."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids,
                       block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name,
                       group_idx=0)


def removed(hashes: list[bytes], medium: str = MEDIUM_GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def frame(topic: bytes, seq: int, batch: KVEventBatch, encoder: msgspec.msgpack.Encoder) -> list[bytes]:
    """One message as vLLM's ZmqEventPublisher sends it."""
    return [topic, seq.to_bytes(8, "big"), encoder.encode(batch)]


class KvEvents:
    """Collects the prefix cache's events and hands each engine step's to the publisher as one batch."""

    def __init__(self, publisher: ZmqPublisher):
        self.publisher = publisher
        self._pending: list[KVCacheEvent] = []

    def add(self, event: KVCacheEvent) -> None:
        if not self._pending:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a direct caller): nothing else joins this batch
                self._pending.append(event)
                self.flush()
                return
        self._pending.append(event)

    def flush(self) -> None:
        if self._pending:
            events, self._pending = self._pending, []
            # Rank 0 always: vLLM's publisher stamps its data-parallel rank on every batch it sends.
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, IPv6 any-address, ipc or inproc endpoint is bound; any other is
    connected to (the subscriber binds it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """A PUB socket (and the optional replay ROUTER socket) owned by one thread."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000):
        import zmq

        self._zmq = zmq
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.dropped = 0  # batches not queued because the thread fell max_queue_size behind
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {endpoint} or {replay_endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events: publishing on %s (topic %r)%s", endpoint, topic,
                 f", replay on {replay_endpoint}" if replay_endpoint else "")

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("KV-cache events: %d batches dropped (the publisher is behind)", self.dropped)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                msg = frame(self._topic, seq, batch, encoder)
                self._pub.send_multipart(msg)
                self._buffer.append((seq, msg[2]))
                seq += 1
        except Exception:  # noqa: BLE001 - events are advisory: losing them must not stop serving
            log.exception("KV-cache events: the publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        """A request `[identity, b"", start sequence]`: every buffered batch from it on, then END_SEQ."""
        parts = self._replay.recv_multipart()
        if len(parts) != 3:
            log.warning("KV-cache events: a replay request of %d frames ignored", len(parts))
            return
        client, _, start = parts
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])


def make_kv_events(cfg: dict | None) -> KvEvents | None:
    """The events' sink for --kv-events-config as resolved (config.scheduling.kv_events_config); None: off."""
    if cfg is None:
        return None
    return KvEvents(ZmqPublisher(cfg["endpoint"], cfg["topic"], cfg["replay_endpoint"], cfg["buffer_steps"],
                                 cfg["hwm"], cfg["max_queue_size"]))
