"""A long prompt's chunk riding a decode step (`ModelRunner.decode_with`): every row gets the tokens it gets
when the chunk's pass and the step run one after the other. On the CPU both share one forward pass (the
first chunk over no cached blocks, the next ones over the chunks before them, the last one kept as a batch
that decodes on); beside a speculative step, and on Gaudi (the recording fake), they stay two passes, on
Gaudi each on a shape warmup ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gaudi_runtime.config import resolve
from gaudi_runtime.device.base import Backend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.runner import ModelRunner, PrefillInput
from gaudi_runtime.shard.speculation import DraftRows
from gaudi_runtime.tools.tiny_model import make_tiny_model

SMALL = {"DTYPE": "float32", "MAX_INPUT_TOKENS": "48", "MAX_TOTAL_TOKENS": "96", "MAX_BATCH_SIZE": "8",
         "MAX_BATCH_PREFILL_TOKENS": "16", "BLOCK_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
         "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"}
RUNNING = [5, 11, 3]  # the prompt lengths of the requests decoding while the long prompt is chunked
LONG = 40  # chunks of 16, 16 and 8 tokens


@pytest.fixture(scope="module", params=["llama", "gemma2"])  # gemma2: windowed, soft-capped layers
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 300 + 3 for j in range(n)]


def blocks(i: int) -> list[int]:
    return list(range(1 + 24 * i, 1 + 24 * (i + 1)))


def chunk(start: int, end: int) -> PrefillInput:
    return PrefillInput(9, prompt(9, LONG)[:end], SamplingParameters(), 0, blocks(4), False, cached_tokens=start,
                        sequence_tokens=LONG)


def serve(runner: ModelRunner, ride: bool) -> tuple[dict[int, list[int]], list[bool]]:
    """Greedy tokens of three running requests and of a long prompt chunked while they decode (each chunk
    riding a step, or prefilled before it), then four steps of all of them; and whether each ride shared
    its step's pass."""
    reqs = [PrefillInput(i, prompt(i, n), SamplingParameters(), 0, blocks(i), False) for i, n in enumerate(RUNNING)]
    tokens: dict[int, list[int]] = {i: [] for i in [*range(len(RUNNING)), 9]}
    shared = []

    def keep(result) -> None:
        for rid, token in zip(result.request_ids, result.sample.next_ids.tolist(), strict=False):
            tokens[rid].append(token)

    for r in reqs:  # one a prefill: the budget of 16 tokens holds one prompt
        keep(runner.prefill(1 + r.id, [r]))
    ids = [r.id for r in reqs]
    running = [(1 + r.id, [r.id]) for r in reqs]
    for n, (start, end) in enumerate([(0, 16), (16, 32), (32, LONG)]):
        if ride:
            batch_id, step, chunked, together = runner.decode_with(running, 10 + n, [chunk(start, end)])
            shared.append(together)
        else:
            chunked = runner.prefill(10 + n, [chunk(start, end)])
            batch_id, step = runner.decode(running)
        running = [(batch_id, ids)]
        keep(step)
        if end < LONG:
            runner.clear(10 + n)  # a chunk before the last: its token is not the prompt's
        else:
            keep(chunked)
    running.append((12, [9]))
    for _ in range(4):
        batch_id, step = runner.decode(running)
        keep(step)
        running = [(batch_id, [*ids, 9])]
    return tokens, shared


def test_a_chunk_in_a_decode_steps_pass_gives_every_row_its_tokens(model_dir):
    cfg = resolve(None, {"MODEL_ID": str(model_dir), **SMALL})
    runner = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    alone, _ = serve(runner, ride=False)
    together, shared = serve(runner, ride=True)
    assert shared == [True, True, True]
    assert together == alone
    assert [len(t) for t in together.values()] == [8, 8, 8, 5]


def test_a_chunk_beside_a_speculative_step_gives_every_row_its_tokens(model_dir, monkeypatch):
    """A step whose rows draft (--speculate) verifies its drafts in its own pass, after the chunk's. Every
    row drafts a token at every step here (mostly rejected: verification keeps the greedy tokens)."""
    def every_row_drafts(rows, k, max_rows, constrained=(), long_from=None):
        plan = np.full((len(rows.rows), k + 1), -1, dtype=np.int64)
        plan[:, 0], plan[:, 1] = [row.tokens()[-1] for row in rows.rows], 5
        return plan

    monkeypatch.setattr(DraftRows, "plan", every_row_drafts)
    cfg = resolve(None, {"MODEL_ID": str(model_dir), **SMALL, "SPECULATE": "3"})
    runner = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    alone, _ = serve(runner, ride=False)
    together, shared = serve(runner, ride=True)
    assert shared == [False, False, False]
    assert together == alone


def test_on_gaudi_a_ridden_chunk_is_its_own_warmed_pass(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = resolve(None, {"MODEL_ID": str(model_dir), **SMALL})
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    on_hpu, shared = serve(hpu, ride=True)
    assert shared == [False, False, False]
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0  # serving compiled nothing
    cpu = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    assert serve(cpu, ride=True)[0] == on_hpu
