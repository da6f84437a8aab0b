"""A step's inputs as the shard builds them (shard/inputs.py): the bucket each kind of step is padded to,
the positions of its tokens, and the KV-cache slots they write, padding writing to block 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gaudi_runtime.config import resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.batch import ShardBatch
from gaudi_runtime.shard.inputs import (
    PrefillInput,
    block_tables,
    check_adapters,
    check_cached,
    decode_inputs,
    flat_decode_inputs,
    prefill_context_inputs,
    prefill_inputs,
)
from gaudi_runtime.shard.sampling import BatchSampler

# Blocks of 4 tokens; prompts padded to 8 tokens (so block tables to 2 blocks); prefill rows in 2s,
# decode rows in 4s.
CFG = resolve(None, {"MODEL_ID": "/m", "MAX_INPUT_TOKENS": "32", "MAX_TOTAL_TOKENS": "64", "MAX_BATCH_SIZE": "8",
                     "MAX_BATCH_PREFILL_TOKENS": "64", "BLOCK_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "8",
                     "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"})


def request(rid: int, ids: list[int], blocks: list[int], cached: int = 0, logprobs: bool = False) -> PrefillInput:
    return PrefillInput(rid, ids, SamplingParameters(), 0, blocks, logprobs, cached_tokens=cached)


def cached_batch(seq_lens: list[int], tables: list[list[int]], last_ids: list[int]) -> ShardBatch:
    n = len(seq_lens)
    host = np.array(tables, dtype=np.int64)
    return ShardBatch(id=1, request_ids=list(range(n)), block_tables=torch.from_numpy(host.copy()),
                      block_tables_host=host, seq_lens=torch.tensor(seq_lens),
                      seq_lens_host=np.array(seq_lens, dtype=np.int64), last_ids=torch.tensor(last_ids),
                      sampler=BatchSampler([SamplingParameters()] * n, [0] * n, [[1]] * n, 16, "cpu"))


def test_block_tables_hold_each_requests_blocks_zero_padded_to_the_block_step():
    tables = block_tables([request(0, [1] * 5, [3, 7, 9]), request(1, [1], [5])], CFG)
    assert tables.tolist() == [[3, 7, 9, 0], [5, 0, 0, 0]]  # 3 blocks -> a multiple of 2


def test_prefill_pads_rows_and_tokens_to_the_bucket_and_writes_each_token_to_its_block():
    reqs = [request(0, [11, 12, 13, 14, 15], [3, 7]), request(1, [21, 22, 23], [5]), request(2, [31], [6])]
    step = prefill_inputs(reqs, block_tables(reqs, CFG), CFG)
    ids, positions, slots, last_idx, adapters = step.args
    assert step.kind == "prefill" and step.bucket == (4, 8) == ids.shape  # 3 rows -> 4, 5 tokens -> 8
    assert ids.tolist() == [[11, 12, 13, 14, 15, 0, 0, 0], [21, 22, 23, 0, 0, 0, 0, 0],
                            [31, 0, 0, 0, 0, 0, 0, 0], [0] * 8]
    assert positions.tolist() == [list(range(8))] * 4
    assert slots.tolist() == [[12, 13, 14, 15, 28, 0, 0, 0],  # block 3, then block 7
                              [20, 21, 22, 0, 0, 0, 0, 0], [24, 0, 0, 0, 0, 0, 0, 0], [0] * 8]
    assert last_idx.tolist() == [4, 2, 0, 0]
    assert adapters.tolist() == [0, 0, 0, 0]  # no adapter named: none, padding rows included


def test_prefill_on_an_unpadded_device_runs_the_batchs_own_shape_but_names_its_bucket():
    reqs = [request(0, [11, 12, 13, 14, 15], [3, 7]), request(1, [21, 22, 23], [5]), request(2, [31], [6])]
    step = prefill_inputs(reqs, block_tables(reqs, CFG), CFG, pad=False)
    assert step.bucket == (4, 8)
    assert [a.shape for a in step.args[:4]] == [(3, 5), (3, 5), (3, 5), (3,)]
    assert step.args[4] is None  # no adapter and no graph: the adapters' matmuls are skipped
    assert step.args[2].tolist()[0] == [12, 13, 14, 15, 28]


def test_prefill_buckets_grow_with_the_longest_prompt_and_the_row_count():
    reqs = [request(i, [1] * 9, [1 + 3 * i, 2 + 3 * i, 3 + 3 * i]) for i in range(3)]
    assert prefill_inputs(reqs, block_tables(reqs, CFG), CFG).bucket == (4, 16)  # 9 tokens -> 16
    assert prefill_inputs(reqs[:1], block_tables(reqs[:1], CFG), CFG).bucket == (2, 16)


def test_prefill_with_context_computes_only_the_tokens_after_the_cached_blocks():
    reqs = [request(0, list(range(100, 110)), [3, 7, 9], cached=8), request(1, [40, 41, 42, 43, 44], [5, 6], cached=4)]
    step = prefill_context_inputs(reqs, block_tables(reqs, CFG), CFG)
    ids, positions, slots, last_idx, context_tables, context_lens, adapters = step.args
    assert step.kind == "prefill_context" and step.bucket == (2, 8, 2)  # 2 rows, 2 new tokens, 2 cached blocks
    assert ids.tolist() == [[108, 109, 0, 0, 0, 0, 0, 0], [44, 0, 0, 0, 0, 0, 0, 0]]
    assert positions.tolist() == [[8, 9, 0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0]]
    assert slots.tolist() == [[36, 37, 0, 0, 0, 0, 0, 0], [24, 0, 0, 0, 0, 0, 0, 0]]  # blocks 9 and 6
    assert context_tables.tolist() == [[3, 7], [5, 0]]  # the cached blocks only
    assert context_lens.tolist() == [8, 4] and last_idx.tolist() == [1, 0]

    own = prefill_context_inputs(reqs, block_tables(reqs, CFG), CFG, pad=False)
    assert own.bucket == step.bucket
    assert [a.shape for a in own.args[:6]] == [(2, 2), (2, 2), (2, 2), (2,), (2, 2), (2,)] and own.args[6] is None


def test_decode_feeds_each_rows_last_token_at_its_next_position():
    batch = cached_batch([5, 2], [[3, 7, 0, 0], [5, 0, 0, 0]], last_ids=[50, 60])
    step = decode_inputs(batch, CFG)
    input_ids, positions, slots, tables, context_lens, adapters = step.args
    assert step.kind == "decode" and step.bucket == (4, 2)  # 2 rows -> 4; 6 tokens in 2 blocks
    assert input_ids.tolist() == [50, 60, 0, 0]
    assert positions.tolist() == [5, 2, 0, 0]
    assert slots.tolist() == [29, 22, 0, 0]  # block 7 offset 1, block 5 offset 2
    assert tables.tolist() == [[3, 7], [5, 0], [0, 0], [0, 0]]
    assert context_lens.tolist() == [6, 3, 1, 1]
    assert adapters.tolist() == [0, 0, 0, 0]

    own = decode_inputs(batch, CFG, pad=False)
    assert own.bucket == (4, 2) and [a.shape for a in own.args[:5]] == [(2,), (2,), (2,), (2, 2), (2,)]
    assert own.args[5] is None


def test_decode_pads_block_tables_narrower_than_the_bucket():
    batch = cached_batch([9], [[3, 7, 9]], last_ids=[50])
    step = decode_inputs(batch, CFG)
    assert step.bucket == (4, 4)  # 10 tokens in 3 blocks -> 4
    assert step.args[3].tolist()[0] == [3, 7, 9, 0] and step.args[2].tolist()[0] == 37


def test_flat_decode_lays_out_the_blocks_in_use_row_after_row():
    batch = cached_batch([5, 2], [[3, 7, 0, 0], [5, 0, 0, 0]], last_ids=[50, 60])
    step = flat_decode_inputs(batch, CFG)
    input_ids, positions, slots, block_list, block_groups, block_bias, adapters = step.args
    assert step.kind == "decode" and step.bucket == (4, 4)  # 3 blocks in use -> 4
    assert input_ids.tolist() == [50, 60, 0, 0] and positions.tolist() == [5, 2, 0, 0]
    assert slots.tolist() == [29, 22, 0, 0]
    assert block_list.tolist() == [3, 7, 5, 0] and block_groups.tolist() == [0, 0, 1, 4]  # padding: group 4
    assert (block_bias == 0).sum(dim=1).tolist() == [4, 2, 3, 1]  # positions each block holds

    own = flat_decode_inputs(batch, CFG, pad=False)
    assert own.bucket == (4, 4) and own.args[3].tolist() == [3, 7, 5] and own.args[0].tolist() == [50, 60]


@pytest.mark.parametrize("req", [request(0, [1] * 9, [1, 2, 3], cached=3),  # not whole blocks
                                 request(0, [1] * 8, [1, 2], cached=8),  # nothing left to compute
                                 request(0, [1] * 9, [1], cached=8),  # more than its own blocks
                                 request(0, [1] * 9, [1, 2, 3], cached=4, logprobs=True)])
def test_cached_tokens_that_do_not_fit_the_request_are_refused(req):
    with pytest.raises(ValueError, match="cached tokens do not fit"):
        check_cached([req], 4)


def test_each_rows_adapter_slot_goes_with_it_and_padding_rows_take_none():
    reqs = [request(0, [11, 12], [3]), request(1, [21], [5]), request(2, [31], [6])]
    reqs[0].adapter, reqs[2].adapter = 2, 1
    assert prefill_inputs(reqs, block_tables(reqs, CFG), CFG).args[-1].tolist() == [2, 0, 1, 0]
    reqs[0].cached_tokens = 0
    assert check_adapters(reqs, 2) is None
    with pytest.raises(ValueError, match="adapter slot 2"):
        check_adapters(reqs, 1)
    batch = cached_batch([5, 2, 3], [[3, 7], [5, 0], [6, 0]], last_ids=[50, 60, 70])
    batch.adapters = torch.tensor([2, 0, 1])
    kept = batch.filter([2, 0])
    assert kept.adapters.tolist() == [1, 2]
    merged = ShardBatch.concat([kept, cached_batch([4], [[9, 0]], last_ids=[80])])
    assert merged.adapters.tolist() == [1, 2, 0]
    assert decode_inputs(merged, CFG).args[-1].tolist() == [1, 2, 0, 0]
    assert flat_decode_inputs(merged, CFG).args[-1].tolist() == [1, 2, 0, 0]
    assert decode_inputs(merged, CFG, pad=False).args[-1].tolist() == [1, 2, 0]  # some row has one: kept
    assert prefill_inputs(reqs, block_tables(reqs, CFG), CFG, pad=False).args[-1].tolist() == [2, 0, 1]
