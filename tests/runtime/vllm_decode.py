"""Decode KV-event messages with vLLM's own classes: run with hack/vllm-kv-events.sh's directory on
PYTHONPATH, in a process of its own (importing vllm changes torch and logging settings that the
test process must keep).

It serves until stdin closes (importing vllm takes seconds; a test decodes many times). Each
request on stdin: a 4-byte big-endian length, then msgpack of a list of ZMQ messages, each
`[topic, sequence (8 bytes), payload]`. Each answer on stdout: one line of JSON, a list with one
object per message: topic, seq, and what vLLM's decoder made of the payload: the batch's ts and
data_parallel_rank, and each event as its vLLM class name (and module) with its fields (hashes
as hex).
"""

from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch


def plain(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def decode(decoder: msgspec.msgpack.Decoder, messages: list[list[bytes]]) -> list[dict]:
    out = []
    for topic, seq, payload in messages:
        batch = decoder.decode(payload)
        events = [{"class": type(e).__name__, "module": type(e).__module__,
                   **{f: plain(getattr(e, f)) for f in e.__struct_fields__}} for e in batch.events]
        out.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big", signed=True), "ts": batch.ts,
                    "data_parallel_rank": batch.data_parallel_rank, "events": events})
    return out


def main() -> None:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stdin = sys.stdin.buffer
    while len(head := stdin.read(4)) == 4:
        messages = msgspec.msgpack.decode(stdin.read(int.from_bytes(head, "big")))
        sys.stdout.write(json.dumps(decode(decoder, messages)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
