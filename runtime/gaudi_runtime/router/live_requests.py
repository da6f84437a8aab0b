"""Every request the engine holds, from admission to its end, and the one place a request ends.

A request waits in `Requests.waiting` until a prefill takes it and reserves its KV blocks, and is
live until `Requests.end`. Every way a request ends goes through `end`: finished (EOS, its token
budget, a stop sequence: the output processor), cancelled (its caller stopped reading: the
engine's `generate`), failed (the shards failed: the batching loop, or the engine for all). `end`
gives the blocks back (and releases the grammar it holds on the shards) exactly once and delivers the
request's last event or error.

The blocks go back at once, even while a call already made still names the request: the prefill
of a request that takes them over is made later, so the shards run it after that call (see
router/batching.py). Ended requests are no longer live, so no later call names them and their
stale tokens are dropped. With prefix caching, a request may start with blocks another request
filled, and leaves its own full blocks cached for later ones (router/prefix_cache.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from gaudi_runtime.config import Config
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.grammar_table import GrammarTable
from gaudi_runtime.router.prefix_cache import PrefixCache
from gaudi_runtime.router.scheduler import Waiting, blocks_needed, chunk_end
from gaudi_runtime.router.types import StreamEvent, Token, ValidRequest


def chunkable(req: ValidRequest) -> bool:
    """Whether a long prompt may be prefilled in chunks: not one with images (a chunk must not cut an
    image's tokens) nor one that wants its prompt's log-probabilities (each chunk would lack the next
    chunk's first token)."""
    return not req.images and not req.decoder_input_details


@dataclass(eq=False)
class RequestState:
    """What the engine keeps about one request while it waits, runs and streams."""

    id: int
    req: ValidRequest
    detok: IncrementalDetokenizer
    stop: StopSequenceMatcher
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # StreamEvents; an exception ends them
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None  # when a prefill took it; None while it waits
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens its first blocks held already when it was taken (prefix cache)
    prefilled: int = 0  # prompt tokens whose prefill calls are made (a prompt prefilled in chunks: so far)
    block_hashes: list[bytes] | None = None  # of its prompt's full blocks, once computed
    output_ids: list[int] = field(default_factory=list)  # tokens streamed
    generated: int = 0  # tokens streamed
    sent: int = 0  # tokens asked of the shards so far (prefill and decode calls made, answered or not)
    answered: int = 0  # of those, the ones whose calls' answers were handled (a step: one, however many tokens)
    prefill_pending: bool = False  # its (last) prefill call is not answered yet
    rotated_long: bool = False  # prefilled again, prompt and answer, past LongRoPE's original length
    prefill: list[Token] = field(default_factory=list)  # prompt tokens with logprobs (decoder_input_details)
    ended: bool = False
    disk_fetch: str = ""  # its blocks on the disk tier: "" not asked, "wanted", "running", "done"
    disk_hashes: list[bytes] = field(default_factory=list)  # those it waits for while "wanted" or "running"
    grammar_id: int = 0  # the compiled grammar it holds on the shards (router/grammar_table.py); 0: none
    device_slot: int = 0  # the shards' slot its adapter is in while it runs (router/adapter_slots.py); 0: none


class Requests:
    """The waiting queue, the live requests and the KV blocks they hold."""

    def __init__(self, cfg: Config, metrics: EngineMetrics, adapters: AdapterTable | None = None,
                 grammars: GrammarTable | None = None):
        self.cfg = cfg
        self.metrics = metrics
        self.adapters = adapters or AdapterTable(cfg.adapters, cfg.model)
        self.grammars = grammars if grammars is not None else GrammarTable()
        self.waiting: deque[RequestState] = deque()
        self.allocator: BlockAllocator | None = None  # set once the shards said how many blocks they hold
        self.prefix = PrefixCache(cfg, metrics, self.adapters)
        self._live: dict[int, RequestState] = {}
        self._ids = itertools.count(1)

    def add(self, request: ValidRequest, tokenizer, grammar_id: int = 0) -> RequestState:
        """Queue a request; its text is decoded with `tokenizer`. `grammar_id`: its grammar's, which it
        holds on the shards until it ends."""
        state = RequestState(id=next(self._ids), req=request,
                             detok=IncrementalDetokenizer(tokenizer, prompt_ids=request.input_ids),
                             stop=StopSequenceMatcher(list(request.stopping.stop_sequences)), grammar_id=grammar_id)
        if grammar_id:
            self.grammars.hold(grammar_id)
        self._live[state.id] = state
        self.waiting.append(state)
        if request.adapter:
            self.metrics.lora_request(self.adapters.name(request.adapter))
        self.report_load()
        return state

    def get(self, request_id: int) -> RequestState | None:
        """The live request of that id; None once it ended."""
        return self._live.get(request_id)

    def waiting_view(self, limit: int) -> list[Waiting]:
        """What the admission rules see of the first `limit` waiting requests, up to the first one whose
        blocks are being read from the disk tier (`fetches` lists those to read): in order, as always."""
        view = []
        for state in itertools.islice(self.waiting, limit):
            if self._waits_for_disk(state):
                break
            cached, held = self.prefix.waiting_view(self.allocator, state)
            view.append(Waiting(len(state.req.input_ids), state.req.stopping.max_new_tokens, cached, held,
                                chunkable(state.req), state.req.adapter))
        return view

    def _waits_for_disk(self, state: RequestState) -> bool:
        if state.disk_fetch == "":
            state.disk_hashes = self.prefix.wanted_on_disk(self.allocator, state)
            state.disk_fetch = "wanted" if state.disk_hashes else "done"
        return state.disk_fetch in ("wanted", "running")

    def fetches(self) -> list[RequestState]:
        """Waiting requests whose disk blocks are wanted and not being read yet (marked as being read)."""
        out = [s for s in self.waiting if s.disk_fetch == "wanted"]
        for state in out:
            state.disk_fetch = "running"
        return out

    def busy_adapters(self) -> set[int]:
        """The adapter indices of every live request, waiting or running: none of them may be reused."""
        return {s.req.adapter for s in self._live.values()}

    def running_adapters(self) -> frozenset[int]:
        """The adapter indices of the requests taken for a prefill and not ended (0: the base model)."""
        return frozenset(s.req.adapter for s in self._live.values() if s.started is not None)

    def pinned_slots(self) -> set[int]:
        """The device slots the requests taken for a prefill and not ended run with: none may be rewritten."""
        return {s.device_slot for s in self._live.values() if s.started is not None and s.device_slot}

    def take(self, count: int) -> list[RequestState]:
        """Move the first `count` waiting requests into a prefill, reserving their KV blocks: the
        cached blocks each starts with (held before any is evicted for another's fresh ones), then
        fresh ones."""
        now = time.monotonic()
        chosen = [self.waiting.popleft() for _ in range(count)]
        for state in chosen:
            self.prefix.hold_hits(self.allocator, state)
        for state in chosen:
            stopping = state.req.stopping
            self.prefix.fill(self.allocator, state,
                             blocks_needed(len(state.req.input_ids), stopping.max_new_tokens, self.cfg))
            state.prefilled = state.cached_tokens
            self.prefill_made(state, self.next_prefill_end(state))
            state.started = now
            state.sent, state.prefill_pending = 1, True  # the prefill computes the first token
        if self.prefix.tiers is not None:
            self.prefix.tiers.admitted()
        self.report_load()
        return chosen

    def next_prefill_end(self, state: RequestState) -> int:
        """Where the next prefill of `state`'s prompt ends: the prompt's end, or its next chunk's."""
        n = len(state.req.input_ids)
        return chunk_end(state.prefilled, n, self.cfg) if chunkable(state.req) else n

    def prefill_made(self, state: RequestState, end: int) -> None:
        """A prefill of `state`'s prompt up to `end` is being made: its full blocks may serve others."""
        self.prefix.register_prompt(self.allocator, state, state.prefilled, end)
        state.prefilled = end

    def requeue(self, states: list[RequestState]) -> None:
        """Put taken requests whose prefill was not made back at the head of the queue, in order; their
        blocks go back, and the ones they were to fill are forgotten (nothing was written)."""
        for state in reversed(states):
            self.prefix.release(self.allocator, state, failed=True)
            state.blocks, state.cached_tokens, state.prefilled, state.started, state.sent = [], 0, 0, None, 0
            state.device_slot = 0
            state.answered, state.prefill_pending = 0, False
            self.waiting.appendleft(state)
        self.report_load()

    def end(self, state: RequestState, last: StreamEvent | Exception | None = None) -> None:
        """End `state` for whatever reason; `last` (its final event, or the error its caller gets) is
        delivered. Ending an ended request does nothing."""
        if state.ended:
            return
        state.ended = True
        if state.blocks:
            self.prefix.release(self.allocator, state, failed=isinstance(last, Exception))
            state.blocks = []
        del self._live[state.id]
        if state.grammar_id:
            # As with the blocks: a call made from now on names it no more, and a forget rides a later prefill.
            self.grammars.release(state.grammar_id)
        if state.started is None:
            self.waiting.remove(state)
        self.report_load()
        if last is not None:
            state.events.put_nowait(last)

    def report_load(self) -> None:
        """The load now (waiting, running, fraction of the KV blocks reserved) to the metrics."""
        a = self.allocator
        kv_usage = 1 - a.free_count / a.num_blocks if a is not None and a.num_blocks else 0.0
        self.metrics.load(len(self.waiting), len(self._live) - len(self.waiting), kv_usage)
        if self.adapters.selects:
            self._report_adapters()

    def _report_adapters(self) -> None:
        waiting = {s.req.adapter for s in self.waiting}
        running = {s.req.adapter for s in self._live.values() if s.started is not None}
        self.metrics.lora_load(self.cfg.adapters.max_loras, [self.adapters.name(i) for i in sorted(running - {0})],
                               [self.adapters.name(i) for i in sorted(waiting - {0})])

    def end_all(self, error: Exception) -> None:
        """End every live request with `error` (the shards failed)."""
        for state in list(self._live.values()):
            self.end(state, error)
