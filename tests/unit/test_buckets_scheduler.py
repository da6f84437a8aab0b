import pytest

from gaudi_runtime import buckets
from gaudi_runtime.config import resolve
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.scheduler import Waiting, blocks_needed, join_min_size, select_prefill


def cfg(**kw):
    e = {"MODEL_ID": "/m", "MAX_TOTAL_TOKENS": 512, "MAX_INPUT_TOKENS": 256, "MAX_BATCH_PREFILL_TOKENS": 512,
         "MAX_BATCH_SIZE": 16, "PAD_SEQUENCE_TO_MULTIPLE_OF": 64, "BATCH_BUCKET_SIZE": 4,
         "PREFILL_BATCH_BUCKET_SIZE": 2, "BLOCK_SIZE": 16}
    e.update(kw)
    return resolve(None, {k: str(v) for k, v in e.items()})


def test_prefill_shapes_are_padded_and_within_budget():
    c = cfg()
    assert buckets.prefill_seq_bucket(1, c) == 64
    assert buckets.prefill_seq_bucket(65, c) == 128
    assert buckets.prefill_seq_bucket(256, c) == 256
    assert buckets.prefill_batch_bucket(3, 64, c) == 4
    # a single long prompt may exceed the bucket's padding but never the budget
    assert buckets.prefill_batch_bucket(1, 256, c) == 2
    for rows, seq in buckets.prefill_buckets(c):
        assert rows * seq <= c.scheduling.max_batch_prefill_tokens


def test_every_reachable_shape_is_in_the_bucket_set():
    c = cfg()
    pre = set(buckets.prefill_buckets(c))
    for n in range(1, 9):
        for length in range(1, c.limits.max_input_tokens + 1, 7):
            seq = buckets.prefill_seq_bucket(length, c)
            if n <= buckets.max_prefill_batch(seq, c):
                assert (buckets.prefill_batch_bucket(n, seq, c), seq) in pre
    dec = set(buckets.decode_buckets(c))
    for n in range(1, c.scheduling.max_batch_size + 1):
        for ctx in range(1, c.limits.max_total_tokens + 1, 13):
            assert (buckets.decode_batch_bucket(n, c), buckets.decode_block_bucket(ctx, c)) in dec


@pytest.mark.parametrize("exponential", ["false", "true"])
def test_every_reachable_flat_decode_shape_is_in_the_bucket_set(exponential):
    """A flat decode step of n rows uses n to n * blocks_per_sequence blocks in all: every such total, on
    every rows bucket, lands on a warmed (rows, total blocks) shape that holds it."""
    c = cfg(EXPONENTIAL_BUCKETING=exponential)
    flat = buckets.decode_flat_buckets(c)
    assert len(flat) == len(set(flat))
    per_row, reached = buckets.blocks_per_sequence(c), set()
    for n in range(1, c.scheduling.max_batch_size + 1):
        rows = buckets.decode_batch_bucket(n, c)
        for used in range(n, n * per_row + 1):
            total = buckets.decode_total_blocks_bucket(used, rows, c)
            assert total >= used and (rows, total) in flat
            reached.add((rows, total))
    assert reached == set(flat)  # and none is warmed in vain here
    # totals grow exponentially: a few shapes per rows bucket, none below what its rows use
    for rows in {r for r, _ in flat}:
        totals = sorted(t for r, t in flat if r == rows)
        assert len(totals) <= 2 + (rows * buckets.decode_block_cap(c)).bit_length()
        assert totals[-1] == rows * buckets.decode_block_cap(c)


def test_scheduler_respects_batch_size_prefill_budget_and_blocks():
    c = cfg()
    w = [Waiting(input_len=60, max_new_tokens=20)] * 20
    # 64-token prompts: 512 // 64 = 8 fit one prefill
    assert select_prefill(w, running=0, free_blocks=1000, cfg=c) == 8
    assert select_prefill(w, running=14, free_blocks=1000, cfg=c) == 2
    per = blocks_needed(60, 20, c)
    assert per == 5
    assert select_prefill(w, running=0, free_blocks=3 * per + 4, cfg=c) == 3


def test_scheduler_is_fifo_and_honours_min_size():
    c = cfg()
    w = [Waiting(10, 10), Waiting(250, 200), Waiting(10, 10)]
    # the long one does not fit beside the first in blocks: stop there, do not skip it
    assert select_prefill(w, running=0, free_blocks=blocks_needed(10, 10, c) + 1, cfg=c) == 1
    assert select_prefill(w[:1], running=10, free_blocks=100, cfg=c, min_size=3) == 0


def test_join_min_size_follows_tgi():
    c = cfg(MAX_WAITING_TOKENS=20, WAITING_SERVED_RATIO=0.5, QUEUE_THRESHOLD_MS=100)
    assert join_min_size(running=10, waiting_steps=3, oldest_wait_ms=0, cfg=c.scheduling) == 5
    assert join_min_size(running=10, waiting_steps=20, oldest_wait_ms=0, cfg=c.scheduling) is None
    assert join_min_size(running=10, waiting_steps=3, oldest_wait_ms=150, cfg=c.scheduling) is None


def test_block_allocator_never_hands_out_block_zero_and_gets_everything_back():
    a = BlockAllocator(10)
    got = a.allocate(4) + a.allocate(6)
    assert sorted(got) == list(range(1, 11))
    with pytest.raises(ValueError):
        a.allocate(1)
    a.free(got[:4])
    a.free(got[4:])
    assert a.free_count == 10
