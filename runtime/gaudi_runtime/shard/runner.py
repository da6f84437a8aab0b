"""The model on one shard: loads it, sizes its KV cache, and runs each step.

A step builds its inputs from the requests or the cached batch (`inputs.py`: padded to a bucket of
`gaudi_runtime.buckets`), runs one of the step functions below (what device graphs capture), and samples
(`step_sampling.py`); `warmup.py` runs every bucket's step once before serving. The only host-device
sync per step is reading the sampled tokens back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.device.base import Backend
from gaudi_runtime.layers.attention import AttentionMetadata, attention_in_use, use_attention
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
from gaudi_runtime.shard.prompt_images import context_embeds, load_processor, prompt_embeds
from gaudi_runtime.shard.sampling import SampleOutput
from gaudi_runtime.shard.speculation import SpecStats, draft_rows
from gaudi_runtime.shard.step_sampling import prefill_sampler, prompt_logprobs, sample, verify
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
        decode_step = self._flat_decode_step if self.flat_decode else self._decode_step
        self._decode_inputs = inputs.flat_decode_inputs if self.flat_decode else inputs.decode_inputs
        self._decode_fn = backend.graphed(decode_step, "decode")
        self._prefill_fn = self._prefill_step if dev.limit_hpu_graph else backend.graphed(self._prefill_step,
                                                                                   "prefill")
        self._prefill_context_fn = self._prefill_context_step if dev.limit_hpu_graph else backend.graphed(
            self._prefill_context_step, "prefill_context")
        self._verify_fn = backend.graphed(self._verify_step, "verify")
        self.profiler = make_profiler(cfg.device, rank, backend.profiler_activity)  # PROF_*: None unless this rank profiles

    # ---- the step functions (what device graphs capture) --------------

    def _use_adapters(self, adapters) -> None:
        """Each row's adapter slot for the forward pass that follows (layers/lora.py)."""
        if self.adapter_rows is not None:
            self.adapter_rows.index = adapters

    def _prefill_step(self, input_ids, positions, slots, last_idx, adapters):
        self._use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, AttentionMetadata(is_prefill=True, slots=slots))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _prefill_images_step(self, images: list[bytes], input_ids, positions, slots, last_idx, adapters):
        """A prefill whose prompts hold images: the vision tower's features replace the placeholder
        tokens' embeddings. Eager (image tile counts vary), so text-only buckets and graphs are untouched."""
        embeds = prompt_embeds(self.model, self.image_processor, images, input_ids)
        self._use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, AttentionMetadata(is_prefill=True, slots=slots),
                            inputs_embeds=embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _prefill_context_step(self, input_ids, positions, slots, last_idx, context_tables, context_lens, adapters,
                              inputs_embeds=None):
        """A prefill of the tokens after each prompt's cached blocks (`context_tables`, the first
        `context_lens` positions), which they attend to."""
        meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=context_tables, context_lens=context_lens)
        self._use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, inputs_embeds=inputs_embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _verify_step(self, input_ids, positions, slots, context_tables, context_lens, adapters):
        """Each row's fed token and drafts [rows, width] over its cached positions -> logits [width, rows, V]
        (position-major, so that each position's logits are one contiguous block for the sampler)."""
        meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=context_tables, context_lens=context_lens)
        self._use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        rows, width = input_ids.shape
        return self.model.compute_logits(hidden.transpose(0, 1).reshape(rows * width, -1)).view(width, rows, -1)

    def _decode_step(self, input_ids, positions, slots, tables, context_lens, adapters):
        self._use_adapters(adapters)
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables,
                                 context_lens=context_lens)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        return self.model.compute_logits(hidden[:, -1])

    def _flat_decode_step(self, input_ids, positions, slots, block_list, block_groups, block_bias, adapters):
        """A decode step whose attention reads the blocks in use, laid out flat (`flat_layout`)."""
        self._use_adapters(adapters)
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_list=block_list,
                                 block_groups=block_groups, block_bias=block_bias)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        return self.model.compute_logits(hidden[:, -1])

    # ---- prefill and decode --------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, reqs: list[PrefillInput]) -> StepResult:
        """Compute each prompt after its cached tokens (all of it when none are), keep the batch."""
        inputs.check_cached(reqs, self.cfg.device.block_size)
        inputs.check_adapters(reqs, self.cfg.adapters.max_loras if self.adapter_rows is not None else 0)
        tables = inputs.block_tables(reqs, self.cfg)
        sampler = prefill_sampler(reqs, self.model.vocab_size, self.device, self.grammars)
        t0 = time.perf_counter_ns()
        hidden, logits, ids = self._forward_prefill(reqs, tables)
        self.backend.mark_step()
        prompt_lp = prompt_logprobs(self.model.compute_logits, hidden, ids, reqs)
        out = sample(self.backend, sampler, logits, logits.shape[0])
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
        return StepResult([r.id for r in reqs], out, prompt_lp, time.perf_counter_ns() - t0)

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
            hidden, logits = self._prefill_context_step(*args, inputs_embeds=embeds)
        elif with_context:
            hidden, logits = self._prefill_context_fn(*args)
        elif images:
            hidden, logits = self._prefill_images_step(images, *args)
        else:
            hidden, logits = self._prefill_fn(*args)
        return hidden, logits, ids

    @torch.inference_mode()
    def decode(self, batches: list[tuple[int, list[int]]]) -> tuple[int, StepResult]:
        """One step over the cached batches (filtered to the given request ids), merged into one: a
        speculative one when some row drafts."""
        batch = ShardBatch.concat([self._take(batch_id).filter(request_ids) for batch_id, request_ids in batches])
        grammar = batch.sampler.grammar
        constrained = () if grammar is None else [m is not None for m in grammar.matchers]
        plan = None if batch.drafts is None else batch.drafts.plan(
            self.cfg.scheduling.speculate, buckets.SPECULATION_MAX_ROWS, constrained, self.long_rope[0])
        if plan is not None:
            return batch.id, self._verify(batch, plan)
        step = self._decode_inputs(batch, self.cfg, self.backend.pads_to_buckets)
        self._note_shape(step.kind, *step.bucket)
        t0 = time.perf_counter_ns()
        logits = self._decode_fn(*step.args)
        self.backend.mark_step()
        out = sample(self.backend, batch.sampler, logits, step.args[0].shape[0])
        batch.last_ids = out.next_ids[:len(batch)]
        if self.profiler is not None:
            self.profiler.step()
        batch.advance(None if batch.drafts is None else [[t] for t in batch.last_ids.tolist()])
        self.batches[batch.id] = batch
        return batch.id, StepResult(list(batch.request_ids), out, {}, time.perf_counter_ns() - t0)

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
