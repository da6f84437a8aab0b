"""Static shapes: which padded shape a batch runs on (pure; router and shards agree).

Every forward pass runs on a shape from a finite set computed from the
configuration alone, so that warmup can compile each one before serving.
"""

from __future__ import annotations

from gaudi_runtime.config import Config


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def prefill_seq_bucket(max_len: int, cfg: Config) -> int:
    """Padded prompt length for a prefill whose longest prompt has max_len tokens."""
    cap = round_up(cfg.max_input_tokens, cfg.pad_sequence_to_multiple_of)
    return min(round_up(max_len, cfg.pad_sequence_to_multiple_of), cap)


def max_prefill_batch(seq: int, cfg: Config) -> int:
    """Most prompts of padded length `seq` one prefill may hold (at least one)."""
    return max(1, min(cfg.max_batch_size, cfg.max_batch_prefill_tokens // seq))


def prefill_batch_bucket(n: int, seq: int, cfg: Config) -> int:
    return min(round_up(n, cfg.prefill_batch_bucket_size), max_prefill_batch(seq, cfg))


def decode_batch_bucket(n: int, cfg: Config) -> int:
    return min(round_up(n, cfg.batch_bucket_size), round_up(cfg.max_batch_size, cfg.batch_bucket_size))


def blocks_per_sequence(cfg: Config) -> int:
    return ceil_div(cfg.max_total_tokens, cfg.block_size)


def block_step(cfg: Config) -> int:
    """Block-count buckets grow in steps that cover PAD_SEQUENCE_TO_MULTIPLE_OF tokens."""
    return max(1, cfg.pad_sequence_to_multiple_of // cfg.block_size)


def decode_block_bucket(max_context: int, cfg: Config) -> int:
    """Block-table width for a decode step whose longest sequence holds max_context tokens."""
    need = ceil_div(max_context, cfg.block_size)
    return min(round_up(need, block_step(cfg)), round_up(blocks_per_sequence(cfg), block_step(cfg)))


def prefill_buckets(cfg: Config) -> list[tuple[int, int]]:
    """Every (batch, seq) shape a prefill may run on."""
    shapes = set()
    for seq in range(cfg.pad_sequence_to_multiple_of, prefill_seq_bucket(cfg.max_input_tokens, cfg) + 1,
                     cfg.pad_sequence_to_multiple_of):
        top = max_prefill_batch(seq, cfg)
        for n in range(1, top + 1):
            shapes.add((prefill_batch_bucket(n, seq, cfg), seq))
    return sorted(shapes)


def decode_buckets(cfg: Config) -> list[tuple[int, int]]:
    """Every (batch, blocks) shape a decode step may run on."""
    batches = sorted({decode_batch_bucket(n, cfg) for n in range(1, cfg.max_batch_size + 1)})
    step = block_step(cfg)
    top = decode_block_bucket(cfg.max_total_tokens, cfg)
    return [(b, nb) for b in batches for nb in range(step, top + 1, step)]
