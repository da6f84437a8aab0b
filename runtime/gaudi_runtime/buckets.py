"""Static shapes: which padded shape a batch runs on (pure; router and shards agree).

Every forward pass runs on a shape from a finite set computed from the
configuration alone, so that warmup can compile each one before serving.
Buckets grow linearly in steps (TGI-Gaudi's BATCH_BUCKET_SIZE,
PREFILL_BATCH_BUCKET_SIZE, PAD_SEQUENCE_TO_MULTIPLE_OF) or, with
EXPONENTIAL_BUCKETING, as step * 2^k (as vLLM on Gaudi), which keeps the count
logarithmic for long contexts at the cost of more padding.

A prefill whose prompts start with cached blocks (prefix caching) has a third
dimension, the cached blocks its new tokens attend to; those buckets always grow
exponentially, so that they multiply the prefill shapes by a few only.

Where decode attends over the blocks in use laid out flat (HPU,
`layers/flat_paged_attention.py`), a decode step's second dimension is the
batch's total blocks instead of its widest row; those buckets also grow
exponentially, up to what the rows bucket can hold.
"""

from __future__ import annotations

from gaudi_runtime.config import Config


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bucket(x: int, step: int, cap: int, exponential: bool) -> int:
    """Smallest bucket >= x: a multiple of `step` (or step * 2^k), never above `cap`."""
    if not exponential:
        return min(round_up(x, step), cap)
    b = step
    while b < x:
        b *= 2
    return min(b, cap)


def bucket_values(step: int, cap: int, exponential: bool) -> list[int]:
    """Every value `bucket` can return for 1 <= x <= cap."""
    return sorted({bucket(x, step, cap, exponential) for x in _probe_points(step, cap, exponential)})


def _probe_points(step: int, cap: int, exponential: bool) -> list[int]:
    if not exponential:
        return list(range(1, cap + 1, step)) + [cap]
    points, b = [1], step
    while b < cap:
        points.append(b + 1)
        b *= 2
    return points + [cap]


def prefill_seq_cap(cfg: Config) -> int:
    return round_up(cfg.limits.max_input_tokens, cfg.device.pad_sequence_to_multiple_of)


def prefill_seq_bucket(max_len: int, cfg: Config) -> int:
    """Padded prompt length for a prefill whose longest prompt has max_len tokens."""
    return bucket(max_len, cfg.device.pad_sequence_to_multiple_of, prefill_seq_cap(cfg),
                  cfg.device.exponential_bucketing)


def max_prefill_batch(seq: int, cfg: Config) -> int:
    """Most prompts of padded length `seq` one prefill may hold (at least one)."""
    return max(1, min(cfg.scheduling.max_batch_size, cfg.scheduling.max_batch_prefill_tokens // seq))


def prefill_batch_bucket(n: int, seq: int, cfg: Config) -> int:
    return bucket(n, cfg.device.prefill_batch_bucket_size, max_prefill_batch(seq, cfg),
                  cfg.device.exponential_bucketing)


def decode_batch_cap(cfg: Config) -> int:
    return round_up(cfg.scheduling.max_batch_size, cfg.device.batch_bucket_size)


def decode_batch_bucket(n: int, cfg: Config) -> int:
    return bucket(n, cfg.device.batch_bucket_size, decode_batch_cap(cfg), cfg.device.exponential_bucketing)


def blocks_per_sequence(cfg: Config) -> int:
    return ceil_div(cfg.limits.max_total_tokens, cfg.device.block_size)


def block_step(cfg: Config) -> int:
    """Block-count buckets grow in steps that cover PAD_SEQUENCE_TO_MULTIPLE_OF tokens."""
    return max(1, cfg.device.pad_sequence_to_multiple_of // cfg.device.block_size)


def decode_block_cap(cfg: Config) -> int:
    return round_up(blocks_per_sequence(cfg), block_step(cfg))


def decode_block_bucket(max_context: int, cfg: Config) -> int:
    """Block-table width for a decode step whose longest sequence holds max_context tokens."""
    need = ceil_div(max_context, cfg.device.block_size)
    return bucket(need, block_step(cfg), decode_block_cap(cfg), cfg.device.exponential_bucketing)


def prefill_buckets(cfg: Config) -> list[tuple[int, int]]:
    """Every (batch, seq) shape a prefill may run on."""
    shapes = set()
    exp = cfg.device.exponential_bucketing
    seqs = bucket_values(cfg.device.pad_sequence_to_multiple_of, prefill_seq_cap(cfg), exp)
    for seq in seqs:
        for rows in bucket_values(cfg.device.prefill_batch_bucket_size, max_prefill_batch(seq, cfg), exp):
            shapes.add((rows, seq))
    return sorted(shapes)


def decode_buckets(cfg: Config) -> list[tuple[int, int]]:
    """Every (batch, blocks) shape a decode step may run on."""
    exp = cfg.device.exponential_bucketing
    batches = bucket_values(cfg.device.batch_bucket_size, decode_batch_cap(cfg), exp)
    widths = bucket_values(block_step(cfg), decode_block_cap(cfg), exp)
    return [(b, w) for b in batches for w in widths]


def decode_total_blocks_cap(rows: int, cfg: Config) -> int:
    """Most blocks `rows` rows of a flat decode step can use: each at most a whole sequence's."""
    return rows * decode_block_cap(cfg)


def decode_total_blocks_bucket(total: int, rows: int, cfg: Config) -> int:
    """Padded block count of a flat decode step on the rows bucket `rows` whose rows use `total` blocks."""
    return bucket(total, block_step(cfg), decode_total_blocks_cap(rows, cfg), exponential=True)


def decode_flat_buckets(cfg: Config) -> list[tuple[int, int]]:
    """Every (batch, total blocks) shape a flat decode step may run on. A rows bucket holds more rows than
    the one below it, each using a block at least, so totals below that never occur and are left out."""
    shapes, fewest = [], 1
    exp = cfg.device.exponential_bucketing
    for rows in bucket_values(cfg.device.batch_bucket_size, decode_batch_cap(cfg), exp):
        totals = bucket_values(block_step(cfg), decode_total_blocks_cap(rows, cfg), exponential=True)
        shapes += [(rows, total) for total in totals if total >= fewest]
        fewest = rows + 1
    return shapes


def context_block_cap(cfg: Config) -> int:
    """Most cached blocks a prompt may start with: the block of its last token is always computed."""
    return max(1, (cfg.limits.max_input_tokens - 1) // cfg.device.block_size)


def context_block_bucket(blocks: int, cfg: Config) -> int:
    """Context width (in blocks) of a prefill whose longest cached part spans `blocks` blocks."""
    return bucket(blocks, block_step(cfg), context_block_cap(cfg), exponential=True)


def chunks_prompts(cfg: Config) -> bool:
    """Whether a prompt may be longer than one prefill's budget, and so be prefilled in chunks."""
    return cfg.limits.max_input_tokens > cfg.scheduling.max_batch_prefill_tokens


def prefill_context_buckets(cfg: Config) -> list[tuple[int, int, int]]:
    """Every (batch, seq, context blocks) shape a prefill with cached blocks may run on: a prefix-cache
    hit's, or a chunk's after a long prompt's first (none without either). Rows and new tokens are
    bucketed as in any prefill."""
    if not (cfg.scheduling.prefix_caching or chunks_prompts(cfg)):
        return []
    widths = bucket_values(block_step(cfg), context_block_cap(cfg), exponential=True)
    return [(rows, seq, w) for rows, seq in prefill_buckets(cfg) for w in widths]


# Speculation drafts only in batches of at most this many rows: a pass over several tokens per row costs
# about what one token per row does only while reading the weights dominates the step
# (docs/performance.md, "N-gram speculation").
SPECULATION_MAX_ROWS = 4


def speculation_rows(cfg: Config) -> int:
    """The rows bucket of the largest speculative step (0 without --speculate): the decode bucket that
    holds SPECULATION_MAX_ROWS rows."""
    if not cfg.scheduling.speculate:
        return 0
    return decode_batch_bucket(min(SPECULATION_MAX_ROWS, decode_batch_cap(cfg)), cfg)


def verify_context_bucket(tokens: int, cfg: Config) -> int:
    """Context width (in blocks) of a speculative step whose longest row has `tokens` cached tokens."""
    blocks = ceil_div(tokens, cfg.device.block_size)
    return bucket(blocks, block_step(cfg), decode_block_cap(cfg), exponential=True)


def verify_buckets(cfg: Config) -> list[tuple[int, int, int]]:
    """Every (batch, 1 + drafts, context blocks) shape a speculative step may run on: decode's rows up to
    `speculation_rows`, every draft padded to --speculate, a context as long as a whole sequence."""
    if not cfg.scheduling.speculate:
        return []
    exp = cfg.device.exponential_bucketing
    batches = bucket_values(cfg.device.batch_bucket_size, speculation_rows(cfg), exp)
    widths = bucket_values(block_step(cfg), decode_block_cap(cfg), exponential=True)
    return [(b, cfg.scheduling.speculate + 1, w) for b in batches for w in widths]


def warmup_plan(cfg: Config, flat_decode: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The shapes warmup runs, phase by phase: what the shards warm and what the operator expects (one
    implementation, pure, no torch, so the operator image imports it without the runtime's dependencies)."""
    decode = decode_flat_buckets(cfg) if flat_decode else decode_buckets(cfg)
    plan = [("prefill", prefill_buckets(cfg)), ("prefill_context", prefill_context_buckets(cfg)), ("decode", decode)]
    return plan + [("verify", verify_buckets(cfg))] if cfg.scheduling.speculate else plan


def warmup_shape_count(cfg: Config, flat_decode: bool) -> int:
    """How many shapes warmup runs when it runs (WARMUP_ENABLED is the caller's: it changes no bucket, so the
    recipe cache's key, made of what this module reads, leaves it out)."""
    return sum(len(shapes) for _, shapes in warmup_plan(cfg, flat_decode))
