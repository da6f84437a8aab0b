"""A step that holds the shard's event loop longer than gRPC's default wait for an unhandled call (30 s)
must not fail the calls the router queued behind it.

The shard runs its steps on its event loop, so while one runs no new call reaches the servicer; the
router keeps the next decode queued meanwhile (router/batching.py). With gRPC's defaults, a call not
handed to the servicer within 30 s is cancelled, and the router fails its engine with
`Decode failed: CANCELLED: CANCELLED` (seen at the first decode after a long warmup on a loaded machine).
Here a shard process built by `shard.server.grpc_server` blocks its loop for BLOCK_S in the first decode,
the real ShardClient queues three more behind it, and every one must be answered, in order.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
from gaudi_runtime.router.client import ShardClient

BLOCK_S = 40.0  # past gRPC's default 30 s, with room for the queued calls to arrive
QUEUED = 3


class SlowFirstStep(pb_grpc.TextGenerationServiceServicer):
    """Decode answers the batch id it was numbered with; the first one blocks the loop as a long
    forward pass does, after saying so in `started`."""

    def __init__(self, started: str):
        from gaudi_runtime.shard.call_order import CallOrder

        self.order, self.started = CallOrder(), started

    async def Health(self, request, context):
        return pb.HealthResponse()

    async def Decode(self, request, context):
        async with self.order.turn(request.sequence):
            if request.sequence == 1:
                Path(self.started).touch()
                time.sleep(BLOCK_S)  # the forward pass: blocks the event loop, as the real runner's does
        return pb.DecodeResponse(batch=pb.CachedBatch(id=request.sequence))


def serve(path: str, started: str) -> None:
    from gaudi_runtime.shard.server import grpc_server

    async def run() -> None:
        server = grpc_server()
        pb_grpc.add_TextGenerationServiceServicer_to_server(SlowFirstStep(started), server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


async def decode_behind_a_long_step(path: str, started: Path) -> list[int]:
    client = ShardClient([path])
    await client.connect(timeout_s=120)
    try:
        first = asyncio.ensure_future(client.decode([pb.CachedBatch(id=0)]))
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline, "the first step never started"
            assert not first.done(), first.result()
            await asyncio.sleep(0.05)  # poll interval of a deadline-bounded wait
        queued = [client.decode([pb.CachedBatch(id=i)]) for i in range(QUEUED)]
        answers = await asyncio.gather(first, *queued)
        return [a.batch.id for a in answers]
    finally:
        await client.close()


def test_calls_queued_behind_a_step_longer_than_grpcs_default_wait_are_answered(tmp_path):
    path, started = str(tmp_path / "shard.sock"), tmp_path / "started"
    shard = multiprocessing.get_context("spawn").Process(target=serve, args=(path, str(started)), daemon=True)
    shard.start()
    try:
        assert asyncio.run(decode_behind_a_long_step(path, started)) == list(range(1, QUEUED + 2))
    finally:
        shard.terminate()
        shard.join(timeout=30)
        if shard.is_alive():
            os.kill(shard.pid, 9)
