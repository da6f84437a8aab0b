"""Which waiting requests join the next prefill: TGI's batching rules as pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gaudi_runtime import buckets
from gaudi_runtime.config import Config, SchedulingConfig


@dataclass(frozen=True)
class Waiting:
    """What the admission rules look at in a waiting request."""

    input_len: int
    max_new_tokens: int
    cached_tokens: int = 0  # prompt tokens cached blocks hold (prefix cache): the prefill computes the rest
    held_blocks: int = 0  # of those blocks, the ones other requests hold: they cost no free block
    chunkable: bool = True  # False: prefilled whole, however long (images, prompt log-probabilities)
    adapter: int = 0  # its LoRA adapter's index (router/adapters.py; 0: none)


# A decode call's steps are bounded so the call lasts about this long: a prompt arriving meanwhile waits
# for the calls already made (PIPELINE_DEPTH of them), so long steps (long contexts, large batches, big
# models) go one per call, and only short ones, where a call's fixed costs show, are grouped.
DECODE_CALL_BUDGET_MS = 20.0


def decode_call_steps(max_steps: int, steps_left: int, step_ms: float | None) -> int:
    """Steps the next decode call runs: at most --decode-steps and what the closest request to its
    limit may still take, and no more than fit DECODE_CALL_BUDGET_MS at the recent step time (None:
    none measured yet)."""
    fit = max_steps if not step_ms else max(1, int(DECODE_CALL_BUDGET_MS // step_ms))
    return max(1, min(max_steps, steps_left, fit))


def chunk_tokens(cfg: Config) -> int:
    """Prompt tokens one chunk of a long prompt computes: --max-batch-prefill-tokens in whole blocks, so
    that every chunk after the first starts on a block boundary (a prefill over cached blocks)."""
    return cfg.scheduling.max_batch_prefill_tokens // cfg.device.block_size * cfg.device.block_size


def chunk_end(done: int, prompt_len: int, cfg: Config) -> int:
    """Where the next chunk of a prompt whose first `done` tokens are in the KV cache ends: the prompt's
    end when the rest fits --max-batch-prefill-tokens (the last chunk), else one chunk further."""
    if prompt_len - done <= cfg.scheduling.max_batch_prefill_tokens:
        return prompt_len
    return done + chunk_tokens(cfg)


def needs_chunks(w: Waiting, cfg: Config) -> bool:
    """Whether a request's prompt is prefilled in chunks: what it computes exceeds one prefill's budget."""
    return w.chunkable and w.input_len - w.cached_tokens > cfg.scheduling.max_batch_prefill_tokens


def blocks_needed(input_len: int, max_new_tokens: int, cfg: Config) -> int:
    """Blocks reserved for a request: its prompt and every token it may generate."""
    return buckets.ceil_div(input_len + max_new_tokens, cfg.device.block_size)


def join_min_size(running: int, waiting_steps: int, oldest_wait_ms: float, cfg: SchedulingConfig) -> int | None:
    """Smallest prefill worth pausing `running` decodes for (None: any size).

    After --max-waiting-tokens decode steps, or once the oldest request has
    waited QUEUE_THRESHOLD_MS, waiting requests go in regardless of size.
    """
    if waiting_steps >= cfg.max_waiting_tokens or oldest_wait_ms >= cfg.queue_threshold_ms:
        return None
    return math.floor(running * cfg.waiting_served_ratio)


def select_prefill(waiting: list[Waiting], running: int, free_blocks: int, cfg: Config,
                   min_size: int | None = None, chunks: bool = True,
                   running_adapters: frozenset[int] = frozenset()) -> int:
    """How many requests from the head of the queue (FIFO) the next prefill takes.

    Limits: --max-batch-size over running + new, the padded prefill shape within
    --max-batch-prefill-tokens (prompt tokens to compute: cached ones are not), and
    the free KV blocks (cached blocks no request holds count as free: taking one
    costs a block as a fresh one does), and --max-loras distinct adapters over the
    running requests (`running_adapters`) and the new ones (the shards' device slots: each
    adapter a request runs with is in one, router/adapter_slots.py). Stops at the first
    request that does not fit, so that no request is overtaken forever. A prompt
    prefilled in chunks goes alone: its first chunk fills the prefill; with
    `chunks` False (one is being chunked already) it waits at the head of the queue.
    """
    room = cfg.scheduling.max_batch_size - running
    taken, longest, blocks = 0, 0, 0
    adapters = set(running_adapters) - {0}
    for w in waiting:
        if taken >= room:
            break
        if w.adapter and w.adapter not in adapters:
            if len(adapters) >= cfg.adapters.max_loras:
                break
            adapters.add(w.adapter)
        if needs_chunks(w, cfg):
            alone = chunks and taken == 0 and blocks_needed(w.input_len, w.max_new_tokens, cfg) - w.held_blocks <= free_blocks
            taken = 1 if alone else taken
            break
        longest_next = max(longest, w.input_len - w.cached_tokens)
        seq = buckets.prefill_seq_bucket(longest_next, cfg)
        if taken + 1 > buckets.max_prefill_batch(seq, cfg):
            break
        need = blocks_needed(w.input_len, w.max_new_tokens, cfg) - w.held_blocks
        if blocks + need > free_blocks:
            break
        taken, longest, blocks = taken + 1, longest_next, blocks + need
    if min_size is not None and taken < min_size:
        return 0
    return taken
