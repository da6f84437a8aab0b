"""gRPC servicer of one shard: turns protocol messages into ModelRunner calls."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from gaudi_runtime.adapters import AdapterError
from gaudi_runtime.device.cpu_threads import AdaptiveThreads
from gaudi_runtime.models.lora import read_new_adapter, write_adapter
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
from gaudi_runtime.shard.call_order import CallOrder
from gaudi_runtime.shard.grammar import GrammarError
from gaudi_runtime.shard.info import info_response
from gaudi_runtime.shard.kv_tiers import make_tiers
from gaudi_runtime.shard.runner import ModelRunner, PrefillInput, StepResult, WarmupError
from gaudi_runtime.shard.speculation import SpecStats
from gaudi_runtime.shard.warmup import spaced

log = logging.getLogger(__name__)


def to_params(p: pb.NextTokenChooserParameters) -> SamplingParameters:
    return SamplingParameters(
        do_sample=p.do_sample, temperature=p.temperature or 1.0, top_k=p.top_k, top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0, repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty, generated_frequency_penalty=p.generated_frequency_penalty,
        presence_penalty=p.presence_penalty, seed=p.seed,
    )


def to_generations(step: StepResult, rank: int) -> pb.Generations:
    """Rank 0 answers with the tokens; the other ranks send an empty message."""
    if rank != 0:
        return pb.Generations()
    n = len(step.request_ids)
    s = step.sample
    g = pb.Generations(
        request_ids=step.request_ids,
        token_ids=s.next_ids[:n].tolist(),
        logprobs=s.logprobs[:n].tolist(),
    )
    if s.top_ids is not None:
        g.top_n = s.top_ids.shape[1]
        g.top_ids.extend(s.top_ids[:n].flatten().tolist())
        g.top_logprobs.extend(s.top_logprobs[:n].flatten().tolist())
    for rid, lps in step.prefill_logprobs.items():
        g.prefill.append(pb.PrefillLogprobs(request_id=rid, logprobs=lps))
    return g


def spec_fields(stats: list[SpecStats]) -> dict:
    """A decode call's speculation counts, summed over its steps (none: the fields stay unset)."""
    if not stats:
        return {}
    return {"spec_drafts": sum(s.drafts for s in stats), "spec_draft_tokens": sum(s.draft_tokens for s in stats),
            "spec_accepted_tokens": sum(s.accepted for s in stats),
            "spec_accepted_per_pos": [sum(p) for p in zip(*(s.accepted_per_pos for s in stats))]}


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, runner: ModelRunner, rank: int, world_size: int,
                 threads: AdaptiveThreads | None = None):
        self.runner = runner
        self.threads = threads  # a CPU shard's, adjusted before each pass
        self.rank = rank
        self.world_size = world_size
        self.order = CallOrder()
        # Grammars compile one at a time beside the serving loop; one that takes too long is given up
        # by the router (--grammar-compile-timeout-s), and later ones queue behind it.
        self.compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.tiers = make_tiers(runner, rank, world_size)  # the KV cache's host and disk tiers; None: none
        self.disk_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-reader")

    def close(self, timeout_s: float) -> None:
        """Finish the disk tier's queued block writes before the process ends: they are what a restarted
        server reads back (its writer thread is a daemon, which the interpreter would stop mid-queue)."""
        disk = self.tiers.disk if self.tiers is not None else None
        if disk is not None and not disk.flush(timeout_s):
            log.warning("KV disk tier: writes still queued after %.0f s at shutdown; the rest are dropped", timeout_s)

    async def Info(self, request, context):
        return info_response(self.runner, self.world_size, self.tiers)

    async def FetchBlocks(self, request, context):
        """Disk blocks into staging memory, beside the forward passes (a thread reads and checks them)."""
        if self.tiers is None:
            return pb.FetchBlocksResponse()
        t0 = time.perf_counter_ns()
        loaded, corrupt, size = await asyncio.get_running_loop().run_in_executor(
            self.disk_reader, self.tiers.fetch, [bytes(h) for h in request.hashes], [bytes(h) for h in request.discard])
        return pb.FetchBlocksResponse(loaded=loaded, corrupt=corrupt, read_ns=time.perf_counter_ns() - t0, bytes=size)

    async def Health(self, request, context):
        return pb.HealthResponse()

    async def ClearCache(self, request, context):
        async with self.order.turn(request.sequence):
            self.runner.clear(request.batch_id if request.HasField("batch_id") else None)
        return pb.ClearCacheResponse()

    async def Warmup(self, request, context):
        try:
            for done, total, phase in spaced(self.runner.warmup()):
                yield pb.WarmupProgress(done=done, total=total, phase=phase)
        except WarmupError as e:
            log.error("%s", e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def Prefill(self, request, context):
        reqs = _prefill_inputs(request.batch)
        async with self.order.turn(request.sequence):
            self._adjust_threads()
            copy_ns = self._before_prefill(request)
            try:
                step = self.runner.prefill(request.batch.id, reqs)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self._prefill_response(request, step, copy_ns)

    def _before_prefill(self, request: pb.PrefillRequest) -> int:
        """Forget the grammars the prefill names and make its tier copies; -> the copies' time (ns)."""
        if request.forget_grammars and self.runner.grammars is not None:
            self.runner.grammars.forget(request.forget_grammars)
        return self.tiers.apply(request.kv_copies) if self.tiers is not None and request.kv_copies else 0

    def _prefill_response(self, request: pb.PrefillRequest, step: StepResult, copy_ns: int) -> pb.PrefillResponse:
        disk = self.tiers.disk if self.tiers is not None else None
        return pb.PrefillResponse(
            generations=to_generations(step, self.rank),
            batch=pb.CachedBatch(id=request.batch.id, request_ids=step.request_ids),
            forward_ns=step.forward_ns,
            unwarmed_shapes=self.runner.unwarmed_shapes, kv_copy_ns=copy_ns,
            kv_disk_writes=disk.writes if disk else 0, kv_disk_write_failures=disk.write_failures if disk else 0,
        )

    async def Decode(self, request, context):
        cached = [(b.id, list(b.request_ids)) for b in request.batches]
        ride = request.ride if request.HasField("ride") else None
        answer = {}
        async with self.order.turn(request.sequence):
            self._adjust_threads()
            try:
                if ride is None:
                    batch_id, step = self.runner.decode(cached)
                else:
                    copy_ns = self._before_prefill(ride)
                    batch_id, step, ride_step, shared = self.runner.decode_with(cached, ride.batch.id,
                                                                                _prefill_inputs(ride.batch))
                    answer = {"ride": self._prefill_response(ride, ride_step, copy_ns), "ride_in_step": shared}
                steps = [step]
                for _ in range(1, request.steps):
                    batch_id, step = self.runner.decode([(batch_id, step.rows())])
                    steps.append(step)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DecodeResponse(
            generations=to_generations(steps[0], self.rank),
            next_steps=[to_generations(s, self.rank) for s in steps[1:]],
            batch=pb.CachedBatch(id=batch_id, request_ids=step.rows()),
            forward_ns=sum(s.forward_ns for s in steps),
            unwarmed_shapes=self.runner.unwarmed_shapes,
            **spec_fields([s.spec for s in steps if s.spec is not None]), **answer,
        )

    async def LoadAdapter(self, request, context):
        """Take the adapter from its host copy, or read and check it beside the serving loop (then keep a
        copy), then write its slot in call order (the turn is taken even when the adapter is refused:
        later calls wait for this number)."""
        t0 = time.perf_counter_ns()
        runner, cache = self.runner, self.runner.host_adapters
        parts, error = cache.get(request.load_id), None
        hit = parts is not None
        if not hit:
            try:
                parts = await asyncio.get_running_loop().run_in_executor(
                    None, read_new_adapter, runner.model, runner.cfg.adapters, runner.model_dir, request.name,
                    request.path)
                cache.put(request.load_id, parts)
            except (AdapterError, OSError, ValueError) as e:
                error = str(e)
        async with self.order.turn(request.sequence):
            if parts is not None and not 0 < request.slot <= runner.cfg.adapters.max_loras:
                error = f"adapter slot {request.slot}: this shard has slots 1..{runner.cfg.adapters.max_loras}"
            elif parts is not None:
                write_adapter(runner.model, request.slot, parts)
                runner.backend.mark_step()  # the writes reach the device before the next step reads them
        if error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        log.info("LoRA adapter %r (load %d) written into slot %d %s; host copies: %d hits, %d reads",
                 request.name, request.load_id, request.slot, "from its host copy" if hit else f"read from {request.path}",
                 cache.hits, cache.reads)
        return pb.LoadAdapterResponse(load_ns=time.perf_counter_ns() - t0, host_hit=hit)

    def _adjust_threads(self) -> None:
        if self.threads is not None:
            self.threads.adjust()

    async def CompileGrammar(self, request, context):
        grammars = self.runner.grammars
        if grammars is None:
            return pb.CompileGrammarResponse(error="grammar is not supported")
        if grammars.cached(request.id):  # asked again after the router stopped waiting: it finished since
            return pb.CompileGrammarResponse()
        try:
            compiled = await asyncio.get_running_loop().run_in_executor(
                self.compiler, grammars.compile, request.id, request.type, request.value)
        except GrammarError as e:
            return pb.CompileGrammarResponse(error=str(e))
        return pb.CompileGrammarResponse(compile_ns=compiled.compile_ns)


def _prefill_inputs(batch: pb.Batch) -> list[PrefillInput]:
    return [
        PrefillInput(id=r.id, input_ids=list(r.input_ids), params=to_params(r.parameters),
                     top_n_tokens=r.top_n_tokens, blocks=list(r.blocks), prefill_logprobs=r.prefill_logprobs,
                     images=list(r.images), cached_tokens=r.cached_tokens, adapter=r.adapter_index,
                     max_new_tokens=r.max_new_tokens, sequence_tokens=r.sequence_tokens,
                     grammar=r.grammar.id if r.HasField("grammar") else None,
                     thinking=_thinking(r))
        for r in batch.requests
    ]


def _thinking(r) -> tuple[int, int, bool] | None:
    """A reasoning model's thinking tokens, for the gate in front of its grammar (None: no gate)."""
    if not r.HasField("grammar") or not r.grammar.HasField("thinking"):
        return None
    t = r.grammar.thinking
    return t.start_token, t.end_token, t.open
