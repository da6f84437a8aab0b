"""A step that holds the shard's event loop must not fail the calls the router queued behind it.

The shard runs its steps on its event loop, so while one runs no new call reaches the servicer; the
router keeps the next decode queued meanwhile (router/batching.py). gRPC cancels a call not handed to the
servicer within `grpc.server_max_unrequested_time_in_server` (30 s by default), and the router then fails
its engine with `Decode failed: CANCELLED: CANCELLED` (seen at the first decode after a long warmup on a
loaded machine). Here a shard process built by `shard.server.grpc_server` blocks its loop in the first
decode while the real ShardClient queues three more behind it: with a wait shorter than the block (the
mechanism, in seconds rather than gRPC's 30) a queued call is cancelled; with the shard's own setting
every one is answered, in order; and that setting outlasts the router's own call timeout.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
from gaudi_runtime.router.client import DEFAULT_SHARD_TIMEOUT_S, ShardClient
from gaudi_runtime.shard.server import UNHANDLED_CALL_WAIT_S

BLOCK_S = 4.0
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


def serve(path: str, started: str, wait_s: int) -> None:
    from gaudi_runtime.shard.server import grpc_server

    async def run() -> None:
        server = grpc_server(wait_s)
        pb_grpc.add_TextGenerationServiceServicer_to_server(SlowFirstStep(started), server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


async def decode_behind_a_long_step(path: str, started: Path) -> list:
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
        answers = await asyncio.gather(first, *queued, return_exceptions=True)
        return [a if isinstance(a, BaseException) else a.batch.id for a in answers]
    finally:
        await client.close()


def decodes_with_wait(tmp_path: Path, wait_s: int) -> list:
    path, started = str(tmp_path / "shard.sock"), tmp_path / "started"
    shard = multiprocessing.get_context("spawn").Process(target=serve, args=(path, str(started), wait_s), daemon=True)
    shard.start()
    try:
        return asyncio.run(decode_behind_a_long_step(path, started))
    finally:
        shard.terminate()
        shard.join(timeout=30)
        if shard.is_alive():
            os.kill(shard.pid, 9)


def test_a_call_waiting_longer_than_grpcs_unhandled_wait_is_cancelled(tmp_path):
    answers = decodes_with_wait(tmp_path, wait_s=1)
    assert any(isinstance(a, BaseException) and "CANCELLED" in str(a) for a in answers), answers


def test_calls_queued_behind_a_long_step_are_answered_in_order(tmp_path):
    assert decodes_with_wait(tmp_path, wait_s=UNHANDLED_CALL_WAIT_S) == list(range(1, QUEUED + 2))


def test_the_shard_keeps_an_unhandled_call_longer_than_the_router_waits_for_it():
    assert UNHANDLED_CALL_WAIT_S > DEFAULT_SHARD_TIMEOUT_S
