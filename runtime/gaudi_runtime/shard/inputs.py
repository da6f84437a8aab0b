"""A forward pass's inputs, built from the requests or the cached batch: pure functions.

Each builder picks the bucket (`gaudi_runtime.buckets`) the batch falls in, pads the rows, tokens and
blocks to it, and computes where each token is (position) and where its keys and values go in the KV
cache (slot: block * block_size + offset). Padded rows and tokens write to block 0, the padding block.
A device that does not pad (`pad=False`: CPU, CUDA without graphs) runs the batch's own shape, but the
bucket is still reported, so that the runner can tell a shape warmup did not run.

A new input kind is one more builder here returning `StepInputs` for a step function of the runner;
a new per-row input is one more array in the `args` of the kinds that need it, as the adapter slots are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.layers.flat_paged_attention import flat_layout
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.batch import ShardBatch


@dataclass
class PrefillInput:
    id: int
    input_ids: list[int]
    params: SamplingParameters
    top_n_tokens: int
    blocks: list[int]
    prefill_logprobs: bool
    images: list[bytes] = field(default_factory=list)  # encoded images of a multimodal prompt, in order
    grammar: int | None = None  # the id of the compiled grammar the output must follow (shard/grammar.py)
    thinking: tuple[int, int, bool] | None = None  # a reasoning model's (start, end, open): grammar.ThinkingGate
    cached_tokens: int = 0  # prompt tokens the first blocks already hold (prefix caching): not computed
    adapter: int = 0  # LoRA adapter slot (layers/lora.py): 0 none, i the i-th adapter served
    max_new_tokens: int = 0  # most tokens it may generate (0: as many as its blocks hold after the prompt)
    sequence_tokens: int = 0  # the whole prompt's length when input_ids is a chunk of it (0: input_ids is whole)


@dataclass
class StepInputs:
    """What one step function takes, and the bucket it was padded to."""

    kind: str  # "prefill", "prefill_context" or "decode": the warmup phase the bucket belongs to
    bucket: tuple[int, ...]  # the bucket's shape, as warmup lists it (even where `args` are not padded)
    args: tuple  # the step function's positional arguments: numpy arrays (prefill) or tensors (decode)


def check_cached(reqs: list[PrefillInput], block_size: int) -> None:
    """Cached tokens fill whole blocks of the request's own, leave at least one token to compute, and
    are none where the prompt's log-probabilities are wanted."""
    for r in reqs:
        c = r.cached_tokens
        if c % block_size or c >= len(r.input_ids) or c > len(r.blocks) * block_size or (c and r.prefill_logprobs):
            raise ValueError(f"request {r.id}: {c} cached tokens do not fit its {len(r.input_ids)}-token prompt "
                             f"and {len(r.blocks)} blocks of {block_size}")


def check_adapters(reqs: list[PrefillInput], served: int) -> None:
    """Every request names an adapter slot this shard holds (`served`: slots besides slot 0)."""
    for r in reqs:
        if not 0 <= r.adapter <= served:
            raise ValueError(f"request {r.id}: adapter slot {r.adapter}, this shard has {served} adapter slots")


def adapter_slots(reqs: list[PrefillInput], rows: int, pad: bool = True) -> np.ndarray | None:
    """Each row's adapter slot [rows]; padding rows take none. None where the device runs the batch's
    own shape (no graph to keep static) and no row has an adapter: the adapters' matmuls are skipped."""
    if not pad and not any(r.adapter for r in reqs):
        return None
    out = np.zeros(rows, dtype=np.int64)
    out[:len(reqs)] = [r.adapter for r in reqs]
    return out


def prompt_lens(reqs: list[PrefillInput]) -> np.ndarray:
    return np.array([len(r.input_ids) for r in reqs], dtype=np.int64)


def cached_lens(reqs: list[PrefillInput]) -> np.ndarray:
    return np.array([r.cached_tokens for r in reqs], dtype=np.int64)


def mark_long_rows(positions: np.ndarray, reqs: list[PrefillInput], long_from: int | None, offset: int) -> None:
    """LongRoPE: move the real positions of each row whose whole sequence is longer than `long_from` by
    `offset` (the rotary's table length), which names the long factor set's rows whatever the row's own
    positions (layers/rotary.py, `table_rows`): a chunk below the original length of a longer prompt is
    rotated long, as the whole prompt is. In place; nothing without LongRoPE."""
    if long_from is None:
        return
    for i, r in enumerate(reqs):
        if max(r.sequence_tokens, len(r.input_ids)) > long_from:
            real = len(r.input_ids) - r.cached_tokens
            positions[i, :real] += offset


def long_rope_of(model: torch.nn.Module) -> tuple[int | None, int]:
    """A LongRoPE model's original length and rotary table length (`mark_long_rows`'s arguments); else
    (None, 0)."""
    return next(((m.long_from, m.max_position) for m in model.modules() if getattr(m, "long_from", None)), (None, 0))


def prefill_step_inputs(reqs: list[PrefillInput], tables: np.ndarray, cfg: Config, pad: bool,
                        long_rope: tuple[int | None, int] = (None, 0)) -> StepInputs:
    """A prefill's inputs: over cached blocks where a request has some, from position 0 otherwise; with
    LongRoPE, the rows of prompts longer than the original length marked long (`mark_long_rows`)."""
    build = prefill_context_inputs if any(r.cached_tokens for r in reqs) else prefill_inputs
    step = build(reqs, tables, cfg, pad)
    mark_long_rows(step.args[1], reqs, *long_rope)
    return step


def block_tables(reqs: list[PrefillInput], cfg: Config) -> np.ndarray:
    """Each request's blocks, 0-padded to a multiple of the block step: the batch keeps them."""
    width = buckets.round_up(max(len(r.blocks) for r in reqs), buckets.block_step(cfg))
    tables = np.zeros((len(reqs), width), dtype=np.int64)
    for i, r in enumerate(reqs):
        tables[i, : len(r.blocks)] = r.blocks
    return tables


def _slots(tables: np.ndarray, pos: np.ndarray, real: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each position [n, seq] in its row's blocks; 0 (the padding block) where not `real`."""
    blocks = np.take_along_axis(tables, np.minimum(pos // block_size, tables.shape[1] - 1), 1)
    return np.where(real, blocks * block_size + pos % block_size, 0)


def prefill_inputs(reqs: list[PrefillInput], tables: np.ndarray, cfg: Config, pad: bool = True) -> StepInputs:
    """Every prompt token from position 0: ids, positions, slots [rows, seq], the index of each row's
    last token and its adapter slot [rows]. Bucket: (rows, seq)."""
    n, bs = len(reqs), cfg.device.block_size
    lens = prompt_lens(reqs)
    seq = buckets.prefill_seq_bucket(int(lens.max()), cfg)
    rows = buckets.prefill_batch_bucket(n, seq, cfg)
    bucket = (rows, seq)
    if not pad:
        seq, rows = int(lens.max()), n
    ids = np.zeros((rows, seq), dtype=np.int64)
    for i, r in enumerate(reqs):
        ids[i, : lens[i]] = r.input_ids
    pos = np.arange(seq, dtype=np.int64)
    slots = np.zeros((rows, seq), dtype=np.int64)
    slots[:n] = _slots(tables, np.broadcast_to(pos, (n, seq)), pos[None, :] < lens[:, None], bs)
    last_idx = np.zeros(rows, dtype=np.int64)
    last_idx[:n] = lens - 1
    return StepInputs("prefill", bucket, (ids, np.broadcast_to(pos, (rows, seq)).copy(), slots, last_idx,
                                          adapter_slots(reqs, rows, pad)))


def prefill_context_inputs(reqs: list[PrefillInput], tables: np.ndarray, cfg: Config,
                           pad: bool = True) -> StepInputs:
    """The tokens after each prompt's cached ones, at their positions: ids, positions, slots [rows, seq],
    the last new token's index [rows], the cached blocks [rows, context blocks], the cached token
    count and the adapter slot [rows]. Bucket: (rows, new tokens, context blocks)."""
    n, bs = len(reqs), cfg.device.block_size
    cached = cached_lens(reqs)
    new, context = prompt_lens(reqs) - cached, cached // bs
    seq = buckets.prefill_seq_bucket(int(new.max()), cfg)
    rows = buckets.prefill_batch_bucket(n, seq, cfg)
    ctx = buckets.context_block_bucket(int(context.max()), cfg)
    bucket = (rows, seq, ctx)
    if not pad:
        seq, rows, ctx = int(new.max()), n, int(context.max())
    ids = np.zeros((rows, seq), dtype=np.int64)
    for i, r in enumerate(reqs):
        ids[i, : new[i]] = r.input_ids[cached[i]:]
    j = np.arange(seq, dtype=np.int64)
    pos = cached[:, None] + j[None, :]  # [n, seq]
    real = j[None, :] < new[:, None]
    positions, slots = np.zeros((rows, seq), dtype=np.int64), np.zeros((rows, seq), dtype=np.int64)
    positions[:n] = np.where(real, pos, 0)
    slots[:n] = _slots(tables, pos, real, bs)
    context_tables = np.zeros((rows, ctx), dtype=np.int64)
    cols = min(ctx, tables.shape[1])
    context_tables[:n, :cols] = np.where(np.arange(cols)[None, :] < context[:, None], tables[:, :cols], 0)
    context_lens, last_idx = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    context_lens[:n], last_idx[:n] = cached, new - 1
    return StepInputs("prefill_context", bucket, (ids, positions, slots, last_idx, context_tables, context_lens,
                                                  adapter_slots(reqs, rows, pad)))


def decode_inputs(batch: ShardBatch, cfg: Config, pad: bool = True) -> StepInputs:
    """The next token of each row: ids, positions, slots [rows], the block tables [rows, width] padded to
    the bucket of the longest row, context lengths and adapter slots [rows]; tensors where the batch is,
    no host sync.
    Bucket: (rows, width)."""
    bs, n = cfg.device.block_size, len(batch)
    rows = buckets.decode_batch_bucket(n, cfg)
    longest = int(batch.seq_lens_host.max()) + 1
    width = buckets.decode_block_bucket(longest, cfg)
    bucket = (rows, width)
    if not pad:  # only the rows and blocks in use
        rows, width = n, buckets.ceil_div(longest, bs)
    tables = batch.block_tables
    if tables.shape[1] < width:
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
    tables = tables[:, :width]
    positions = batch.seq_lens
    slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs
    extra = rows - n
    adapters = None if not pad and batch.adapters is None else batch.adapter_slots()  # as in adapter_slots
    if extra:
        zeros = torch.zeros(extra, dtype=torch.long, device=positions.device)
        input_ids = torch.cat([batch.last_ids, zeros])
        positions = torch.cat([positions, zeros])
        slots = torch.cat([slots, zeros])
        adapters = torch.cat([adapters, zeros])
        tables = torch.cat([tables, torch.zeros(extra, width, dtype=torch.long, device=positions.device)])
    else:
        input_ids = batch.last_ids
    return StepInputs("decode", bucket, (input_ids, positions, slots, tables, positions + 1, adapters))


def flat_decode_inputs(batch: ShardBatch, cfg: Config, pad: bool = True) -> StepInputs:
    """The next token of each row: ids, positions and slots [rows], then the flat layout of the blocks the
    rows use (`flat_layout`: block list, block groups [total], bias [total, block size]), laid out on the
    host and moved where the batch is, and the adapter slots [rows]. Bucket: (rows, total blocks)."""
    bs, n = cfg.device.block_size, len(batch)
    rows = buckets.decode_batch_bucket(n, cfg)
    pos = batch.seq_lens_host
    used = int((pos // bs + 1).sum())  # blocks holding each row's pos + 1 tokens
    total = buckets.decode_total_blocks_bucket(used, rows, cfg)
    bucket = (rows, total)
    if not pad:  # no padded rows or blocks
        rows, total = n, used
    tables = batch.block_tables_host
    positions, slots = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    positions[:n] = pos
    slots[:n] = tables[np.arange(n), pos // bs] * bs + pos % bs
    layout = flat_layout(tables, pos + 1, bs, rows, total)
    dev = batch.last_ids.device
    input_ids = batch.last_ids
    adapters = None if not pad and batch.adapters is None else batch.adapter_slots()  # as in adapter_slots
    if rows > n:
        zeros = torch.zeros(rows - n, dtype=torch.long, device=dev)
        input_ids, adapters = torch.cat([input_ids, zeros]), torch.cat([adapters, zeros])
    return StepInputs("decode", bucket, (input_ids, *(torch.from_numpy(a).to(dev) for a in (positions, slots, *layout)),
                                         adapters))


def verify_inputs(batch: ShardBatch, tokens: np.ndarray, cfg: Config, pad: bool = True) -> StepInputs:
    """A speculative step: each row's `tokens` [n, width] (the token the next step feeds, then its drafts;
    -1 past them) at the row's next positions, over its cached ones, as a prefill over cached blocks:
    ids, positions, slots [rows, width], the row's blocks [rows, context blocks], its cached token count
    and adapter slot [rows]. Bucket: (rows, width, context blocks); without padding, the width is the
    longest row's (the positions past it would compute padding only)."""
    bs, n, width = cfg.device.block_size, len(batch), tokens.shape[1]
    cached = batch.seq_lens_host
    rows = buckets.decode_batch_bucket(n, cfg)
    ctx = buckets.verify_context_bucket(int(cached.max()), cfg)
    bucket = (rows, width, ctx)
    if not pad:
        rows, ctx = n, buckets.ceil_div(int(cached.max()), bs)
        width = int((tokens >= 0).sum(axis=1).max())
        tokens = tokens[:, :width]
    real = tokens >= 0
    pos = cached[:, None] + np.arange(width, dtype=np.int64)[None, :]
    ids, positions, slots = (np.zeros((rows, width), dtype=np.int64) for _ in range(3))
    ids[:n], positions[:n] = np.where(real, tokens, 0), np.where(real, pos, 0)
    tables = batch.block_tables_host
    slots[:n] = _slots(tables, pos, real, bs)
    context_tables = np.zeros((rows, ctx), dtype=np.int64)
    cols = min(ctx, tables.shape[1])
    context_tables[:n, :cols] = tables[:, :cols]
    context_lens = np.zeros(rows, dtype=np.int64)
    context_lens[:n] = cached
    adapters = None
    if pad or batch.adapters is not None:
        adapters = np.zeros(rows, dtype=np.int64)
        adapters[:n] = batch.adapter_slots().cpu().numpy()
    return StepInputs("verify", bucket, (ids, positions, slots, context_tables, context_lens, adapters))
