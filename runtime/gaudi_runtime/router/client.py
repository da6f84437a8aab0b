"""The router's side of the shard protocol: every call goes to all shards at once."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable

import grpc

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc

SHARD_TIMEOUT_ENV = "GAUDI_SERVE_SHARD_TIMEOUT_S"
DEFAULT_SHARD_TIMEOUT_S = 600.0


def shard_timeout_s(environ=None) -> float:
    """Longest a shard call (Prefill, Decode, ...) may take before the shard counts as hung."""
    raw = (os.environ if environ is None else environ).get(SHARD_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_SHARD_TIMEOUT_S
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{SHARD_TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


class ShardError(Exception):
    """A shard failed, hung past the call timeout, or could not be reached."""


class ShardClient:
    def __init__(self, uds_paths: list[str], call_timeout_s: float | None = None, numbered: bool = True):
        self.uds_paths = uds_paths
        # A call that outlives this is a hung shard: DEADLINE_EXCEEDED becomes a ShardError (engine failure).
        self.call_timeout_s = shard_timeout_s() if call_timeout_s is None else call_timeout_s
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.TextGenerationServiceStub] = []
        # Calls that change cached batches are numbered when made, so the shards run them in that order
        # even when several are in flight (shard/call_order.py). A client that never overlaps its calls,
        # beside shards another client may number (`benchmark --attach`), sends 0: run on arrival.
        self._sequence = itertools.count(1) if numbered else itertools.repeat(0)

    async def connect(self, timeout_s: float, alive=lambda: True) -> None:
        """Wait for every shard's socket and a successful Health call."""
        deadline = time.monotonic() + timeout_s
        for path in self.uds_paths:
            while not os.path.exists(path):
                if time.monotonic() > deadline or not alive():
                    raise ShardError(f"shard socket {path} did not appear within {timeout_s:.0f}s")
                await asyncio.sleep(0.05)
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self.channels = [grpc.aio.insecure_channel(f"unix://{p}", options=opts) for p in self.uds_paths]
        self.stubs = [pb_grpc.TextGenerationServiceStub(c) for c in self.channels]
        await self._all("Health", pb.HealthRequest(), timeout=max(1.0, deadline - time.monotonic()),
                        wait_for_ready=True)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    async def _all(self, method: str, request, timeout: float | None = None, wait_for_ready: bool = False):
        calls = [getattr(s, method)(request, timeout=timeout or self.call_timeout_s, wait_for_ready=wait_for_ready)
                 for s in self.stubs]
        try:
            results = await asyncio.gather(*calls)
        except grpc.aio.AioRpcError as e:
            raise ShardError(f"{method} failed: {e.code().name}: {e.details()}") from e
        return results[0]

    async def info(self) -> pb.InfoResponse:
        return await self._all("Info", pb.InfoRequest())

    async def warmup(self, on_progress) -> None:
        """Run warmup on every shard; rank 0's progress is reported."""

        async def one(rank: int, stub) -> None:
            async for p in stub.Warmup(pb.WarmupRequest(), timeout=None):
                if rank == 0:
                    on_progress(p.done, p.total, p.phase)

        try:
            await asyncio.gather(*(one(r, s) for r, s in enumerate(self.stubs)))
        except grpc.aio.AioRpcError as e:
            raise ShardError(f"Warmup failed: {e.code().name}: {e.details()}") from e

    async def compile_grammar(self, kind: str, value: str, grammar_id: int, timeout: float) -> pb.CompileGrammarResponse:
        """Every shard compiles the grammar and keeps it under `grammar_id` (not numbered: it changes
        no batch; a prefill names the id)."""
        req = pb.CompileGrammarRequest(type=kind, value=value, id=grammar_id)
        return await self._all("CompileGrammar", req, timeout=timeout)

    # Not coroutines themselves: each call takes its number when made, before the caller awaits it.

    def prefill(self, batch: pb.Batch, kv_copies: list[pb.KvCopies] | None = None,
                forget_grammars: list[int] | None = None) -> Awaitable[pb.PrefillResponse]:
        return self._all("Prefill", pb.PrefillRequest(batch=batch, sequence=next(self._sequence), kv_copies=kv_copies,
                                                      forget_grammars=forget_grammars))

    async def fetch_blocks(self, hashes: list[bytes], discard: list[bytes]) -> list[pb.FetchBlocksResponse]:
        """Every shard reads these disk-tier blocks into staging (not numbered: it changes no batch);
        every shard's answer, as each says which it loaded."""
        req = pb.FetchBlocksRequest(hashes=hashes, discard=discard)
        try:
            return list(await asyncio.gather(*(s.FetchBlocks(req, timeout=self.call_timeout_s) for s in self.stubs)))
        except grpc.aio.AioRpcError as e:
            raise ShardError(f"FetchBlocks failed: {e.code().name}: {e.details()}") from e

    def decode(self, batches: list[pb.CachedBatch], steps: int = 1,
               ride: pb.PrefillRequest | None = None) -> Awaitable[pb.DecodeResponse]:
        """`steps` decode steps of the cached `batches`; `ride`: a prefill computed with the first of them."""
        return self._all("Decode", pb.DecodeRequest(batches=batches, sequence=next(self._sequence), steps=steps,
                                                    ride=ride))

    def load_adapter(self, slot: int, name: str, path: str, load_id: int) -> Awaitable[pb.LoadAdapterResponse]:
        """Every shard writes the LoRA adapter at `path` (load `load_id`: the key of its host copy) into device
        slot `slot`, between two steps in call order."""
        return self._all("LoadAdapter", pb.LoadAdapterRequest(slot=slot, name=name, path=path, load_id=load_id,
                                                              sequence=next(self._sequence)))

    def clear(self, batch_id: int | None) -> Awaitable[pb.ClearCacheResponse]:
        """Drop one cached batch, or every one (None)."""
        req = pb.ClearCacheRequest(sequence=next(self._sequence))
        if batch_id is not None:
            req.batch_id = batch_id
        return self._all("ClearCache", req)
