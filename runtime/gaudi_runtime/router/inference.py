"""Calling the engine from a handler: health gate, per-request metrics, closing.

Every engine iterator is closed (`aclose`) when the handler stops early, whether
the client went away (the write fails, or aiohttp cancels the handler) or an
error ended the request: that is how the engine frees the request's slot.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from gaudi_runtime.router.errors import UnhealthyError, error_type
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.state import AppState
from gaudi_runtime.router.types import GenerationEnd, GenerationError, StreamEvent, Token, ValidRequest


class RequestRecorder:
    """Per-request metrics for one HTTP request (which may run several sequences)."""

    def __init__(self, metrics: Metrics, tracer=None):
        self.m = metrics
        self.tracer = tracer  # router.tracing.RequestTracer with --otlp-endpoint, else None
        self.start = time.monotonic()
        self._first_token: float | None = None
        self._input_tokens = 0
        self.validated_at: float | None = None
        self._last_token: float | None = None
        self._done = False
        self._ends: list[GenerationEnd] = []
        metrics.tgi_request_count.inc()

    def validated(self, requests: list[ValidRequest]) -> None:
        self.validated_at = time.monotonic()
        self.m.tgi_request_validation_duration.observe(self.validated_at - self.start)
        self._input_tokens = sum(len(r.input_ids) for r in requests)
        for r in requests:
            self.m.tgi_request_input_length.observe(len(r.input_ids))
            self.m.tgi_request_max_new_tokens.observe(r.stopping.max_new_tokens)

    def ended(self, end: GenerationEnd) -> None:
        """A sequence of this request finished (recorded at success)."""
        self._ends.append(end)

    def success_pending(self) -> None:
        """Success with the ends seen by `ended`."""
        self.success(self._ends)

    def token(self) -> None:
        now = time.monotonic()
        if self._last_token is None:
            self._first_token = now
            self.m.tgi_request_time_to_first_token_duration.observe(now - self.start)
        else:
            self.m.tgi_request_inter_token_latency_duration.observe(now - self._last_token)
        self._last_token = now

    def success(self, ends: list[GenerationEnd]) -> None:
        if self._done:
            return
        self._done = True
        self.m.tgi_request_success.inc()
        self.m.tgi_request_duration.observe(time.monotonic() - self.start)
        for end in ends:
            self.m.tgi_request_queue_duration.observe(end.queue_time)
            self.m.tgi_request_inference_duration.observe(end.inference_time)
            self.m.tgi_request_generated_tokens.observe(end.generated_tokens)
            if end.generated_tokens:
                self.m.tgi_request_mean_time_per_token_duration.observe(end.inference_time / end.generated_tokens)
        self._trace("success", ends)

    def failure(self, exc: BaseException | str) -> None:
        if self._done:
            return
        self._done = True
        self.m.tgi_request_failure.labels(err=exc if isinstance(exc, str) else error_type(exc)).inc()
        self._trace(exc if isinstance(exc, str) else error_type(exc), self._ends)

    def _trace(self, status: str, ends: list[GenerationEnd]) -> None:
        if self.tracer is None:
            return
        from gaudi_runtime.router.tracing import RequestTimes

        attrs = {"status": status, "input_tokens": self._input_tokens,
                 "generated_tokens": sum(e.generated_tokens for e in ends)}
        if ends:
            attrs["finish_reason"] = ends[0].finish_reason.value
        self.tracer.record(RequestTimes(start=self.start, end=time.monotonic(), validated=self.validated_at,
                                        first_token=self._first_token,
                                        queue_time=max((e.queue_time for e in ends), default=0.0),
                                        attributes=attrs))

    def cancelled(self) -> None:
        self.failure("cancelled")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


def check_health(state: AppState) -> None:
    ok, body = state.engine.health()
    if not ok:
        status = body.get("status", "unhealthy") if isinstance(body, dict) else "unhealthy"
        raise UnhealthyError(f"the server cannot serve requests yet ({status})")


async def events(state: AppState, request: ValidRequest, rec: RequestRecorder
                 ) -> AsyncIterator[list[StreamEvent]]:
    """The engine's events for one request, in lists of those ready together (a stream writes each
    list at once); the engine's iterator is always closed."""
    agen = state.engine.generate_groups(request)
    async with aclosing(agen):
        async for group in agen:
            for _ in group:
                rec.token()
            end = group[-1].end
            if end is not None:
                rec.ended(end)
            yield group
            if end is not None:
                return
    raise GenerationError("the engine ended the request without a final token")


@dataclass
class Generation:
    """Every event of one finished sequence."""

    request: ValidRequest
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    end: GenerationEnd | None = None

    @property
    def logprob_sum(self) -> float:
        s = sum(t.logprob for t in self.tokens if t.logprob is not None and not math.isnan(t.logprob))
        return s


async def collect(state: AppState, request: ValidRequest, rec: RequestRecorder) -> Generation:
    gen = Generation(request)
    async with aclosing(events(state, request, rec)) as it:
        async for group in it:
            for ev in group:
                gen.tokens.append(ev.token)
                gen.top_tokens.append(list(ev.top_tokens))
            gen.end = group[-1].end
    return gen


async def collect_all(state: AppState, requests: list[ValidRequest], rec: RequestRecorder) -> list[Generation]:
    """Run requests concurrently; the first failure cancels (and closes) the others."""
    if len(requests) == 1:
        return [await collect(state, requests[0], rec)]
    tasks = [asyncio.ensure_future(collect(state, r, rec)) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(state: AppState, requests: list[ValidRequest], rec: RequestRecorder
                ) -> AsyncIterator[tuple[int, list[StreamEvent]]]:
    """Events of several requests as they come, tagged with the request's index (lists of the
    events of one request ready together, as `events` gives them)."""
    if len(requests) == 1:
        async with aclosing(events(state, requests[0], rec)) as it:
            async for group in it:
                yield 0, group
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, r: ValidRequest) -> None:
        try:
            async with aclosing(events(state, r, rec)) as it:
                async for group in it:
                    await queue.put((i, group, None))
        except Exception as e:  # handed to the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, group, err = await queue.get()
            if err is not None:
                raise err
            if group is done:
                remaining -= 1
                continue
            yield i, group
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
