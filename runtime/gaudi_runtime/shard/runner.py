"""The model on one shard: loads it, sizes its KV cache, and runs each step.

A step builds its inputs from the requests or the cached batch (`inputs.py`: padded to a bucket of
`gaudi_runtime.buckets`), runs one of the step functions (`steps.py`: what device graphs capture), and samples
(`step_sampling.py`); `warmup.py` runs every bucket's step once before serving. The only host-device
sync per step is reading the sampled tokens back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gaudi_runtime.config import Config
from gaudi_runtime.device.base import Backend
from gaudi_runtime.layers.attention import attention_in_use, use_attention
from gaudi_runtime.layers.kv_cache import allocate_cache, cache_bytes_per_block, model_token_shapes
from gaudi_runtime.models import load_model
from gaudi_runtime.quant.setup import kv_cache_dtype, quantize_loaded
from gaudi_runtime.recipe_cache import RecipeCache
from gaudi_runtime.shard import inputs
from gaudi_runtime.shard.adapter_cache import load_with_host_copies
from gaudi_runtime.shard.batch import ShardBatch
from gaudi_runtime.shard.grammar import GrammarCache
from gaudi_runtime.shard.inputs import PrefillInput
from gaudi_runtime.shard.memory import size_kv_cache, weight_bytes
from gaudi_runtime.shard.profiler import make_profiler
from gaudi_runtime.shard.prompt_images import context_embeds, load_processor
from gaudi_runtime.shard.sampling import SampleOutput
from gaudi_runtime.shard.speculation import SpecStats, draft_rows
from gaudi_runtime.shard.step_sampling import prefill_sampler, prompt_logprobs, sample, verify
from gaudi_runtime.shard.steps import StepFunctions
from gaudi_runtime.shard.warmup import Warmup, WarmupError

# What the servicer uses: requests in, results out, the error warmup ends with.
__all__ = ["ModelRunner", "PrefillInput", "StepResult", "WarmupError", "size_kv_cache", "weight_bytes"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    request_ids: list[int]  # one per token: a speculative step names a request once per token it gives
    sample: SampleOutput
    prefill_logprobs: dict[int, list[float]] = field(default_factory=dict)
    forward_ns: int = 0
    spec: SpecStats | None = None  # a speculative step's drafts

    def rows(self) -> list[int]:
        """The batch's requests, in order (each gave at least one token)."""
        return list(dict.fromkeys(self.request_ids)) if self.spec is not None else self.request_ids


class ModelRunner:
    def __init__(self, cfg: Config, model_dir: str, backend: Backend, rank: int = 0, world_size: int = 1,
                 process_group=None, recipe_cache: RecipeCache | None = None, download_seconds: float | None = None):
        """`recipe_cache`: where this shard's compiled graphs persist (Gaudi with --recipe-cache-dir);
        `download_seconds`: how long getting the model took before this process started (for info())."""
        self.cfg = cfg
        self.recipe_cache = recipe_cache
        self.download_seconds = download_seconds
        self.backend = backend
        self.device = device = backend.torch_device
        self.dtype = getattr(torch, cfg.model.dtype)
        t0 = time.perf_counter()
        dev = cfg.device
        attention = backend.attention(dev.use_flash_attention, dev.flash_attention_recompute, dev.cpu_paged_attention,
                                      dev.batch_invariant)
        rope = (cfg.model.rope_scaling, cfg.model.rope_factor) if cfg.model.rope_scaling else None  # --rope-scaling
        self.model = load_model(model_dir, self.dtype, device, rank, world_size, process_group, rope=rope)
        self.model_dir = model_dir
        self.adapter_rows, self.host_adapters = load_with_host_copies(self.model, cfg.adapters, model_dir)  # rows None: no adapters
        use_attention(self.model, attention)
        # FP8 (--quantize / QUANT_CONFIG) swaps layers after load; --kv-cache-dtype sets the cache's scales.
        self.model = quantize_loaded(self.model, cfg, backend, self.dtype, rank, world_size)
        self.kv_dtype = kv_cache_dtype(cfg.model, self.dtype)
        # A model whose attention is its own (DeepSeek's latent attention) names it; the backend's kernels are not used.
        self.long_rope = inputs.long_rope_of(self.model)  # LongRoPE's original length and table length
        self.attention_name = getattr(self.model, "attention_name", None) or attention_in_use(attention, self.kv_dtype)
        # Decode over the flat layout of the blocks in use (HPU, unless the math fallback keeps the gather).
        self.flat_decode = backend.flat_decode and attention.flat_decode is not None
        log.info("attention: %s (FLASH_ATTENTION_RECOMPUTE=%s)", self.attention_name, dev.flash_attention_recompute)
        m, self.rank, self.world_size = self.model, rank, world_size
        self.weight_bytes = weight_bytes(m)
        backend.prepare_model(m, cfg.device)
        token_shapes = model_token_shapes(m)  # what one token costs per layer: the model says (latent for MLA)
        per_block = cache_bytes_per_block(m.num_layers, dev.block_size, token_shapes, self.kv_dtype)
        free = backend.memory_info()
        self.num_blocks = size_kv_cache(cfg, per_block, free[0] if free else None)
        self.kv_cache = allocate_cache(m.num_layers, self.num_blocks, dev.block_size, token_shapes, self.kv_dtype,
                                       device)
        log.info("rank %d/%d holds %.1f MiB of weights", rank, world_size, self.weight_bytes / 2**20)
        self.load_seconds = time.perf_counter() - t0
        log.info("model loaded in %.1fs; KV cache: %d blocks of %d tokens (%.1f MiB)",
                 self.load_seconds, self.num_blocks - 1, dev.block_size, self.num_blocks * per_block / 2**20)
        self.batches: dict[int, ShardBatch] = {}
        # Grammars compiled against the model's vocabulary (xgrammar is loaded at the first grammar).
        self.grammars = None if cfg.structured_output.disable_grammar_support else \
            GrammarCache(model_dir, m.vocab_size, m.eos_token_ids)
        # Multimodal models (Llava) preprocess their prompt images here with the model's own processor.
        self.image_processor = load_processor(model_dir, m)
        self.warmup_summary: dict | None = None
        self.warmed: set[tuple] | None = None  # (kind, *shape) of every shape warmup ran; None until it ran
        self.unwarmed_shapes = 0  # forward passes on a shape warmup did not run
        self._unwarmed_seen: set[tuple] = set()
        self.steps = st = StepFunctions(m, self.kv_cache, self.adapter_rows, self.image_processor)
        self._decode_inputs = inputs.flat_decode_inputs if self.flat_decode else inputs.decode_inputs
        self._decode_fn = backend.graphed(st.flat_decode_step if self.flat_decode else st.decode_step, "decode")
        self._prefill_fn = st.prefill_step if dev.limit_hpu_graph else backend.graphed(st.prefill_step, "prefill")
        self._prefill_context_fn = st.prefill_context_step if dev.limit_hpu_graph else backend.graphed(
            st.prefill_context_step, "prefill_context")
        self._verify_fn = backend.graphed(st.verify_step, "verify")
        self.mixes = self._mixes()
        self.profiler = make_profiler(cfg.device, rank, backend.profiler_activity)  # PROF_*: None unless this rank profiles

    def _mixes(self) -> bool:
        """Whether a prefill may share a decode step's forward pass (`decode_with`): where steps run their own
        shapes and every layer's per-row state is the attention metadata's; not with adapters (their index is
        per row of the input), LongRoPE (its factor set per row), a model's own attention, or the
        batch-invariant mode (whose promise is per step kind)."""
        return not (self.backend.pads_to_buckets or self.adapter_rows is not None or self.long_rope[0] is not None
                    or getattr(self.model, "attention_name", None) or self.cfg.device.batch_invariant)

    # ---- prefill and decode --------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, reqs: list[PrefillInput]) -> StepResult:
        """Compute each prompt after its cached tokens (all of it when none are), keep the batch."""
        tables, sampler = self._prefill_setup(reqs)
        t0 = time.perf_counter_ns()
        hidden, logits, ids = self._forward_prefill(reqs, tables)
        self.backend.mark_step()
        prompt_lp = prompt_logprobs(self.model.compute_logits, hidden, ids, reqs)
        out = sample(self.backend, sampler, logits, logits.shape[0])
        self._keep_prefilled(batch_id, reqs, tables, sampler, out)
        return StepResult([r.id for r in reqs], out, prompt_lp, time.perf_counter_ns() - t0)

    def _prefill_setup(self, reqs: list[PrefillInput]):
        """A prefill's checks, its requests' block tables and its sampler."""
        inputs.check_cached(reqs, self.cfg.device.block_size)
        inputs.check_adapters(reqs, self.cfg.adapters.max_loras if self.adapter_rows is not None else 0)
        return inputs.block_tables(reqs, self.cfg), prefill_sampler(reqs, self.model.vocab_size, self.device,
                                                                    self.grammars)

    def _keep_prefilled(self, batch_id: int, reqs: list[PrefillInput], tables: np.ndarray, sampler,
                        out: SampleOutput) -> None:
        """Keep a prefill's rows as the batch `batch_id`, their first tokens sampled (`out`)."""
        lens, dev = inputs.prompt_lens(reqs), self.device
        self.batches[batch_id] = ShardBatch(
            id=batch_id, request_ids=[r.id for r in reqs],
            block_tables=torch.from_numpy(tables).to(dev), block_tables_host=tables,
            seq_lens=torch.from_numpy(lens).to(dev), seq_lens_host=lens,
            last_ids=out.next_ids[:len(reqs)], sampler=sampler,
            adapters=torch.tensor([r.adapter for r in reqs], device=dev) if any(r.adapter for r in reqs) else None,
            drafts=draft_rows(reqs, out.next_ids[:len(reqs)].tolist(), self.cfg.device.block_size)
            if self.cfg.scheduling.speculate else None,
        )

    def _forward_prefill(self, reqs: list[PrefillInput], tables: np.ndarray):
        """Queue the prefill's forward pass -> (hidden, logits, the padded ids). Only a batch with cached
        blocks pays for them; prompts with images run eagerly."""
        with_context = any(r.cached_tokens for r in reqs)
        step = inputs.prefill_step_inputs(reqs, tables, self.cfg, self.backend.pads_to_buckets, self.long_rope)
        self._note_shape(step.kind, *step.bucket)
        ids, args = step.args[0], [None if a is None else torch.from_numpy(a).to(self.device) for a in step.args]
        images = [im for r in reqs for im in r.images]
        if with_context and images:
            embeds = context_embeds(self.model, self.image_processor, reqs, *ids.shape, self.device)
            hidden, logits = self.steps.prefill_context_step(*args, inputs_embeds=embeds)
        elif with_context:
            hidden, logits = self._prefill_context_fn(*args)
        elif images:
            hidden, logits = self.steps.prefill_images_step(images, *args)
        else:
            hidden, logits = self._prefill_fn(*args)
        return hidden, logits, ids

    @torch.inference_mode()
    def decode(self, batches: list[tuple[int, list[int]]]) -> tuple[int, StepResult]:
        """One step over the cached batches (filtered to the given request ids), merged into one: a
        speculative one when some row drafts."""
        batch = self._merged(batches)
        plan = batch.draft_plan(self.cfg.scheduling.speculate, self.long_rope[0])
        if plan is not None:
            return batch.id, self._verify(batch, plan)
        step = self._decode_inputs(batch, self.cfg, self.backend.pads_to_buckets)
        self._note_shape(step.kind, *step.bucket)
        t0 = time.perf_counter_ns()
        logits = self._decode_fn(*step.args)
        self.backend.mark_step()
        out = sample(self.backend, batch.sampler, logits, step.args[0].shape[0])
        return batch.id, self._decoded(batch, out, time.perf_counter_ns() - t0)

    @torch.inference_mode()
    def decode_with(self, batches: list[tuple[int, list[int]]], ride_id: int,
                    reqs: list[PrefillInput]) -> tuple[int, StepResult, StepResult, bool]:
        """`decode`'s step with a prefill riding it (a long prompt's chunk, kept as the batch `ride_id`):
        both in one forward pass where `rides` allows and the step does not speculate, else the prefill's
        pass and then the step, as two calls would run them. -> (the batch id, the step's result, the
        prefill's, whether they shared the pass)."""
        if not self.rides(reqs):
            ride = self.prefill(ride_id, reqs)
            return *self.decode(batches), ride, False
        batch = self._merged(batches)
        plan = batch.draft_plan(self.cfg.scheduling.speculate, self.long_rope[0])
        if plan is not None:  # planned once: a plan counts the rows' steps until they draft again
            ride = self.prefill(ride_id, reqs)
            return batch.id, self._verify(batch, plan), ride, False
        tables, sampler = self._prefill_setup(reqs)
        prefill = inputs.prefill_step_inputs(reqs, tables, self.cfg, False, self.long_rope)
        decode = self._decode_inputs(batch, self.cfg, False)
        t0 = time.perf_counter_ns()
        logits = self.steps.mixed_step(decode.args, [None if a is None else torch.from_numpy(a).to(self.device)
                                                for a in prefill.args])
        self.backend.mark_step()
        d = len(batch)
        out = sample(self.backend, batch.sampler, logits[:d], d)
        ride_out = sample(self.backend, sampler, logits[d:], len(reqs))
        self._keep_prefilled(ride_id, reqs, tables, sampler, ride_out)
        ns = time.perf_counter_ns() - t0
        return batch.id, self._decoded(batch, out, ns), StepResult([r.id for r in reqs], ride_out, {}, ns), True

    def rides(self, reqs: list[PrefillInput]) -> bool:
        """Whether a prefill of `reqs` may share a decode step's forward pass (`_mixes`): no image (the vision
        tower's features replace embeddings) and no prompt log-probabilities (every prompt position's logits)."""
        return self.mixes and not any(r.images or r.prefill_logprobs for r in reqs)

    def _merged(self, batches: list[tuple[int, list[int]]]) -> ShardBatch:
        """The cached batches, filtered to the given request ids, merged into one."""
        return ShardBatch.concat([self._take(batch_id).filter(request_ids) for batch_id, request_ids in batches])

    def _decoded(self, batch: ShardBatch, out: SampleOutput, forward_ns: int) -> StepResult:
        """A plain decode step's tokens `out` taken into `batch`, which is kept."""
        batch.last_ids = out.next_ids[:len(batch)]
        if self.profiler is not None:
            self.profiler.step()
        batch.advance(None if batch.drafts is None else [[t] for t in batch.last_ids.tolist()])
        self.batches[batch.id] = batch
        return StepResult(list(batch.request_ids), out, {}, forward_ns)

    def _verify(self, batch: ShardBatch, plan: np.ndarray) -> StepResult:
        """A speculative step: each row's fed token and drafts in one pass, the accepted ones kept."""
        step = inputs.verify_inputs(batch, plan, self.cfg, self.backend.pads_to_buckets)
        self._note_shape(step.kind, *step.bucket)
        args = [None if a is None else torch.from_numpy(a).to(self.device) for a in step.args]
        t0 = time.perf_counter_ns()
        logits = self._verify_fn(*args)
        self.backend.mark_step()
        out, emitted = verify(self.backend, batch.sampler, logits, plan)
        if self.profiler is not None:
            self.profiler.step()
        drafted = (plan[:, 1:] >= 0).sum(axis=1)
        batch.last_ids = torch.tensor([t[-1] for t in emitted], dtype=torch.long, device=self.device)
        batch.advance(emitted, drafted)
        self.batches[batch.id] = batch
        ids = [rid for rid, tokens in zip(batch.request_ids, emitted) for _ in tokens]
        stats = SpecStats.of(drafted, emitted, self.cfg.scheduling.speculate)
        return StepResult(ids, out, {}, time.perf_counter_ns() - t0, stats)

    def _take(self, batch_id: int) -> ShardBatch:
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            raise ValueError(f"no cached batch {batch_id}")
        return batch

    def _note_shape(self, kind: str, *shape: int) -> None:
        if self.warmed is None or (kind, *shape) in self.warmed:
            return
        self.unwarmed_shapes += 1
        if (kind, *shape) not in self._unwarmed_seen:
            self._unwarmed_seen.add((kind, *shape))
            log.warning("%s shape %s was not warmed up: expect a slow first pass", kind, shape)

    def clear(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    # ---- warmup and info -----------------------------------------------

    @torch.inference_mode()
    def warmup(self):
        """Run every bucket once (capturing its graph where enabled); yields (done, total, phase)."""
        if self.grammars is not None:
            self.grammars.prepare()  # the grammar engine and the vocabulary, not the first grammar's wait
        steps = {"prefill": self._prefill_fn, "prefill_context": self._prefill_context_fn, "decode": self._decode_fn,
                 "verify": self._verify_fn}
        run = Warmup(self.cfg, self.backend, steps, self.flat_decode, self.recipe_cache)
        for done, total, phase in run.progress():
            if phase == "done":  # what the Info call reports is set before the router hears that warmup is over
                self.warmed, self.warmup_summary = run.warmed, run.summary
            yield done, total, phase
