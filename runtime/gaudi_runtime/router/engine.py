"""The engine the HTTP layer calls (`router.types.Engine`): its life cycle and each request's stream.

`start` connects to the shards, reads their info, warms them up, then runs the batching loop
(router/batching.py) in a task. A failure on the way, or later in the loop, marks the engine
failed: every request ends with a GenerationError and the router process exits on `failed`.
`generate_groups` queues a request (router/live_requests.py) and yields the events the output processor
(router/output.py) puts on its queue, all those queued by the time it reads at once (`generate`
yields them one by one); a caller that stops reading early cancels the request.
"""

from __future__ import annotations

import asyncio
import logging

from gaudi_runtime import kv_files, progress
from gaudi_runtime.config import Config
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router import shard_info
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.batching import BatchingLoop
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.grammar_check import ShardGrammars, check_grammars
from gaudi_runtime.router.grammar_table import GrammarTable
from gaudi_runtime.router.kv_events import AllBlocksCleared, make_kv_events
from gaudi_runtime.router.kv_tiers import INFO_COUNTS, KvTiers, tier_sizes
from gaudi_runtime.router.live_requests import Requests
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.output import OutputProcessor
from gaudi_runtime.router.types import GenerationError, OverloadedError, ValidRequest

log = logging.getLogger(__name__)


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

    def __init__(self, cfg: Config, client: ShardClient, tokenizer, metrics: Metrics | None = None):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = EngineMetrics(metrics)
        self.state = "loading"  # loading | warming_up | ready | failed
        self.failure = ""
        self.failed = asyncio.Event()  # set by fail(): the router process exits non-zero on it
        self.warmup_progress = {"done": 0, "total": 0, "phase": "prefill"}
        self.shard_info: pb.InfoResponse | None = None
        self.in_flight = 0  # generate() iterators open (--max-concurrent-requests)
        self.adapters = AdapterTable(cfg.adapters, cfg.model)  # the LoRA adapters served now (router/adapters.py)
        grammar_table = GrammarTable()  # the grammars the shards keep compiled, held by live requests
        self.requests = Requests(cfg, self.metrics, self.adapters, grammar_table)
        self.kv_events = self.requests.prefix.events = make_kv_events(cfg.scheduling.kv_events_config)
        self.output = OutputProcessor(tokenizer, self.requests)
        structured = cfg.structured_output
        self.grammars = None if structured.disable_grammar_support else \
            ShardGrammars(client, structured.grammar_compile_timeout_s, grammar_table)
        self.batching = BatchingLoop(cfg, client, self.requests, self.output, self.metrics)
        self._task: asyncio.Task | None = None

    # ---- life cycle ----------------------------------------------------

    async def start(self, connect_timeout_s: float = 3600.0, alive=lambda: True) -> None:
        """Connect, read the shards' info, warm up, then serve. Failures mark the engine failed."""
        try:
            await self.client.connect(connect_timeout_s, alive)
            info = await self.client.info()
            check_context_fits(self.cfg.limits.max_total_tokens, info.max_position_embeddings)
            self.shard_info = info
            self.warmup_progress["from_cache"] = shard_info.warmup_from_cache(info)
            self.requests.allocator = BlockAllocator(info.num_blocks, on_removed=self.requests.prefix.removed,
                                                     on_evicted=self._evicted)
            self.output.eos_ids = set(info.eos_token_ids)
            self.state = "warming_up"
            progress.report("warming_up")
            await self.client.warmup(self._on_warmup)
            self.shard_info = await self.client.info()
            self.state = "ready"
            progress.report(progress.READY)  # the launcher's watchdog stands down
            self.metrics.serving = True
            self.metrics.cache_config(info.block_size, info.num_blocks, self.cfg)
            self.requests.report_load()  # the load gauges appear, at zero
            self._cache_cleared()  # whatever a picker knew of an earlier process at this address is gone
            await self._start_tiers(info)
            log.info("ready: %d KV blocks of %d tokens", info.num_blocks, info.block_size)
        except (ShardError, OSError, ValueError) as e:
            self.fail(str(e))
            raise
        self._task = asyncio.create_task(self._serve(), name="batching-loop")

    async def _start_tiers(self, info: pb.InfoResponse) -> None:
        """The host and disk tiers the shards hold (--kv-offloading-size); a disk tier is listed, so that a
        restarted server finds the blocks an earlier one wrote (router/kv_tiers.py)."""
        if not info.HasField("kv_tiers"):
            return
        t, sched = info.kv_tiers, self.cfg.scheduling
        _, disk = tier_sizes(sched.kv_offloading_size, sched.kv_offloading_disk_size, t.block_bytes, info.world_size)
        tiers = KvTiers(t.host_slots, t.block_bytes, info.world_size, self.metrics, disk if t.disk_dir else None,
                        info.block_size)
        tiers.events = self.kv_events
        self.requests.prefix.tiers = tiers
        if t.disk_dir:
            found = await asyncio.to_thread(kv_files.list_complete, t.disk_dir, info.world_size)
            tiers.found_on_disk([h for _, h in found])
            log.info("KV disk tier %s: %d blocks found", t.disk_dir, len(found))
        tiers.report()

    def _evicted(self, block: int, block_hash: bytes) -> None:
        if self.requests.prefix.tiers is not None:
            self.requests.prefix.tiers.evicted(block, block_hash)

    def _on_warmup(self, done: int, total: int, phase: str) -> None:
        self.warmup_progress.update(done=done, total=total, phase=phase)
        progress.report(phase, done, total)  # a step of the start (progress.py's stall rule)
        self.metrics.warmup(done, total)

    async def _serve(self) -> None:
        try:
            await self.batching.run()
        except asyncio.CancelledError:
            raise
        except ShardError as e:
            self.fail(str(e))
        except Exception as e:  # noqa: BLE001 - a bug in the loop must not leave requests hanging
            log.exception("batching loop crashed")
            self.fail(f"internal error: {e}")

    def fail(self, why: str) -> None:
        log.error("engine failed: %s", why)
        self.state, self.failure = "failed", why
        self.failed.set()
        self.requests.end_all(GenerationError(why))
        self._cache_cleared()  # the shards' KV cache is gone with them

    def _cache_cleared(self) -> None:
        if self.kv_events is not None:
            self.kv_events.add(AllBlocksCleared())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.client.close()
        if self.kv_events is not None:
            self.kv_events.flush()
            await asyncio.to_thread(self.kv_events.publisher.close)  # sends what is queued, for up to a second

    # ---- Engine protocol -----------------------------------------------

    def health(self) -> tuple[bool, dict]:
        if self.state == "ready":
            # Where this pod's start went, for the operator (which reads /health, open even with an API key).
            # The finished warmup stays in the answer: until the kubelet's readiness probe passes, the
            # operator still sees a warming pod, one that is done, not one back to loading.
            info = self.shard_info
            return True, {"status": "ok", "warmup": dict(self.warmup_progress),
                          "startup_seconds": shard_info.startup_seconds(info) if info is not None else None,
                          "warmup_from_cache": shard_info.warmup_from_cache(info) if info is not None else None}
        if self.state == "warming_up":
            return False, {"status": "warming_up", "warmup": dict(self.warmup_progress)}
        if self.state == "failed":
            return False, {"status": "failed", "error": self.failure}
        return False, {"status": "loading"}

    async def check_grammars(self, requests: list[ValidRequest]) -> None:
        await check_grammars(self.grammars, requests)

    def queue_size(self) -> int:
        return len(self.requests.waiting)

    def info(self) -> dict:
        info = {"state": self.state, "unwarmed_shapes": self.metrics.unwarmed_shapes,
                "prefix_caching": self.cfg.scheduling.prefix_caching,
                "batch_invariant": self.cfg.device.batch_invariant}
        if self.shard_info is not None:
            s = self.shard_info
            info.update({
                "model_dtype": s.dtype, "model_device_type": s.device_type, "num_shard": s.world_size,
                "block_size": s.block_size, "kv_blocks": s.num_blocks,
                "max_batch_total_tokens": s.num_blocks * s.block_size,
                "max_batch_size": self.cfg.scheduling.max_batch_size,
                "max_batch_prefill_tokens": self.cfg.scheduling.max_batch_prefill_tokens,
                "max_waiting_tokens": self.cfg.scheduling.max_waiting_tokens,
                "waiting_served_ratio": self.cfg.scheduling.waiting_served_ratio,
            })
            info.update(shard_info.details(s))
        if self.requests.allocator is not None:
            info["kv_blocks_free"] = self.requests.allocator.free_count  # cached blocks no request holds count
            info["kv_blocks_cached"] = self.requests.allocator.cached_count
            info["prefix_cache_queries"] = self.metrics.prefix_queries
            info["prefix_cache_hits"] = self.metrics.prefix_hits
            info["prefill_chunks"] = self.metrics.prefill_chunks
            info["prefill_chunks_in_step"] = self.metrics.prefill_chunks_in_step
        if self.requests.prefix.tiers is not None:
            info["kv_offloading"] = self._tiers_info()
        return info

    def _tiers_info(self) -> dict:
        """The KV tiers below the device: sizes, where the disk tier is, what each holds and has served."""
        tiers, sched = self.requests.prefix.tiers, self.cfg.scheduling
        out = {"host_size_gib": sched.kv_offloading_size, "host_blocks": tiers.host.capacity,
               "block_bytes": tiers.block_bytes, "disk_path": sched.kv_offloading_disk_path,
               "disk_size_gib": sched.kv_offloading_disk_size,
               "disk_dir": self.shard_info.kv_tiers.disk_dir or None if self.shard_info is not None else None,
               "disk_blocks": tiers.disk.capacity if tiers.disk is not None else 0}
        counts = {k: 0 for k in INFO_COUNTS} | self.metrics.kv_offload
        out.update({k: int(v) if float(v).is_integer() else v for k, v in counts.items()})
        return out

    async def generate_groups(self, request: ValidRequest):
        # Checked at admission as a rule; compiled again here if forgotten since (or never checked).
        grammar_id = 0 if request.grammar is None or self.grammars is None else \
            await self.grammars.compiled_id(request.grammar)
        if self.state == "failed":
            raise GenerationError(f"the shards failed: {self.failure}")
        if self.in_flight >= self.cfg.limits.max_concurrent_requests:
            raise OverloadedError("Model is overloaded")
        if not self.adapters.current(request.adapter, request.adapter_load):
            # Unloaded (or reloaded) between its validation and now: its slot may hold another adapter.
            raise ValidationError(f"the LoRA adapter {self.adapters.name(request.adapter)!r} was unloaded "
                                  "before the request started")
        state = self.requests.add(request, self.tokenizer, grammar_id)  # no await since: it holds the grammar
        self.in_flight += 1
        self.batching.wake()
        try:
            while True:
                group = await _ready(state.events)
                last = group[-1]
                if isinstance(last, Exception):
                    if len(group) > 1:
                        yield group[:-1]
                    raise last
                yield group
                if last.end is not None:
                    return
        finally:
            self.in_flight -= 1
            if not state.ended:  # the caller stopped reading first: the request is cancelled
                self.requests.end(state)
                self.batching.wake()

    async def generate(self, request: ValidRequest):
        """One StreamEvent at a time (the offline LLM, benchmarks)."""
        groups = self.generate_groups(request)
        try:
            async for group in groups:
                for ev in group:
                    yield ev
        finally:
            await groups.aclose()


async def _ready(events: asyncio.Queue) -> list:
    """Every item on the queue, once there is one: the tokens of one answer (several steps, several
    pipelined calls) are queued together, and their stream writes them at once."""
    group = [await events.get()]
    while not events.empty():
        group.append(events.get_nowait())
    return group
