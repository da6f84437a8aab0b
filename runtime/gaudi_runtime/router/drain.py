"""Graceful shutdown of the router: stop admitting, fail readiness, let running requests finish.

On SIGTERM (a pod deletion: scale-down, rollout, node drain) `shut_down` puts
the app in draining mode: every new request but those of the open routes
(/ping, /metrics, the API documents) answers 503 in its route's error shape
(TGI's `unhealthy`, OpenAI's on /v1), /health answers 503 so that the Service drops the
pod, and the requests already admitted run to their end.
When the grace period (--shutdown-grace-seconds) ends first, the engine ends
the requests left with an error, so a stream never stops without a final
event or an error event. Then the router exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from gaudi_runtime.router.openai_errors import json_error_for
from gaudi_runtime.router.routes import open_route

log = logging.getLogger(__name__)

# After the grace period, how long the cut requests get to write their error before the server closes.
CUT_WAIT_S = 5.0
SHUTTING_DOWN = "the server is shutting down and takes no new requests"


class Drain:
    """The router's admission gate and its count of requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if open_route(request):  # probes, scrapes, documents: never in flight, answered to the end
            if self.draining and request.path == "/health":
                return web.json_response({"status": "draining", "error": SHUTTING_DOWN, "error_type": "unhealthy"},
                                         status=503)
            return await handler(request)
        if self.draining:
            return json_error_for(request.path, 503, SHUTTING_DOWN, "unhealthy")
        self.in_flight += 1
        self.idle.clear()
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()


DRAIN = web.AppKey("gaudi_serve_drain", Drain)


async def shut_down(drain: Drain, engine, grace_s: float, hurry: asyncio.Event) -> None:
    """Drain: wait up to `grace_s` (or until `hurry` is set) for the requests in flight, then end the rest."""
    drain.draining = True
    log.info("shutting down: no new requests; %d in flight get up to %gs to finish", drain.in_flight, grace_s)
    waits = [asyncio.ensure_future(drain.idle.wait()), asyncio.ensure_future(hurry.wait())]
    await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if not drain.in_flight:
        log.info("every request finished; stopping")
        return
    log.warning("grace period over: ending %d request(s) with an error", drain.in_flight)
    # Every request still running gets its error (an error event on a stream) from the engine.
    engine.fail(f"the server shut down before this request finished (grace period of {grace_s:g}s)")
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain.idle.wait(), CUT_WAIT_S)
