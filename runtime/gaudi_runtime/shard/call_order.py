"""Runs the router's numbered batch calls in its order, whatever order they arrive in.

The router keeps the next Decode queued on the shard while the current one
computes (router/batching.py); each call changes the cached batches the next
one names, so the shard must take them in the order they were sent.
gRPC gives no such promise for separate calls, hence the numbers.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class CallOrder:
    def __init__(self) -> None:
        self._next = 1
        self._turn = asyncio.Condition()

    @asynccontextmanager
    async def turn(self, sequence: int):
        """Wait until every call numbered below `sequence` has run (0: unnumbered, runs at once)."""
        if sequence == 0:
            yield
            return
        async with self._turn:
            await self._turn.wait_for(lambda: self._next >= sequence)
        try:
            yield
        finally:
            async with self._turn:
                self._next = max(self._next, sequence + 1)
                self._turn.notify_all()
