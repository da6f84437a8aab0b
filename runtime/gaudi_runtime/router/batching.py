"""The batching loop: which calls the shards get, and when.

One asyncio task runs TGI's loop: prefill a batch from the queue, then decode it step by step;
between steps, waiting requests join through a prefill of their own when the scheduler's rules
(router/scheduler.py) allow, and requests that ended are no longer named.

The next Decode is made before the current one's answer is back (PIPELINE_DEPTH calls in flight;
the shards run them in the order they were made, shard/call_order.py), so the shards go from one
step to the next without waiting on the round trip or on this process. A call names the requests
running when it is made; one that ends in a step still in flight gets one more token computed,
which is dropped. Its KV blocks may already serve a new request then: that request's prefill is
made after the stale call, so on the shards its writes land last. Answers are handled in the order
the calls were made, whatever order they arrive in, so each request's tokens stream in order.

While nothing waits, a decode call runs several steps (--decode-steps), so that a call's fixed
costs (gRPC, messages, this loop, one write per stream) are paid once for several tokens
(docs/performance.md has the measurements); its tokens stream together. A call never asks a
request for more tokens than it may still generate, so every write stays in the request's own KV
blocks; once a request waits, calls run one step, so its prefill is held back by no more than the
calls already made.

A prompt longer than --max-batch-prefill-tokens is prefilled in chunks (`RunningBatch.chunking`): each
chunk is a prefill over the blocks the chunks before it wrote, one per decode call of the running
requests; it rides that call (`DecodeRequest.ride`), and the shards compute it in the same forward pass
as the call's step where they can (shard/runner.py, `decode_with`). A chunk before the last has its
batch dropped at once (its token is not the prompt's); the last one's batch joins the decodes from the
next call on. A chunk is registered in the prefix cache only after this loop's other prefills are made,
as the call it rides comes after them. So a running request waits for at most one chunk's tokens (and
one joining prefill) between two of its tokens, never for a whole long prompt. With no decode to ride
(nothing else runs), a chunk is its own prefill call, and counts in the pipeline as a decode call does.

With LongRoPE (Phi-3), a sequence whose answer reaches the original length is prefilled again, prompt
and answer whole, as Phi-3's `generate()` recomputes it with the long factor set (prefix_cache.py,
`reprefill_at`): no call asks it for a step that could feed a token at that position (with speculation
a step may give speculate + 1 tokens, and the shards never draft up to it), so it leaves the batch
(`RunningBatch.parked`); once every call naming it is answered its prefill is made and its batch joins
the decodes. A speculative sequence that left early is prefilled again short, and goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field

from gaudi_runtime.config import Config
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.adapter_placement import AdapterPlacement
from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests, RequestState
from gaudi_runtime.router.output import OutputProcessor
from gaudi_runtime.router.scheduler import decode_call_steps, join_min_size, select_prefill
from gaudi_runtime.router.types import GenerationError, GrammarSpec

log = logging.getLogger(__name__)

# Decode calls in flight: one computing on the shards, one queued behind it.
PIPELINE_DEPTH = 2


@dataclass
class Call:
    """A call sent to the shards (`rpc`, already running) and what handles its answer, in call order."""

    rpc: asyncio.Future
    answer: Coroutine | None = None  # awaits `rpc` and streams its tokens; None: nothing to stream
    steps: int = 0  # decode steps it runs (0: not a decode)
    chunk: bool = False  # a chunk of a long prompt: it takes a place in the pipeline as a decode does

    async def handled(self):
        return await (self.answer if self.answer is not None else self.rpc)

    def cancel(self) -> None:
        self.rpc.cancel()
        if self.answer is not None:
            self.answer.close()


@dataclass
class RunningBatch:
    """The shards' cached batch as the calls made so far leave it, and those calls not yet handled."""

    id: int | None = None
    request_ids: list[int] = field(default_factory=list)  # as the last call made named them
    inflight: deque[Call] = field(default_factory=deque)  # in call order
    waiting_steps: int = 0  # decode steps handled since a prefill last joined
    chunking: RequestState | None = None  # the request whose prompt is being prefilled in chunks
    first_chunk: pb.Request | None = None  # its first chunk, not yet made (`take` registered its blocks)
    joining: list[pb.CachedBatch] = field(default_factory=list)  # a ridden prefill's batch: the next call names it
    parked: list[int] = field(default_factory=list)  # left the batch to be prefilled again (LongRoPE)

    def decodes_in_flight(self) -> int:
        return sum(c.steps > 0 or c.chunk for c in self.inflight)


class BatchingLoop:
    def __init__(self, cfg: Config, client: ShardClient, requests: Requests, output: OutputProcessor,
                 metrics: EngineMetrics):
        self.cfg = cfg
        self.client = client
        self.requests = requests
        self.output = output
        self.metrics = metrics
        self._wake = asyncio.Event()
        self._batch_ids = itertools.count(1)
        self._step_ms: float | None = None  # the shards' recent time per decode step (forward passes)
        selects = requests.adapters.selects
        self.placement = AdapterPlacement(cfg.adapters.max_loras, client, requests, metrics) if selects else None

    def wake(self) -> None:
        """A request arrived or left: serve, if the loop is idle."""
        self._wake.set()

    async def run(self) -> None:
        """Serve requests as they come, forever; a shard failure is raised."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._run_batch()
            self.metrics.batch_size(0, 0)

    async def _run_batch(self) -> None:
        """Prefill waiting requests and decode them, with the requests that join them, until none runs."""
        batch = RunningBatch()
        try:
            while True:
                while batch.decodes_in_flight() < PIPELINE_DEPTH and await self._make_decode(batch):
                    pass
                if not batch.inflight:
                    if batch.id is not None:
                        await self.client.clear(batch.id)
                    return
                call = batch.inflight.popleft()
                await call.handled()
                batch.waiting_steps += call.steps
        finally:
            for call in batch.inflight:  # only after a failure: let no call outlive the loop that made it
                call.cancel()

    async def _make_decode(self, batch: RunningBatch) -> bool:
        """Make the next decode call, over the running requests and those a prefill adds now, after the
        next chunk of a prompt being chunked; False: nothing was made."""
        ids = [rid for rid in batch.request_ids if self._sendable(rid)]
        if self.requests.prefix.long_rope_from is not None:  # only LongRoPE parks a request (`_room`)
            # A parked request no call has left out yet is still in the shards' batch: it goes on there.
            batch.parked = [rid for rid in batch.parked if rid not in ids]
            batch.parked += [rid for rid in batch.request_ids if rid not in batch.parked and self._parks(rid)]
        chunked = batch.chunking is not None
        joined = self._still_joining(batch) + self._reprefills(batch)
        if self.requests.waiting:
            prefilled, join = await self._join(len(ids), batch)
            joined.append(join)
            if prefilled:
                batch.waiting_steps = 0
                ids = [rid for rid in ids if self._sendable(rid)]  # some may have ended while it was awaited
        chunk = self._next_chunk(batch) if batch.chunking is not None else None
        joined = [b for b in joined if b is not None]
        parts = ([pb.CachedBatch(id=batch.id, request_ids=ids)] if ids else []) + joined
        ride = None
        if chunk is not None and parts:
            ride = self._ride(chunk[1])
        elif chunk is not None:
            parts = [b for b in [self._send_chunk(batch, *chunk)] if b is not None]
        if not parts:
            return chunked or batch.chunking is not None  # a chunk was made: the next one may follow it
        if not ids and batch.id is not None:  # none of the old batch runs on: the joined one replaces it
            batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(batch.id))))
        quiet = not joined and not self.requests.waiting and batch.chunking is None and ride is None
        steps = self._steps(ids) if ids and quiet else 1
        batch.id, batch.request_ids = parts[0].id, [rid for b in parts for rid in b.request_ids]
        max_tokens = 0
        for rid in batch.request_ids:  # all live: nothing ran since they were checked
            state = self.requests.get(rid)
            state.sent += steps
            max_tokens += len(state.req.input_ids) + state.req.stopping.max_new_tokens
        self.metrics.batch_size(len(batch.request_ids), max_tokens)
        # The call is made (numbered) here, before anything else the loop sends.
        rode = None if ride is None else (chunk[0], chunk[2])  # the chunk's request, whether it is the last
        rpc = asyncio.ensure_future(self.client.decode(parts, steps, ride))
        batch.inflight.append(Call(rpc, self._answer_decode(parts, rpc, time.monotonic(), steps, rode), steps))
        if rode is not None:
            state, last = rode
            if last and self._runs_on(batch, [state.id]):
                batch.joining = [pb.CachedBatch(id=ride.batch.id, request_ids=[state.id])]
            else:  # a chunk before the last: its KV is kept, its batch dropped at once
                batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(ride.batch.id))))
        return True

    def _still_joining(self, batch: RunningBatch) -> list[pb.CachedBatch]:
        """The batch a ridden prefill left on the shards, for the next call to name (its request, if it still
        runs on; else the batch is dropped)."""
        joined, batch.joining = batch.joining, []
        out = []
        for b in joined:
            ids = [rid for rid in b.request_ids if self._sendable(rid)]
            if ids:
                out.append(pb.CachedBatch(id=b.id, request_ids=ids))
            else:
                batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(b.id))))
        return out

    def _sendable(self, rid: int) -> bool:
        """Whether the next decode call computes a token for `rid`: it is live, may take more, and its
        next step does not cross LongRoPE's original length (`_room`)."""
        state = self.requests.get(rid)
        return state is not None and state.sent < state.req.stopping.max_new_tokens and self._room(state) > 0

    def _parks(self, rid: int) -> bool:
        """Whether `rid` leaves the batch to be prefilled again: it may take more, but not a step now."""
        state = self.requests.get(rid)
        return state is not None and state.sent < state.req.stopping.max_new_tokens and self._room(state) == 0

    def _room(self, state: RequestState) -> int:
        """Decode steps a call may ask of `state` now: before LongRoPE's prefill again (`reprefill_at`), only
        steps that cannot feed the token at the original length, however many tokens the steps in flight
        give; else no limit."""
        at = None if state.rotated_long else self.requests.prefix.reprefill_at(state.req)
        if at is None:
            return state.req.stopping.max_new_tokens
        per_step = self.cfg.scheduling.speculate + 1  # the most tokens a step gives
        steps = state.sent - state.answered - state.prefill_pending  # decode steps in flight
        most = len(state.output_ids) + steps * per_step + state.prefill_pending  # tokens before the next step
        return 0 if most >= at else (at - most - 1) // per_step + 1

    def _reprefills(self, batch: RunningBatch) -> list[pb.CachedBatch]:
        """Prefill again each parked request whose calls are all answered; the batches that join."""
        joined, parked = [], []
        for rid in batch.parked:
            state = self.requests.get(rid)
            if state is None:
                continue
            if state.answered < state.sent:
                parked.append(rid)
                continue
            request = reprefill_request(state)
            state.rotated_long = len(request.input_ids) > self.requests.prefix.long_rope_from
            state.sent, state.prefill_pending = state.sent + 1, True
            batch_id, call = self._make_prefill([(state, request)])
            batch.inflight.append(call)
            if self._sendable(rid):
                joined.append(pb.CachedBatch(id=batch_id, request_ids=[rid]))
                continue
            if self._parks(rid):  # a speculative sequence prefilled short, a token before the length: again
                parked.append(rid)
            batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))
        batch.parked = parked
        return joined

    def _steps(self, ids: list[int]) -> int:
        """Decode steps the next call runs for the running `ids` (none joining, none waiting)."""
        if self.cfg.scheduling.decode_steps <= 1:
            return 1
        states = [self.requests.get(rid) for rid in ids]
        left = min(min(s.req.stopping.max_new_tokens - s.sent, self._room(s)) for s in states)
        return decode_call_steps(self.cfg.scheduling.decode_steps, left, self._step_ms)

    async def _join(self, running: int, batch: RunningBatch) -> tuple[bool, pb.CachedBatch | None]:
        """Prefill the waiting requests that may join `running` decodes now (a long prompt: its first
        chunk, unless one is being chunked already).

        Returns whether a prefill was made, and the batch the next decode call should add. The
        prefill's answer is awaited in `inflight`'s order, so the decode naming its batch is made at
        once and the shards go straight from one to the other.
        """
        inflight = batch.inflight
        oldest = (time.monotonic() - self.requests.waiting[0].enqueued) * 1000
        min_size = join_min_size(running, batch.waiting_steps, oldest, self.cfg.scheduling)
        taken = self._take_waiting(running, min_size, chunks=batch.chunking is None)
        if self.placement is not None and taken:
            taken = await self.placement.place(taken)  # their adapters into device slots
            if not taken:
                self.wake()  # any put back wait again: serve them even if nothing else runs
                return True, None
        if len(taken) == 1 and taken[0].prefilled < len(taken[0].req.input_ids):
            self._first_chunk(batch, taken[0])  # made by the caller, after this
            return True, None
        encoded = self._encoded(taken)
        if not encoded:
            return bool(taken), None
        chosen = [state for state, _ in encoded]
        batch_id, call = self._make_prefill(encoded)
        if any(s.req.images for s in chosen):
            # The shards may refuse a prompt's images: see the answer before a decode names the batch.
            # The calls made before it are handled first, to keep each request's tokens in order.
            while inflight:
                await inflight.popleft().handled()
            running_ids = self._runs_on(batch, await call.handled())
        else:
            inflight.append(call)
            running_ids = self._runs_on(batch, [s.id for s in chosen])
        if not running_ids:
            inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))
            return True, None
        return True, pb.CachedBatch(id=batch_id, request_ids=running_ids)

    def _take_waiting(self, running: int, min_size: int | None, chunks: bool) -> list[RequestState]:
        """The requests the next prefill takes (TGI's rules), their KV blocks reserved."""
        view = self.requests.waiting_view(max(0, self.cfg.scheduling.max_batch_size - running))
        for state in self.requests.fetches():
            asyncio.ensure_future(self._fetch(state))
        return self.requests.take(select_prefill(view, running, self.requests.allocator.free_count, self.cfg,
                                                 min_size, chunks, self.requests.running_adapters()))

    def _first_chunk(self, batch: RunningBatch, state: RequestState) -> None:
        """Start prefilling `state`'s long prompt in chunks: its first (`take` registered its blocks) is made
        next, by `_next_chunk`, as the others are, one per decode call."""
        request = self._encode_or_end(state, state.cached_tokens, state.prefilled)
        if request is None:
            return
        batch.chunking, batch.first_chunk = state, request

    def _next_chunk(self, batch: RunningBatch) -> tuple[RequestState, pb.Request, bool] | None:
        """The next chunk of the prompt being chunked (registered: made next, after every prefill this loop
        made before it) and whether it is the last; None: the request ended."""
        state = batch.chunking
        if state.ended:  # cancelled between two chunks
            batch.chunking, batch.first_chunk = None, None
            return None
        request, batch.first_chunk = batch.first_chunk, None
        if request is None:
            start, end = state.prefilled, self.requests.next_prefill_end(state)
            self.requests.prefill_made(state, end)
            request = prefill_request(state, start, end)  # encodable: its first chunk was
        last = len(request.input_ids) == len(state.req.input_ids)
        if last:
            batch.chunking = None
        return state, request, last

    def _ride(self, request: pb.Request) -> pb.PrefillRequest:
        """A chunk's prefill, to ride the decode call about to be made (the shards compute it in the same
        forward pass where they can), as a batch of its own."""
        return pb.PrefillRequest(batch=pb.Batch(id=next(self._batch_ids), requests=[request]),
                                 kv_copies=self._copies(), forget_grammars=self.requests.grammars.take_forgotten())

    def _send_chunk(self, batch: RunningBatch, state: RequestState, request: pb.Request,
                    last: bool) -> pb.CachedBatch | None:
        """Make a chunk's own prefill call (no decode call to ride); the last one's batch joins the decodes."""
        if not last:
            self._make_chunk(batch, state, request)
            return None
        batch_id, call = self._make_prefill([(state, request)])
        batch.inflight.append(call)
        if self._runs_on(batch, [state.id]):
            return pb.CachedBatch(id=batch_id, request_ids=[state.id])
        batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))
        return None

    def _runs_on(self, batch: RunningBatch, ids: list[int]) -> list[int]:
        """Of the requests just prefilled, those the next decode call names; those to be prefilled again
        before their next step (LongRoPE) are parked."""
        batch.parked += [rid for rid in ids if self._parks(rid)]
        return [rid for rid in ids if self._sendable(rid)]

    def _make_chunk(self, batch: RunningBatch, state: RequestState, request: pb.Request) -> None:
        """A chunk that is not the prompt's last: its KV is kept, its batch dropped at once."""
        batch_id = next(self._batch_ids)
        rpc = asyncio.ensure_future(self.client.prefill(pb.Batch(id=batch_id, requests=[request]), self._copies(),
                                                        self.requests.grammars.take_forgotten()))
        batch.inflight.append(Call(rpc, self._answer_chunk(state, rpc, time.monotonic()), chunk=True))
        batch.inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))

    def _encode_or_end(self, state: RequestState, start: int | None = None, end: int | None = None) -> pb.Request | None:
        """`prefill_request`, or None after ending `state` with its own error when it holds a value the
        protocol cannot carry (validation should have refused it)."""
        try:
            return prefill_request(state, start, end)
        except ValueError as e:
            log.error("request %d cannot be sent to the shards: %s", state.id, e)
            self.requests.end(state, GenerationError(f"the request cannot be sent to the shards: {e}"))
            return None

    def _encoded(self, taken: list[RequestState]) -> list[tuple[RequestState, pb.Request]]:
        """Each request in the shards' protocol; one holding a value the protocol cannot carry ends
        with its own error, and the others go on (validation should have refused it). Those that were
        to read blocks such a request would have filled (prefix caching) wait for the next prefill."""
        out, unfilled = [], set()
        for state in taken:
            own_blocks = state.blocks[state.cached_tokens // self.cfg.device.block_size:]
            request = self._encode_or_end(state)
            if request is None:
                unfilled.update(own_blocks)
            else:
                out.append((state, request))
        stranded: list[RequestState] = []
        for state, _ in out:  # in take order: a request reads only blocks of requests before it
            if unfilled.intersection(state.blocks):
                stranded.append(state)
                unfilled.update(state.blocks[state.cached_tokens // self.cfg.device.block_size:])
        if stranded:
            self.requests.requeue(stranded)
            self.wake()  # they are waiting again: serve them even if nothing else runs
        return [(state, request) for state, request in out if state not in stranded]

    def _make_prefill(self, encoded: list[tuple[RequestState, pb.Request]]) -> tuple[int, Call]:
        """Make the prefill call now; returns its batch id and the call, whose answer gives the running ids."""
        batch_id = next(self._batch_ids)
        chosen = [state for state, _ in encoded]
        batch = pb.Batch(id=batch_id, requests=[request for _, request in encoded])
        rpc = asyncio.ensure_future(self.client.prefill(batch, self._copies(), self.requests.grammars.take_forgotten()))
        return batch_id, Call(rpc, self._answer_prefill(chosen, rpc, time.monotonic()))

    async def _answer_prefill(self, chosen: list[RequestState], rpc: Awaitable[pb.PrefillResponse],
                              made: float) -> list[int]:
        try:
            resp = await rpc
        except ShardError as e:
            self._end_with_error([s.id for s in chosen], e)
            raise
        for state in chosen:
            state.answered, state.prefill_pending = state.answered + 1, False
        self.metrics.prefill_answered(made, resp, len(chosen))
        return self.output.process(resp.generations)

    def _copies(self) -> list[pb.KvCopies]:
        """The tier copies the admissions since the last Prefill made (router/kv_tiers.py)."""
        tiers = self.requests.prefix.tiers
        return [] if tiers is None else [pb.KvCopies(**c.as_dict()) for c in tiers.drain()]

    async def _fetch(self, state: RequestState) -> None:
        """Have every shard read `state`'s disk blocks into staging; it waits (not admitted) until then."""
        tiers = self.requests.prefix.tiers
        try:
            answers = await self.client.fetch_blocks(state.disk_hashes, tiers.take_discards())
            tiers.fetched(state.disk_hashes, [set(a.loaded) for a in answers], sum(a.corrupt for a in answers))
            self.metrics.kv_offload_count("copy_seconds", "disk_read", answers[0].read_ns / 1e9)
        except ShardError as e:
            log.warning("reading KV blocks from the disk tier failed: %s; the prompt is computed", e)
            self.metrics.kv_offload_count("faults", "fetch_failed", 1)
        state.disk_fetch, state.disk_hashes = "done", []
        self.wake()

    async def _answer_chunk(self, state: RequestState, rpc: Awaitable[pb.PrefillResponse], made: float) -> None:
        try:
            resp = await rpc
        except ShardError as e:
            self._end_with_error([state.id], e)
            raise
        self.metrics.prefill_answered(made, resp, 1)
        self.metrics.prefill_chunk(last=False, in_step=False)

    async def _answer_decode(self, batches: list[pb.CachedBatch], rpc: Awaitable[pb.DecodeResponse],
                             made: float, steps: int = 1, ride: tuple[RequestState, bool] | None = None) -> None:
        """Stream a decode call's tokens; `ride`: the chunk that rode it (its request, whether the last)."""
        try:
            resp = await rpc
        except ShardError as e:
            self._end_with_error([rid for b in batches for rid in b.request_ids] + ([ride[0].id] if ride else []), e)
            raise
        if ride is not None:
            self._answer_ride(resp, *ride, made)
        for rid in (rid for b in batches for rid in b.request_ids):
            state = self.requests.get(rid)
            if state is not None:
                state.answered += steps
        self.metrics.decode_answered(made, resp)
        if resp.forward_ns:
            step_ms = resp.forward_ns / 1e6 / (1 + len(resp.next_steps))
            self._step_ms = step_ms if self._step_ms is None else 0.8 * self._step_ms + 0.2 * step_ms
        self.output.process(resp.generations)
        for gens in resp.next_steps:
            self.output.process(gens)

    def _answer_ride(self, resp: pb.DecodeResponse, state: RequestState, last: bool, made: float) -> None:
        """The answer to a chunk that rode a decode call, as its own prefill call's would be handled."""
        self.metrics.prefill_answered(made, resp.ride, 1)
        self.metrics.prefill_chunk(last, resp.ride_in_step)
        if last:
            state.answered, state.prefill_pending = state.answered + 1, False
            self.output.process(resp.ride.generations)

    def _end_with_error(self, request_ids: list[int], error: ShardError) -> None:
        for rid in request_ids:
            state = self.requests.get(rid)
            if state is not None:
                self.requests.end(state, GenerationError(str(error)))


def prefill_request(state: RequestState, start: int | None = None, end: int | None = None) -> pb.Request:
    """The shards' view of a request: its prompt (up to `end`, a chunk's; the KV of its first `start`
    tokens in the cache: by default the cached blocks it was taken with), its reserved blocks, how to
    sample it."""
    r, s = state.req, state.req.sampling
    return pb.Request(
        id=state.id, input_ids=r.input_ids if end is None else r.input_ids[:end], top_n_tokens=r.top_n_tokens,
        blocks=state.blocks, prefill_logprobs=r.decoder_input_details, images=r.images,
        cached_tokens=state.cached_tokens if start is None else start, adapter_index=state.device_slot,
        max_new_tokens=r.stopping.max_new_tokens, sequence_tokens=len(r.input_ids),
        grammar=shard_grammar(r.grammar, state.grammar_id) if r.grammar is not None else None,
        parameters=pb.NextTokenChooserParameters(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
            do_sample=s.do_sample, seed=s.seed, repetition_penalty=s.repetition_penalty,
            frequency_penalty=s.frequency_penalty, generated_frequency_penalty=s.generated_frequency_penalty,
            presence_penalty=s.presence_penalty),
    )


def reprefill_request(state: RequestState) -> pb.Request:
    """`state` prefilled again (LongRoPE): its prompt and the answer so far as one prompt, computed whole in
    its own blocks (it shares none: prefix_cache.reprefill_at), for the tokens it may still generate."""
    request = prefill_request(state, start=0)
    request.input_ids.extend(state.output_ids)
    request.sequence_tokens = len(request.input_ids)
    request.prefill_logprobs = False
    request.max_new_tokens = state.req.stopping.max_new_tokens - len(state.output_ids)
    return request


def shard_grammar(g: GrammarSpec, grammar_id: int) -> pb.Grammar:
    """The request's grammar by the id the shards compiled it under (its text crossed then, once)."""
    thinking = None if g.thinking is None else \
        pb.Thinking(start_token=g.thinking[0], end_token=g.thinking[1], open=g.thinking[2])
    return pb.Grammar(id=grammar_id, thinking=thinking)
