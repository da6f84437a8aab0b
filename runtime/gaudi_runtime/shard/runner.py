"""The model on one shard: KV cache, padded static-shape forward passes, sampling.

Prefill and decode build their inputs with tensor operations and pad them to a
bucket from `gaudi_runtime.buckets`; the only host-device sync per step is
reading the sampled tokens back.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.device.base import Backend
from gaudi_runtime.layers.attention import AttentionMetadata, attention_in_use, select_attention
from gaudi_runtime.layers.flat_paged_attention import flat_layout
from gaudi_runtime.layers.kv_cache import allocate_kv_cache, kv_bytes_per_block
from gaudi_runtime.models import load_model
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.quant.setup import kv_cache_dtype, quantize_loaded
from gaudi_runtime.recipe_cache import RecipeCache
from gaudi_runtime.shard.batch import ShardBatch
from gaudi_runtime.shard.grammar import GrammarCache, GrammarRows
from gaudi_runtime.shard.profiler import make_profiler
from gaudi_runtime.shard.sampling import BatchSampler, SampleOutput

log = logging.getLogger(__name__)


@dataclass
class PrefillInput:
    id: int
    input_ids: list[int]
    params: SamplingParameters
    top_n_tokens: int
    blocks: list[int]
    prefill_logprobs: bool
    images: list[bytes] = field(default_factory=list)  # encoded images of a multimodal prompt, in order
    grammar: tuple[str, str] | None = None  # (kind, text) the output must follow (shard/grammar.py)
    cached_tokens: int = 0  # prompt tokens the first blocks already hold (prefix caching): not computed


@dataclass
class StepResult:
    request_ids: list[int]
    sample: SampleOutput
    prefill_logprobs: dict[int, list[float]] = field(default_factory=dict)
    forward_ns: int = 0


def size_kv_cache(cfg: Config, bytes_per_block: int, free_bytes: int | None) -> int:
    """Blocks to allocate (block 0, the padding block, included)."""
    per_seq = buckets.blocks_per_sequence(cfg)
    if cfg.max_batch_total_tokens is not None:
        return buckets.ceil_div(cfg.max_batch_total_tokens, cfg.block_size) + 1
    wanted = cfg.max_batch_size * per_seq + 1
    if free_bytes is None:
        return wanted
    fit = int(free_bytes * cfg.memory_fraction) // bytes_per_block
    if fit < per_seq + 1:
        raise MemoryError(
            f"the KV cache does not fit: {fit} blocks free, one sequence of --max-total-tokens "
            f"{cfg.max_total_tokens} needs {per_seq + 1}; lower --max-total-tokens"
        )
    return min(wanted, fit)


def check_cached(reqs: list[PrefillInput], block_size: int) -> None:
    """Cached tokens fill whole blocks of the request's own, leave at least one token to compute, and
    are none where the prompt's log-probabilities are wanted."""
    for r in reqs:
        c = r.cached_tokens
        if c % block_size or c >= len(r.input_ids) or c > len(r.blocks) * block_size or (c and r.prefill_logprobs):
            raise ValueError(f"request {r.id}: {c} cached tokens do not fit its {len(r.input_ids)}-token prompt "
                             f"and {len(r.blocks)} blocks of {block_size}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes this rank holds for the model: parameters (tied ones once) and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


class WarmupError(RuntimeError):
    """A bucket could not run; the message names the setting to lower."""


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
        self.dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        attention = select_attention(cfg.use_flash_attention, cfg.flash_attention_recompute, backend.name,
                                     cfg.cpu_paged_attention)
        rope = (cfg.rope_scaling, cfg.rope_factor) if cfg.rope_scaling else None  # --rope-scaling/--rope-factor
        self.model = load_model(model_dir, self.dtype, device, rank, world_size, process_group, rope=rope)
        # FP8 (--quantize / QUANT_CONFIG) swaps layers after load; --kv-cache-dtype sets the cache's scales.
        self.model = quantize_loaded(self.model, cfg, backend.name, self.dtype, rank, world_size)
        self.kv_dtype = kv_cache_dtype(cfg, self.dtype)
        self.attention_name = attention_in_use(attention, self.kv_dtype)
        # Decode over the flat layout of the blocks in use (HPU, unless the math fallback keeps the gather).
        self.flat_decode = backend.flat_decode and attention.flat_decode is not None
        log.info("attention: %s (FLASH_ATTENTION_RECOMPUTE=%s)", self.attention_name, cfg.flash_attention_recompute)
        m = self.model
        self.rank, self.world_size = rank, world_size
        self.weight_bytes = weight_bytes(m)
        backend.prepare_model(m, cfg)
        per_block = kv_bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype)
        free = backend.memory_info()
        self.num_blocks = size_kv_cache(cfg, per_block, free[0] if free else None)
        self.kv_cache = allocate_kv_cache(m.num_layers, self.num_blocks, cfg.block_size, m.num_kv_heads,
                                          m.head_dim, self.kv_dtype, device)
        log.info("rank %d/%d holds %.1f MiB of weights", rank, world_size, self.weight_bytes / 2**20)
        self.load_seconds = time.perf_counter() - t0
        log.info("model loaded in %.1fs; KV cache: %d blocks of %d tokens (%.1f MiB)",
                 self.load_seconds, self.num_blocks - 1, cfg.block_size,
                 self.num_blocks * per_block / 2**20)
        self.batches: dict[int, ShardBatch] = {}
        # Grammars compiled against the model's vocabulary (xgrammar is loaded at the first grammar).
        self.grammars = None if cfg.disable_grammar_support else GrammarCache(model_dir, m.vocab_size,
                                                                              m.eos_token_ids)
        # Multimodal models (Llava) preprocess their prompt images here with the model's own processor.
        self.image_processor = None
        if m.takes_images:
            from gaudi_runtime.models.llava_next import load_image_processor

            self.image_processor = load_image_processor(model_dir)
        self.warmup_summary: dict | None = None
        self.warmed: set[tuple] | None = None  # (kind, *shape) of every shape warmup ran; None until it ran
        self.unwarmed_shapes = 0  # forward passes on a shape warmup did not run
        self._unwarmed_seen: set[tuple] = set()
        decode_step = self._flat_decode_step if self.flat_decode else self._decode_step
        self._decode_fn = backend.graphed(decode_step, "decode")
        self._prefill_fn = self._prefill_step if cfg.limit_hpu_graph else backend.graphed(self._prefill_step,
                                                                                          "prefill")
        self._prefill_context_fn = self._prefill_context_step if cfg.limit_hpu_graph else backend.graphed(
            self._prefill_context_step, "prefill_context")
        self.profiler = make_profiler(cfg, rank, backend.name)  # PROF_*: None unless this rank profiles

    # ---- the two step functions (what device graphs capture) -----------

    def _prefill_step(self, input_ids, positions, slots, last_idx):
        hidden = self.model(input_ids, positions, self.kv_cache, AttentionMetadata(is_prefill=True, slots=slots))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _prefill_images_step(self, images: list[bytes], input_ids, positions, slots, last_idx):
        """A prefill whose prompts hold images: the vision tower's features replace the placeholder
        tokens' embeddings. Eager (image tile counts vary), so text-only buckets and graphs are untouched."""
        if self.image_processor is None:
            raise ValueError("this model takes no images")
        from gaudi_runtime.models.llava_next import pixel_inputs

        try:
            pixels, sizes = pixel_inputs(self.image_processor, images)
        except Exception as e:  # the router validated them; a failure here is still the request's fault
            raise ValueError(f"cannot preprocess the prompt's images: {e}") from e
        embeds = self.model.embed_prompt(input_ids, pixels, sizes)
        hidden = self.model(input_ids, positions, self.kv_cache, AttentionMetadata(is_prefill=True, slots=slots),
                            inputs_embeds=embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _prefill_context_step(self, input_ids, positions, slots, last_idx, context_tables, context_lens,
                              inputs_embeds=None):
        """A prefill of the tokens after each prompt's cached blocks (`context_tables`, the first
        `context_lens` positions), which they attend to."""
        meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=context_tables, context_lens=context_lens)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, inputs_embeds=inputs_embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def _decode_step(self, input_ids, positions, slots, tables, context_lens):
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables,
                                 context_lens=context_lens)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        return self.model.compute_logits(hidden[:, -1])

    def _flat_decode_step(self, input_ids, positions, slots, block_list, block_groups, block_bias):
        """A decode step whose attention reads the blocks in use, laid out flat (`flat_layout`)."""
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_list=block_list,
                                 block_groups=block_groups, block_bias=block_bias)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        return self.model.compute_logits(hidden[:, -1])

    def _note_shape(self, kind: str, *shape: int) -> None:
        if self.warmed is None or (kind, *shape) in self.warmed:
            return
        self.unwarmed_shapes += 1
        if (kind, *shape) not in self._unwarmed_seen:
            self._unwarmed_seen.add((kind, *shape))
            log.warning("%s shape %s was not warmed up: expect a slow first pass", kind, shape)

    # ---- prefill -------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, reqs: list[PrefillInput]) -> StepResult:
        """Compute each prompt after its cached tokens (all of it when none are), keep the batch."""
        n = len(reqs)
        lens = np.array([len(r.input_ids) for r in reqs], dtype=np.int64)
        cached = np.array([r.cached_tokens for r in reqs], dtype=np.int64)
        check_cached(reqs, self.cfg.block_size)
        width = buckets.round_up(max(len(r.blocks) for r in reqs), buckets.block_step(self.cfg))
        tables = np.zeros((n, width), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.blocks)] = r.blocks
        dev = self.device
        sampler = BatchSampler([r.params for r in reqs], [r.top_n_tokens for r in reqs],
                               [r.input_ids for r in reqs], self.model.vocab_size, dev, self._grammar_rows(reqs))
        t0 = time.perf_counter_ns()
        if cached.any():
            hidden, logits, ids = self._run_prefill_with_context(reqs, lens, cached, tables)
        else:  # the plain path: no batch without cached blocks pays for them
            hidden, logits, ids = self._run_prefill(reqs, lens, tables)
        self.backend.mark_step()

        prefill_lp: dict[int, list[float]] = {}
        wanted = [i for i, r in enumerate(reqs) if r.prefill_logprobs]
        if wanted:
            prefill_lp = self._prompt_logprobs(hidden, ids, lens, reqs, wanted)

        out = self._sample(sampler, logits, logits.shape[0])
        self.batches[batch_id] = ShardBatch(
            id=batch_id,
            request_ids=[r.id for r in reqs],
            block_tables=torch.from_numpy(tables).to(dev),
            block_tables_host=tables,
            seq_lens=torch.from_numpy(lens).to(dev),
            seq_lens_host=lens,
            last_ids=out.next_ids[:n],
            sampler=sampler,
        )
        return StepResult([r.id for r in reqs], out, prefill_lp, time.perf_counter_ns() - t0)

    def _run_prefill(self, reqs: list[PrefillInput], lens: np.ndarray, tables: np.ndarray):
        """Every prompt token from position 0 -> (hidden, logits, the padded ids)."""
        cfg, bs = self.cfg, self.cfg.block_size
        n, width = tables.shape
        seq = buckets.prefill_seq_bucket(int(lens.max()), cfg)
        rows = buckets.prefill_batch_bucket(n, seq, cfg)
        self._note_shape("prefill", rows, seq)
        if not self.backend.pads_to_buckets:  # eager device: the batch's own shape
            seq, rows = int(lens.max()), n
        ids = np.zeros((rows, seq), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = r.input_ids
        pos = np.arange(seq, dtype=np.int64)
        slots = np.zeros((rows, seq), dtype=np.int64)
        real = pos[None, :] < lens[:, None]
        slots[:n] = np.where(real, np.take_along_axis(tables, np.minimum(pos // bs, width - 1)[None, :].repeat(n, 0),
                                                      1) * bs + pos % bs, 0)
        last_idx = np.zeros(rows, dtype=np.int64)
        last_idx[:n] = lens - 1
        prefill_fn = self._prefill_fn
        if any(r.images for r in reqs):
            prefill_fn = functools.partial(self._prefill_images_step, [im for r in reqs for im in r.images])
        dev = self.device
        hidden, logits = prefill_fn(
            torch.from_numpy(ids).to(dev), torch.from_numpy(np.broadcast_to(pos, (rows, seq)).copy()).to(dev),
            torch.from_numpy(slots).to(dev), torch.from_numpy(last_idx).to(dev))
        return hidden, logits, ids

    def _run_prefill_with_context(self, reqs: list[PrefillInput], lens: np.ndarray, cached: np.ndarray,
                                  tables: np.ndarray):
        """The tokens after each prompt's cached ones, at their positions -> (hidden, logits, the padded
        new ids). Shape: (rows, new tokens, context blocks), each bucketed."""
        cfg, bs = self.cfg, self.cfg.block_size
        n, width = tables.shape
        new, context = lens - cached, cached // bs
        seq = buckets.prefill_seq_bucket(int(new.max()), cfg)
        rows = buckets.prefill_batch_bucket(n, seq, cfg)
        ctx = buckets.context_block_bucket(int(context.max()), cfg)
        self._note_shape("prefill_context", rows, seq, ctx)
        if not self.backend.pads_to_buckets:  # eager device: the batch's own shape
            seq, rows, ctx = int(new.max()), n, int(context.max())
        ids = np.zeros((rows, seq), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, : new[i]] = r.input_ids[cached[i]:]
        j = np.arange(seq, dtype=np.int64)
        pos = cached[:, None] + j[None, :]  # [n, seq]
        real = j[None, :] < new[:, None]
        positions, slots = np.zeros((rows, seq), dtype=np.int64), np.zeros((rows, seq), dtype=np.int64)
        positions[:n] = np.where(real, pos, 0)
        slots[:n] = np.where(real, np.take_along_axis(tables, np.minimum(pos // bs, width - 1), 1) * bs + pos % bs, 0)
        context_tables = np.zeros((rows, ctx), dtype=np.int64)
        cols = min(ctx, width)
        context_tables[:n, :cols] = np.where(np.arange(cols)[None, :] < context[:, None], tables[:, :cols], 0)
        context_lens, last_idx = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        context_lens[:n], last_idx[:n] = cached, new - 1
        dev = self.device
        args = [torch.from_numpy(a).to(dev) for a in (ids, positions, slots, last_idx, context_tables, context_lens)]
        if any(r.images for r in reqs):  # eager, as any prefill with images
            embeds = self._context_embeds(reqs, cached, rows, seq)
            hidden, logits = self._prefill_context_step(*args, inputs_embeds=embeds)
        else:
            hidden, logits = self._prefill_context_fn(*args)
        return hidden, logits, ids

    def _context_embeds(self, reqs: list[PrefillInput], cached: np.ndarray, rows: int, seq: int) -> torch.Tensor:
        """The embeddings of the tokens after each prompt's cached ones, image features merged in: the
        features of an image whose placeholders the cached part cuts through are needed after the cut."""
        if self.image_processor is None:
            raise ValueError("this model takes no images")
        from gaudi_runtime.models.llava_next import pixel_inputs

        try:
            pixels, sizes = pixel_inputs(self.image_processor, [im for r in reqs for im in r.images])
        except Exception as e:  # the router validated them; a failure here is still the request's fault
            raise ValueError(f"cannot preprocess the prompt's images: {e}") from e
        longest = max(len(r.input_ids) for r in reqs)
        full = torch.zeros(len(reqs), longest, dtype=torch.long, device=self.device)
        for i, r in enumerate(reqs):
            full[i, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long)
        embeds = self.model.embed_prompt(full, pixels, sizes)  # [n, longest, hidden]
        index = torch.from_numpy(np.minimum(cached[:, None] + np.arange(seq)[None, :], longest - 1)).to(self.device)
        picked = embeds.gather(1, index[..., None].expand(-1, -1, embeds.shape[-1]))
        pad = torch.zeros(rows - len(reqs), seq, embeds.shape[-1], dtype=embeds.dtype, device=self.device)
        return torch.cat([picked, pad])

    def _prompt_logprobs(self, hidden, ids, lens, reqs, wanted) -> dict[int, list[float]]:
        """Rows that want them computed their whole prompt (the router looks nothing up for them)."""
        result = {}
        for i in wanted:
            n = int(lens[i])
            logits = self.model.compute_logits(hidden[i, : n - 1])
            lp = torch.log_softmax(logits, dim=-1)
            nxt = torch.from_numpy(ids[i, 1:n]).to(lp.device)
            result[reqs[i].id] = [math.nan] + lp.gather(1, nxt[:, None]).squeeze(1).tolist()
        return result

    def _grammar_rows(self, reqs: list[PrefillInput]) -> GrammarRows | None:
        """A matcher per constrained request (the router had the grammar compiled; a grammar dropped
        from the cache since is compiled again here)."""
        if self.grammars is None or all(r.grammar is None for r in reqs):
            if any(r.grammar is not None for r in reqs):
                raise ValueError("grammar is not supported")
            return None
        try:
            return GrammarRows.of(self.grammars, [None if r.grammar is None else self.grammars.matcher(*r.grammar)
                                                  for r in reqs])
        except ValueError as e:
            raise ValueError(f"grammar: {e}") from e

    def _sample(self, sampler: BatchSampler, logits: torch.Tensor, rows: int):
        """Sample the step whose forward pass was just queued. With grammars, the matchers fill the
        bitmask on the host meanwhile (the device is still computing `logits` on HPU and CUDA), and
        then take the sampled tokens, which costs every rank a read-back of the step's tokens."""
        bitmask = None
        if sampler.grammar is not None:
            bitmask = self.backend.upload(sampler.grammar.fill(rows))
        out = sampler(logits, bitmask)
        self.backend.mark_step()
        if sampler.grammar is not None:
            sampler.accept(out.next_ids[:len(sampler)].tolist())
        return out

    # ---- decode --------------------------------------------------------

    @torch.inference_mode()
    def decode(self, batches: list[tuple[int, list[int]]]) -> tuple[int, StepResult]:
        """One step over the cached batches (filtered to the given request ids), merged into one."""
        parts = []
        for batch_id, request_ids in batches:
            b = self.batches.pop(batch_id, None)
            if b is None:
                raise ValueError(f"no cached batch {batch_id}")
            parts.append(b.filter(request_ids))
        batch = ShardBatch.concat(parts)
        rows = buckets.decode_batch_bucket(len(batch), self.cfg)
        inputs = (self._flat_decode_inputs if self.flat_decode else self._decode_inputs)(batch, rows)
        rows = inputs[0].shape[0]
        t0 = time.perf_counter_ns()
        logits = self._decode_fn(*inputs)
        self.backend.mark_step()
        out = self._sample(batch.sampler, logits, rows)
        batch.last_ids = out.next_ids[:len(batch)]
        if self.profiler is not None:
            self.profiler.step()
        batch.seq_lens = batch.seq_lens + 1
        batch.seq_lens_host = batch.seq_lens_host + 1
        self.batches[batch.id] = batch
        return batch.id, StepResult(list(batch.request_ids), out, {}, time.perf_counter_ns() - t0)

    def _decode_inputs(self, batch: ShardBatch, rows: int) -> tuple:
        """A decode step's inputs on `rows` rows: ids, positions, slots, the block tables padded to the
        bucket of the longest row, context lengths."""
        cfg, bs, dev = self.cfg, self.cfg.block_size, self.device
        n = len(batch)
        longest = int(batch.seq_lens_host.max()) + 1
        width = buckets.decode_block_bucket(longest, cfg)
        self._note_shape("decode", rows, width)
        if not self.backend.pads_to_buckets:  # eager device: no padded rows, only the blocks in use
            rows, width = n, buckets.ceil_div(longest, bs)

        tables = batch.block_tables
        if tables.shape[1] < width:
            tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
        tables = tables[:, :width]
        positions = batch.seq_lens
        slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs
        pad = rows - n
        if pad:
            zeros = torch.zeros(pad, dtype=torch.long, device=dev)
            input_ids = torch.cat([batch.last_ids, zeros])
            positions = torch.cat([positions, zeros])
            slots = torch.cat([slots, zeros])
            tables = torch.cat([tables, torch.zeros(pad, width, dtype=torch.long, device=dev)])
        else:
            input_ids = batch.last_ids
        return input_ids, positions, slots, tables, positions + 1

    def _flat_decode_inputs(self, batch: ShardBatch, rows: int) -> tuple:
        """A flat decode step's inputs on `rows` rows: ids, positions and slots, then the flat layout of the
        blocks the rows use (`flat_layout`), padded to the bucket of their total, built on the host."""
        bs, n = self.cfg.block_size, len(batch)
        pos = batch.seq_lens_host
        used = int((pos // bs + 1).sum())  # blocks holding each row's pos + 1 tokens
        total = buckets.decode_total_blocks_bucket(used, rows, self.cfg)
        self._note_shape("decode", rows, total)
        if not self.backend.pads_to_buckets:  # eager device: no padded rows or blocks
            rows, total = n, used
        tables = batch.block_tables_host
        positions, slots = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        positions[:n] = pos
        slots[:n] = tables[np.arange(n), pos // bs] * bs + pos % bs
        layout = flat_layout(tables, pos + 1, bs, rows, total)
        input_ids = batch.last_ids if rows == n else torch.cat([batch.last_ids, self._zeros(rows - n)])
        return input_ids, *(torch.from_numpy(a).to(self.device) for a in (positions, slots, *layout))

    # ---- warmup --------------------------------------------------------

    @torch.inference_mode()
    def warmup(self):
        """Run every bucket once (capturing its graph where enabled); yields (done, total, phase)."""
        cfg = self.cfg
        if self.grammars is not None:
            self.grammars.prepare()  # the grammar engine and the vocabulary, not the first grammar's wait
        if not cfg.warmup_enabled:
            log.warning("WARMUP_ENABLED=false: no shape is compiled ahead; the first requests will be slow")
            self.warmup_summary = {"enabled": False}
            yield 0, 0, "done"
            return
        warm = {"prefill": self._warm_prefill, "prefill_context": self._warm_prefill_context,
                "decode": self._warm_flat_decode if self.flat_decode else self._warm_decode}
        phases = [(phase, shapes, warm[phase]) for phase, shapes in buckets.warmup_plan(cfg, self.flat_decode)]
        # Without padding (CPU, CUDA without graphs) nothing is compiled per shape: of the many prefill
        # shapes with cached blocks, only the one with the largest attention runs, to meet running out
        # of memory at start rather than under traffic; the others count as warmed.
        largest = max(phases[1][1], key=lambda s: s[0] * s[1] * (s[1] + s[2] * cfg.block_size), default=None)
        total = sum(len(shapes) for _, shapes, _ in phases)
        warmed: set[tuple] = set()
        t0 = time.perf_counter()
        log.info("warmup: %s shapes", ", ".join(f"{len(shapes)} {phase}" for phase, shapes, _ in phases))
        for phase, shapes, warm in phases:
            started = time.perf_counter()
            for shape in shapes:
                if self.backend.pads_to_buckets or phase != "prefill_context" or shape == largest:
                    warm(*shape)
                warmed.add((phase, *shape))
                yield len(warmed), total, phase
            log.info("warmup: %s done in %.1fs", phase, time.perf_counter() - started)
        self.backend.synchronize()
        self.warmed = warmed
        seconds = time.perf_counter() - t0
        log.info("warmup: %d shapes in %.1fs", total, seconds)
        self.warmup_summary = {"enabled": True, **{f"{phase}_shapes": len(shapes) for phase, shapes, _ in phases},
                               "seconds": round(seconds, 3), "graphs": self.backend.graph_stats(),
                               "from_cache": self.warmup_from_cache}
        if self.recipe_cache is not None:
            self.recipe_cache.mark_warm()  # every bucket's recipe is now on the volume for the next start
        yield total, total, "done"

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.long, device=self.device)

    def _warm_prefill(self, rows: int, seq: int) -> None:
        zeros = self._zeros(rows, seq)
        self._warm(f"prefill bucket (batch {rows}, sequence {seq})", "--max-batch-prefill-tokens",
                   self._prefill_fn, zeros, zeros, zeros, self._zeros(rows))

    def _warm_prefill_context(self, rows: int, seq: int, blocks: int) -> None:
        zeros = self._zeros(rows, seq)
        self._warm(f"prefill bucket (batch {rows}, sequence {seq}, {blocks} cached blocks)",
                   "--max-batch-prefill-tokens or --max-input-tokens (or --prefix-caching false)",
                   self._prefill_context_fn, zeros, zeros, zeros, self._zeros(rows), self._zeros(rows, blocks),
                   self._zeros(rows))

    def _warm_decode(self, rows: int, width: int) -> None:
        zeros = self._zeros(rows)
        self._warm(f"decode bucket (batch {rows}, {width} blocks)", "--max-batch-size or --max-total-tokens",
                   self._decode_fn, zeros, zeros, zeros, self._zeros(rows, width), torch.ones_like(zeros))

    def _warm_flat_decode(self, rows: int, total: int) -> None:
        zeros, blocks = self._zeros(rows), self._zeros(total)  # every block: block 0, row 0, unmasked
        bias = torch.zeros(total, self.cfg.block_size, device=self.device)
        self._warm(f"decode bucket (batch {rows}, {total} blocks in all)", "--max-batch-size or --max-total-tokens",
                   self._decode_fn, zeros, zeros, zeros, blocks, blocks, bias)

    def _warm(self, what: str, setting: str, fn, *args) -> None:
        try:
            fn(*args)
            self.backend.mark_step()
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise WarmupError(f"out of memory warming up the {what}: lower {setting} "
                              f"(or --max-batch-total-tokens / --memory-fraction): {e}") from e
        except RuntimeError as e:
            if "out of memory" in str(e).lower():
                raise WarmupError(f"out of memory warming up the {what}: lower {setting}: {e}") from e
            raise

    @property
    def warmup_from_cache(self) -> bool | None:
        """Whether warmup finds every bucket's compiled graph in the recipe cache (None: no recipe cache)."""
        return self.recipe_cache.from_cache if self.recipe_cache is not None else None

    def startup_seconds(self) -> dict:
        warmup = (self.warmup_summary or {}).get("seconds")
        return {"download": None if self.download_seconds is None else round(self.download_seconds, 3),
                "load": round(self.load_seconds, 3), "warmup": warmup}

    def info(self) -> dict:
        return {
            "quantization": self.cfg.quantize,
            "kv_cache_dtype": self.cfg.kv_cache_dtype or self.cfg.dtype,
            "prefix_caching": self.cfg.prefix_caching,
            "attention": self.attention_name,
            "warmup_from_cache": self.warmup_from_cache,
            "recipe_cache": self.recipe_cache.describe() if self.recipe_cache is not None else None,
            "startup_seconds": self.startup_seconds(),
            "rank": self.rank,
            "world_size": self.world_size,
            "weight_bytes": self.weight_bytes,
            "kv_blocks": self.num_blocks - 1,
            "block_size": self.cfg.block_size,
            "max_batch_total_tokens": (self.num_blocks - 1) * self.cfg.block_size,
            "warmup": self.warmup_summary,
            "unwarmed_shapes": self.unwarmed_shapes,
            # Decode shapes: (batch, total blocks) over the flat layout, else (batch, block-table width).
            "buckets": {**{phase: len(shapes) for phase, shapes in buckets.warmup_plan(self.cfg, self.flat_decode)},
                        "exponential": self.cfg.exponential_bucketing},
        }

    def clear(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)
