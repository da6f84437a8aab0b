"""The model on one shard: KV cache, padded static-shape forward passes, sampling.

Prefill and decode build their inputs with tensor operations and pad them to a
bucket from `gaudi_runtime.buckets`; the only host-device sync per step is
reading the sampled tokens back.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.layers.kv_cache import allocate_kv_cache, kv_bytes_per_block
from gaudi_runtime.models import load_model
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.batch import ShardBatch
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


def free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            import os

            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


class ModelRunner:
    def __init__(self, cfg: Config, model_dir: str, device: torch.device, rank: int = 0, world_size: int = 1,
                 process_group=None):
        self.cfg = cfg
        self.device = device
        self.dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        self.model = load_model(model_dir, self.dtype, device, rank, world_size, process_group)
        m = self.model
        per_block = kv_bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim, self.dtype)
        self.num_blocks = size_kv_cache(cfg, per_block, free_memory(device))
        self.kv_cache = allocate_kv_cache(m.num_layers, self.num_blocks, cfg.block_size, m.num_kv_heads,
                                          m.head_dim, self.dtype, device)
        log.info("model loaded in %.1fs; KV cache: %d blocks of %d tokens (%.1f MiB)",
                 time.perf_counter() - t0, self.num_blocks - 1, cfg.block_size,
                 self.num_blocks * per_block / 2**20)
        self.batches: dict[int, ShardBatch] = {}
        self.warmup_summary: dict | None = None

    # ---- prefill -------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, reqs: list[PrefillInput]) -> StepResult:
        cfg, bs = self.cfg, self.cfg.block_size
        n = len(reqs)
        lens = np.array([len(r.input_ids) for r in reqs], dtype=np.int64)
        seq = buckets.prefill_seq_bucket(int(lens.max()), cfg)
        rows = buckets.prefill_batch_bucket(n, seq, cfg)
        width = buckets.round_up(max(len(r.blocks) for r in reqs), buckets.block_step(cfg))

        ids = np.zeros((rows, seq), dtype=np.int64)
        tables = np.zeros((n, width), dtype=np.int64)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = r.input_ids
            tables[i, : len(r.blocks)] = r.blocks
        pos = np.arange(seq, dtype=np.int64)
        slots = np.zeros((rows, seq), dtype=np.int64)
        real = pos[None, :] < lens[:, None]
        slots[:n] = np.where(real, np.take_along_axis(tables, np.minimum(pos // bs, width - 1)[None, :].repeat(n, 0),
                                                      1) * bs + pos % bs, 0)

        dev = self.device
        input_ids = torch.from_numpy(ids).to(dev)
        positions = torch.from_numpy(np.broadcast_to(pos, (rows, seq)).copy()).to(dev)
        meta = AttentionMetadata(is_prefill=True, slots=torch.from_numpy(slots).to(dev))
        t0 = time.perf_counter_ns()
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        last_idx = torch.zeros(rows, dtype=torch.long, device=dev)
        last_idx[:n] = torch.from_numpy(lens - 1).to(dev)
        last = hidden[torch.arange(rows, device=dev), last_idx]
        logits = self.model.compute_logits(last)

        prefill_lp: dict[int, list[float]] = {}
        wanted = [i for i, r in enumerate(reqs) if r.prefill_logprobs]
        if wanted:
            prefill_lp = self._prompt_logprobs(hidden, ids, lens, reqs, wanted)

        sampler = BatchSampler([r.params for r in reqs], [r.top_n_tokens for r in reqs],
                               [r.input_ids for r in reqs], self.model.vocab_size, dev)
        out = sampler(logits)
        self.batches[batch_id] = ShardBatch(
            id=batch_id,
            request_ids=[r.id for r in reqs],
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.from_numpy(lens).to(dev),
            seq_lens_host=lens,
            last_ids=out.next_ids[:n],
            sampler=sampler,
        )
        return StepResult([r.id for r in reqs], out, prefill_lp, time.perf_counter_ns() - t0)

    def _prompt_logprobs(self, hidden, ids, lens, reqs, wanted) -> dict[int, list[float]]:
        result = {}
        for i in wanted:
            n = int(lens[i])
            logits = self.model.compute_logits(hidden[i, : n - 1])
            lp = torch.log_softmax(logits, dim=-1)
            nxt = torch.from_numpy(ids[i, 1:n]).to(lp.device)
            result[reqs[i].id] = [math.nan] + lp.gather(1, nxt[:, None]).squeeze(1).tolist()
        return result

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
        cfg, bs, dev = self.cfg, self.cfg.block_size, self.device
        n = len(batch)
        rows = buckets.decode_batch_bucket(n, cfg)
        width = buckets.decode_block_bucket(int(batch.seq_lens_host.max()) + 1, cfg)

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
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables,
                                 context_lens=positions + 1)
        t0 = time.perf_counter_ns()
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[:, -1])
        out = batch.sampler(logits)
        batch.last_ids = out.next_ids[:n]
        batch.seq_lens = batch.seq_lens + 1
        batch.seq_lens_host = batch.seq_lens_host + 1
        self.batches[batch.id] = batch
        return batch.id, StepResult(list(batch.request_ids), out, {}, time.perf_counter_ns() - t0)

    # ---- warmup --------------------------------------------------------

    @torch.inference_mode()
    def warmup(self):
        """Run every bucket once; yields (done, total, phase) after each."""
        cfg, dev = self.cfg, self.device
        prefill = buckets.prefill_buckets(cfg) if cfg.warmup_enabled else []
        decode = buckets.decode_buckets(cfg) if cfg.warmup_enabled else []
        total = len(prefill) + len(decode)
        t0 = time.perf_counter()
        done = 0
        for rows, seq in prefill:
            zeros = torch.zeros(rows, seq, dtype=torch.long, device=dev)
            hidden = self.model(zeros, zeros, self.kv_cache, AttentionMetadata(is_prefill=True, slots=zeros))
            self.model.compute_logits(hidden[:, -1])
            done += 1
            yield done, total, "prefill"
        for rows, width in decode:
            zeros = torch.zeros(rows, 1, dtype=torch.long, device=dev)
            meta = AttentionMetadata(is_prefill=False, slots=zeros,
                                     block_tables=torch.zeros(rows, width, dtype=torch.long, device=dev),
                                     context_lens=torch.ones(rows, dtype=torch.long, device=dev))
            hidden = self.model(zeros, zeros, self.kv_cache, meta)
            self.model.compute_logits(hidden[:, -1])
            done += 1
            yield done, total, "decode"
        self.warmup_summary = {"prefill_shapes": len(prefill), "decode_shapes": len(decode),
                               "seconds": round(time.perf_counter() - t0, 3)}
        log.info("warmup: %d prefill and %d decode shapes in %.1fs", len(prefill), len(decode),
                 self.warmup_summary["seconds"])
        yield done, total, "done"

    def info(self) -> dict:
        return {
            "kv_blocks": self.num_blocks - 1,
            "block_size": self.cfg.block_size,
            "max_batch_total_tokens": (self.num_blocks - 1) * self.cfg.block_size,
            "warmup": self.warmup_summary,
        }

    def filter(self, batch_id: int, request_ids: list[int]) -> None:
        b = self.batches.get(batch_id)
        if b is None:
            raise ValueError(f"no cached batch {batch_id}")
        self.batches[batch_id] = b.filter(request_ids)

    def clear(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)
