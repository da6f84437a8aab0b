"""The continuous-batching engine: queue, batching loop, per-request streams.

One asyncio task runs TGI's loop: prefill a batch from the queue, then decode
it step by step; between steps, waiting requests join through a prefill of
their own when the scheduler's rules allow, and finished or abandoned ones
leave (their KV blocks go back to the allocator at once).

The next Decode is sent before the current one's answer is back
(PIPELINE_DEPTH calls in flight; the shards run them in the order they were
made, shard/call_order.py), so the shards go from one step to the next
without waiting on the round trip or on this process. A call names the
requests running when it is made; one that finishes in a step still in
flight gets one more token computed, which is dropped. Its KV blocks may
already serve a new request then: that request's prefill is made after the
stale call, so on the shards its writes land last. Answers are handled in
the order the calls were made, whatever order they arrive in, so each
request's tokens stream in order.

While nothing waits, a decode call runs several steps (--decode-steps): a
call's fixed costs (gRPC, messages, this loop, one write per stream) were a
quarter of a batch-1 step and an eighth of a batch-16 one, and a call that
runs four steps pays them once. Its tokens stream together. A call never asks
a request for more tokens than it may still generate, so every write stays in
the request's own KV blocks; once a request waits, calls run one step, so its
prefill is held back by no more than the calls already made.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field

from gaudi_runtime.config import Config
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from gaudi_runtime.router.scheduler import Waiting, blocks_needed, join_min_size, select_prefill
from gaudi_runtime.router.types import (
    FinishReason,
    GenerationEnd,
    GenerationError,
    OverloadedError,
    StreamEvent,
    Token,
    ValidRequest,
)

log = logging.getLogger(__name__)

# Decode calls in flight: one computing on the shards, one queued behind it.
PIPELINE_DEPTH = 2


@dataclass
class Call:
    """A call sent to the shards (`rpc`, already running) and what handles its answer, in call order."""

    rpc: asyncio.Future
    answer: Coroutine | None = None  # awaits `rpc` and streams its tokens; None: nothing to stream
    steps: int = 0  # decode steps it runs (0: not a decode)

    async def handled(self):
        return await (self.answer if self.answer is not None else self.rpc)

    def cancel(self) -> None:
        self.rpc.cancel()
        if self.answer is not None:
            self.answer.close()


@dataclass
class Entry:
    id: int
    req: ValidRequest
    detok: IncrementalDetokenizer
    stop: StopSequenceMatcher
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    blocks: list[int] = field(default_factory=list)
    generated: int = 0
    sent: int = 0  # tokens asked of the shards so far (prefill and decode calls made, answered or not)
    prefill: list[Token] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False


def check_context_fits(max_total_tokens: int, max_positions: int) -> None:
    """Refuse a token budget beyond the positions the model can attend to.

    The shard reports the model's usable context (its sliding window where that
    is what caps it); past it, output would silently stop matching the model.
    """
    if max_positions and max_total_tokens > max_positions:
        raise ValueError(
            f"--max-total-tokens ({max_total_tokens}) exceeds the model's context of {max_positions} "
            "positions (max_position_embeddings, or its sliding window); lower --max-total-tokens")


class BatchingEngine:
    """Implements `router.types.Engine` over the shards."""

    def __init__(self, cfg: Config, client: ShardClient, tokenizer, metrics=None):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.state = "loading"  # loading | warming_up | ready | failed
        self.failure = ""
        self.failed = asyncio.Event()  # set by fail(): the router process exits non-zero on it
        self.warmup_progress = {"done": 0, "total": 0, "phase": "prefill"}
        self.waiting: deque[Entry] = deque()
        self.entries: dict[int, Entry] = {}
        self.in_flight = 0
        self.unwarmed_shapes = 0
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._last_answer = 0.0  # when the last decode call answered
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.allocator: BlockAllocator | None = None
        self.shard_info: pb.InfoResponse | None = None
        self.eos_ids: set[int] = set()
        self.special_ids = tokenizer.special_ids

    # ---- life cycle ----------------------------------------------------

    async def start(self, connect_timeout_s: float = 3600.0, alive=lambda: True) -> None:
        """Connect, read the shards' info, warm up, then serve. Failures mark the engine failed."""
        try:
            await self.client.connect(connect_timeout_s, alive)
            info = await self.client.info()
            check_context_fits(self.cfg.max_total_tokens, info.max_position_embeddings)
            self.shard_info = info
            self.warmup_progress["from_cache"] = json.loads(info.details_json or "{}").get("warmup_from_cache")
            self.allocator = BlockAllocator(info.num_blocks)
            self.eos_ids = set(info.eos_token_ids)
            self.state = "warming_up"
            await self.client.warmup(self._on_warmup)
            self.shard_info = await self.client.info()
            self.state = "ready"
            log.info("ready: %d KV blocks of %d tokens", info.num_blocks, info.block_size)
        except (ShardError, OSError, ValueError) as e:
            self.fail(str(e))
            raise
        self._task = asyncio.create_task(self._loop(), name="batching-loop")

    def _on_warmup(self, done: int, total: int, phase: str) -> None:
        self.warmup_progress.update(done=done, total=total, phase=phase)
        if self.metrics is not None:
            self.metrics.gaudi_serve_warmup_done.set(done)
            self.metrics.gaudi_serve_warmup_total.set(total)

    def fail(self, why: str) -> None:
        log.error("engine failed: %s", why)
        self.state, self.failure = "failed", why
        self.failed.set()
        for e in list(self.entries.values()):
            self._finish_with_error(e, GenerationError(why))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.client.close()

    # ---- Engine protocol -----------------------------------------------

    def health(self) -> tuple[bool, dict]:
        if self.state == "ready":
            return True, {"status": "ok"}
        if self.state == "warming_up":
            return False, {"status": "warming_up", "warmup": dict(self.warmup_progress)}
        if self.state == "failed":
            return False, {"status": "failed", "error": self.failure}
        return False, {"status": "loading"}

    def queue_size(self) -> int:
        return len(self.waiting)

    def info(self) -> dict:
        info = {"state": self.state, "unwarmed_shapes": self.unwarmed_shapes}
        if self.shard_info is not None:
            s = self.shard_info
            info.update({
                "model_dtype": s.dtype, "model_device_type": s.device_type, "num_shard": s.world_size,
                "block_size": s.block_size, "kv_blocks": s.num_blocks,
                "max_batch_total_tokens": s.num_blocks * s.block_size,
                "max_batch_size": self.cfg.max_batch_size,
                "max_batch_prefill_tokens": self.cfg.max_batch_prefill_tokens,
                "max_waiting_tokens": self.cfg.max_waiting_tokens,
                "waiting_served_ratio": self.cfg.waiting_served_ratio,
            })
            details = json.loads(s.details_json or "{}")
            info["warmup"] = details.get("warmup")
            info["weight_bytes_per_shard"] = details.get("weight_bytes")  # rank 0's; every rank holds ~1/N
            for key in ("quantization", "kv_cache_dtype", "warmup_from_cache", "recipe_cache", "startup_seconds"):
                info[key] = details.get(key)
        if self.allocator is not None:
            info["kv_blocks_free"] = self.allocator.free_count
        return info

    async def generate(self, request: ValidRequest):
        if self.state == "failed":
            raise GenerationError(f"the shards failed: {self.failure}")
        if self.in_flight >= self.cfg.max_concurrent_requests:
            raise OverloadedError("Model is overloaded")
        entry = Entry(
            id=next(self._ids), req=request,
            detok=IncrementalDetokenizer(self.tokenizer, prompt_ids=request.input_ids),
            stop=StopSequenceMatcher(list(request.stopping.stop_sequences)),
        )
        self.in_flight += 1
        self.entries[entry.id] = entry
        self.waiting.append(entry)
        self._set_queue_metric()
        self._wake.set()
        try:
            while True:
                ev = await entry.events.get()
                if isinstance(ev, Exception):
                    raise ev
                yield ev
                if ev.end is not None:
                    return
        finally:
            self.in_flight -= 1
            if not entry.finished:
                # The client went away: the loop drops the request at its next step.
                entry.cancelled = True
                self._wake.set()

    # ---- the batching loop ---------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._run_batch()
                self._set_batch_metric(0)
        except asyncio.CancelledError:
            raise
        except ShardError as e:
            self.fail(str(e))
        except Exception as e:  # noqa: BLE001 - a bug here must not leave requests hanging
            log.exception("batching loop crashed")
            self.fail(f"internal error: {e}")

    async def _run_batch(self) -> None:
        """Prefill waiting requests and decode them, with the requests that join them, until none runs."""
        batch_id: int | None = None  # the shards' batch, and its requests, once every call made has run
        resident: list[int] = []
        inflight: deque[Call] = deque()  # in call order
        waiting_steps = 0
        try:
            while True:
                while sum(c.steps > 0 for c in inflight) < PIPELINE_DEPTH:
                    parts = []
                    ids = [rid for rid in resident if self._sendable(rid)]
                    if ids:
                        parts.append(pb.CachedBatch(id=batch_id, request_ids=ids))
                    if self.waiting:
                        prefilled, joined = await self._join(len(ids), waiting_steps, inflight)
                        if prefilled:
                            waiting_steps = 0
                        if joined is not None:
                            parts.append(joined)
                    if not parts:
                        break
                    if not ids and batch_id is not None:  # none of the old batch runs on: the joined one replaces it
                        inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))
                    steps = self._steps(ids) if ids and len(parts) == 1 and not self.waiting else 1
                    batch_id, resident = parts[0].id, [rid for b in parts for rid in b.request_ids]
                    for rid in resident:
                        if rid in self.entries:  # one that finished while a prefill ran is still named
                            self.entries[rid].sent += steps
                    self._set_batch_metric(len(resident))
                    # The call is made (numbered) here, before anything else the loop sends.
                    rpc = asyncio.ensure_future(self.client.decode(parts, steps))
                    inflight.append(Call(rpc, self._decode(parts, rpc, time.monotonic()), steps))
                if not inflight:
                    if batch_id is not None:
                        await self.client.clear(batch_id)
                    return
                call = inflight.popleft()
                await call.handled()
                waiting_steps += call.steps
        finally:
            for call in inflight:  # only after a failure: let no call outlive the loop that made it
                call.cancel()

    def _sendable(self, rid: int) -> bool:
        """Whether the next decode call computes a token for `rid` (a cancelled request leaves here)."""
        e = self.entries.get(rid)
        if e is None or e.finished:
            return False
        if e.cancelled:
            e.finished = True
            self._release(e)
            return False
        return e.sent < e.req.stopping.max_new_tokens

    def _steps(self, ids: list[int]) -> int:
        """Decode steps the next call runs for the running `ids` (none joining, none waiting)."""
        if self.cfg.decode_steps <= 1:
            return 1
        left = min(self.entries[rid].req.stopping.max_new_tokens - self.entries[rid].sent for rid in ids)
        return max(1, min(self.cfg.decode_steps, left))

    def _drop_cancelled_waiting(self) -> None:
        if any(e.cancelled for e in self.waiting):
            for e in [e for e in self.waiting if e.cancelled]:
                self.waiting.remove(e)
                self._release(e)

    def _take_waiting(self, running: int, min_size: int | None) -> list[Entry]:
        """Pop the requests the next prefill takes (TGI's rules) and reserve their KV blocks."""
        self._drop_cancelled_waiting()
        if not self.waiting:
            return []
        now = time.monotonic()
        view = [Waiting(len(e.req.input_ids), e.req.stopping.max_new_tokens, (now - e.enqueued) * 1000)
                for e in self.waiting]
        n = select_prefill(view, running, self.allocator.free_count, self.cfg, min_size)
        chosen = [self.waiting.popleft() for _ in range(n)]
        self._set_queue_metric()
        for e in chosen:
            e.blocks = self.allocator.allocate(blocks_needed(len(e.req.input_ids), e.req.stopping.max_new_tokens,
                                                             self.cfg))
            e.started = now
            e.sent = 1
        return chosen

    def _make_prefill(self, chosen: list[Entry]) -> tuple[int, Call]:
        """Make the prefill call now; returns its batch id and the call, whose answer gives the running ids."""
        requests = []
        for e in chosen:
            s = e.req.sampling
            requests.append(pb.Request(
                id=e.id, input_ids=e.req.input_ids, top_n_tokens=e.req.top_n_tokens, blocks=e.blocks,
                prefill_logprobs=e.req.decoder_input_details, images=e.req.images,
                parameters=pb.NextTokenChooserParameters(
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
                    do_sample=s.do_sample, seed=s.seed, repetition_penalty=s.repetition_penalty,
                    frequency_penalty=s.frequency_penalty, generated_frequency_penalty=s.generated_frequency_penalty, presence_penalty=s.presence_penalty, watermark=s.watermark),
            ))
        batch_id = next(self._batch_ids)
        rpc = asyncio.ensure_future(self.client.prefill(pb.Batch(id=batch_id, requests=requests)))
        return batch_id, Call(rpc, self._answer_prefill(chosen, rpc, time.monotonic()))

    async def _answer_prefill(self, chosen: list[Entry], call: Awaitable[pb.PrefillResponse],
                              made: float) -> list[int]:
        try:
            resp = await call
        except ShardError as e:
            for entry in chosen:
                self._finish_with_error(entry, GenerationError(str(e)))
            raise
        self._observe_batch("prefill", time.monotonic() - made, resp.forward_ns, len(chosen))
        self._set_unwarmed(resp.unwarmed_shapes)
        for p in resp.generations.prefill:
            if p.request_id in self.entries:
                self._set_prefill_tokens(self.entries[p.request_id], p.logprobs)
        return self._stream_tokens(resp.generations)

    async def _join(self, running: int, waiting_steps: int,
                    inflight: deque[Call]) -> tuple[bool, pb.CachedBatch | None]:
        """Prefill the waiting requests that may join `running` decodes now.

        Returns whether a prefill was made, and the batch the next decode call should add. The
        prefill's answer is awaited in `inflight`'s order, so the decode naming its batch is made at
        once and the shards go straight from one to the other.
        """
        oldest = (time.monotonic() - self.waiting[0].enqueued) * 1000
        chosen = self._take_waiting(running, join_min_size(running, waiting_steps, oldest, self.cfg))
        if not chosen:
            return False, None
        batch_id, call = self._make_prefill(chosen)
        if any(e.req.images for e in chosen):
            # The shards may refuse a prompt's images: see the answer before a decode names the batch.
            # The calls made before it are handled first, to keep each request's tokens in order.
            while inflight:
                await inflight.popleft().handled()
            running_ids = await call.handled()
        else:
            inflight.append(call)
            running_ids = [e.id for e in chosen if self._sendable(e.id)]
        if not running_ids:
            inflight.append(Call(asyncio.ensure_future(self.client.clear(batch_id))))
            return True, None
        return True, pb.CachedBatch(id=batch_id, request_ids=running_ids)

    async def _decode(self, batches: list[pb.CachedBatch], call: Awaitable[pb.DecodeResponse], made: float) -> None:
        """Stream the tokens of a decode call when it answers."""
        try:
            resp = await call
        except ShardError as e:
            for b in batches:
                for rid in b.request_ids:
                    if rid in self.entries:
                        self._finish_with_error(self.entries[rid], GenerationError(str(e)))
            raise
        # A queued call's time starts when the shards could take it: when the one before it answered.
        now = time.monotonic()
        self._observe_batch("decode", now - max(made, self._last_answer), resp.forward_ns,
                            len(resp.batch.request_ids))
        self._last_answer = now
        self._set_unwarmed(resp.unwarmed_shapes)
        self._stream_tokens(resp.generations)
        for gens in resp.next_steps:
            self._stream_tokens(gens)

    def _stream_tokens(self, gens: pb.Generations) -> list[int]:
        """Stream each request's new token; returns the requests still running."""
        running = []
        top_n = gens.top_n
        for i, rid in enumerate(gens.request_ids):
            e = self.entries.get(rid)
            if e is None or e.finished:  # finished in an earlier step, or failed: the token is dropped
                continue
            if e.cancelled:
                e.finished = True
                self._release(e)
                continue
            self._on_token(e, gens.token_ids[i], gens.logprobs[i],
                           gens.top_ids[i * top_n:(i + 1) * top_n] if top_n else (),
                           gens.top_logprobs[i * top_n:(i + 1) * top_n] if top_n else ())
            if not e.finished:
                running.append(rid)
        return running

    def _on_token(self, e: Entry, token_id: int, logprob: float, top_ids, top_lps) -> None:
        e.generated += 1
        stopping = e.req.stopping
        special = token_id in self.special_ids
        if special:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        else:
            text = e.detok.add(token_id)
        finish = None
        if token_id in self.eos_ids and not stopping.ignore_eos_token:
            finish = FinishReason.EOS_TOKEN
        elif e.generated >= stopping.max_new_tokens:
            finish = FinishReason.LENGTH
        elif stopping.stop_sequences and e.stop.check(e.detok.text):
            finish = FinishReason.STOP_SEQUENCE
        top = [Token(t, self.tokenizer.decode([t], skip_special_tokens=False), lp, t in self.special_ids)
               for t, lp in zip(top_ids, top_lps)]
        end = None
        if finish is not None:
            if not special:
                text += e.detok.flush()
            now = time.monotonic()
            end = GenerationEnd(
                finish_reason=finish, generated_text=e.detok.text, generated_tokens=e.generated,
                seed=e.req.sampling.seed if e.req.sampling.do_sample else None, prefill=e.prefill,
                queue_time=e.started - e.enqueued, inference_time=now - e.started,
            )
            e.finished = True
            self._release(e)
        e.events.put_nowait(StreamEvent(Token(token_id, text, logprob, special), top, end))

    def _set_prefill_tokens(self, e: Entry, logprobs) -> None:
        ids = e.req.input_ids
        e.prefill = [Token(t, self.tokenizer.decode([t], skip_special_tokens=False), lp, t in self.special_ids)
                     for t, lp in zip(ids, logprobs)]

    def _finish_with_error(self, e: Entry, err: Exception) -> None:
        if e.finished:
            return
        e.finished = True
        self._release(e)
        e.events.put_nowait(err)

    def _release(self, e: Entry) -> None:
        if e.blocks:
            self.allocator.free(e.blocks)
            e.blocks = []
        self.entries.pop(e.id, None)

    # ---- metrics -------------------------------------------------------

    def _set_queue_metric(self) -> None:
        if self.metrics is not None:
            self.metrics.tgi_queue_size.set(len(self.waiting))

    def _set_unwarmed(self, count: int) -> None:
        if count > self.unwarmed_shapes and self.metrics is not None:
            self.metrics.gaudi_serve_unwarmed_shapes_total.inc(count - self.unwarmed_shapes)
        self.unwarmed_shapes = count

    def _set_batch_metric(self, n: int) -> None:
        if self.metrics is not None:
            self.metrics.tgi_batch_current_size.set(n)

    def _observe_batch(self, method: str, seconds: float, forward_ns: int, size: int) -> None:
        m = self.metrics
        if m is None:
            return
        m.tgi_batch_inference_count.labels(method=method).inc()
        m.tgi_batch_inference_success.labels(method=method).inc()
        m.tgi_batch_inference_duration.labels(method=method).observe(seconds)
        m.tgi_batch_forward_duration.labels(method=method).observe(forward_ns / 1e9)
        if method == "prefill":
            m.tgi_batch_next_size.observe(size)
