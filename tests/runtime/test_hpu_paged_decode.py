"""Decode on Gaudi attends over the blocks a batch uses, laid out flat: the tokens are those of the plain
CPU path, every (rows, total blocks) shape is compiled at warmup, and serving only replays graphs."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import resolve
from gaudi_runtime.device.base import Backend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.shard.info import info_response
from gaudi_runtime.shard.runner import ModelRunner, PrefillInput
from gaudi_runtime.tools.tiny_model import make_tiny_model

SMALL = {"DTYPE": "float32", "MAX_INPUT_TOKENS": "48", "MAX_TOTAL_TOKENS": "96", "MAX_BATCH_SIZE": "8",
         "MAX_BATCH_PREFILL_TOKENS": "96", "BLOCK_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
         "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"}
# Prompts of 1 to 10 blocks of 4 tokens, several ending inside a block: rows of a step use different block counts.
PROMPT_LENS = [3, 17, 9, 40, 26]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def config(model_dir, **kw):
    return resolve(None, {"MODEL_ID": str(model_dir), **SMALL, **{k: str(v) for k, v in kw.items()}})


def generate(runner: ModelRunner, steps: int = 8, adapters: list[int] | None = None) -> dict[int, list[int]]:
    """Greedy tokens of five requests: two prefills, merged into one batch, one request leaving midway;
    `adapters`: each request's LoRA adapter slot."""
    reqs = [PrefillInput(i, [(7 * i + 13 * j) % 300 + 3 for j in range(n)], SamplingParameters(), 0,
                         list(range(1 + 24 * i, 1 + 24 * (i + 1))), False, adapter=(adapters or [0] * 5)[i])
            for i, n in enumerate(PROMPT_LENS)]
    tokens = {r.id: [] for r in reqs}

    def keep(result):
        for rid, token in zip(result.request_ids, result.sample.next_ids.tolist(), strict=False):
            tokens[rid].append(token)

    keep(runner.prefill(1, reqs[:3]))
    keep(runner.prefill(2, reqs[3:]))
    batch_id, result = runner.decode([(1, [0, 1, 2]), (2, [3, 4])])
    keep(result)
    for step in range(steps):
        ids = [0, 1, 2, 3, 4] if step < steps // 2 else [0, 2, 3, 4]
        batch_id, result = runner.decode([(batch_id, ids)])
        keep(result)
    return tokens


def test_hpu_decode_over_flat_blocks_gives_the_cpu_paths_tokens(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir)
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    assert hpu.flat_decode and "flat paged" in info_response(hpu, 1).attention
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    assert warmed == sum(len(s) for s in (buckets.prefill_buckets(cfg), buckets.prefill_context_buckets(cfg),
                                          buckets.decode_flat_buckets(cfg)))
    assert info_response(hpu, 1).buckets["decode"] == hpu.warmup_summary["decode_shapes"] == len(
        buckets.decode_flat_buckets(cfg))
    fake_hpu["block_softmax_adjustment"].clear()
    on_hpu = generate(hpu)

    assert len(fake_hpu["captures"]) == warmed  # serving compiled nothing
    flat = set(buckets.decode_flat_buckets(cfg))
    for name, shapes in fake_hpu["replays"]:  # ids, positions, slots, then the blocks in use, laid out flat
        if name == "decode":
            (rows,), _, _, (total,), (groups,), bias, (adapter_rows,) = shapes
            assert (rows, total) in flat and groups == total and bias == (total, cfg.device.block_size)
            assert adapter_rows == rows  # each row's LoRA adapter slot: no adapter here
    assert hpu.unwarmed_shapes == 0
    calls = fake_hpu["block_softmax_adjustment"]
    assert len(calls) == 9 * hpu.model.num_layers  # every decode step, every layer, the fused op
    assert {c["batch_size"] for c in calls} == {buckets.decode_batch_bucket(n, cfg) for n in (5, 4)}  # the rows

    cpu = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    assert not cpu.flat_decode
    assert generate(cpu) == on_hpu


def test_hpu_math_fallback_keeps_gathered_decode(fake_hpu, model_dir):
    """USE_FLASH_ATTENTION=false: decode gathers block tables, and warmup compiles the (rows, width)
    shapes it then runs."""
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir, USE_FLASH_ATTENTION="false")
    runner = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    assert not runner.flat_decode
    list(runner.warmup())
    assert info_response(runner, 1).buckets["decode"] == len(buckets.decode_buckets(cfg))
    generate(runner, steps=2)
    assert runner.unwarmed_shapes == 0 and fake_hpu["block_softmax_adjustment"] == []


@pytest.fixture(scope="module")
def lora_dirs(model_dir, tmp_path_factory):
    """Made before the fake Habana modules are installed (peft looks for Intel Neural Compressor)."""
    from tests.runtime.lora_adapters import make_adapter

    return (make_adapter(model_dir, tmp_path_factory.mktemp("a"), seed=1, rank=4),
            make_adapter(model_dir, tmp_path_factory.mktemp("b"), seed=2, rank=2, targets=["q_proj", "down_proj"]))


def test_hpu_graphs_with_lora_adapters_are_those_warmup_captured(lora_dirs, fake_hpu, model_dir):
    """Adapters are padded to --max-lora-rank and selected by a per-row slot, so a batch mixing them
    replays the graphs warmup captured (shapes do not depend on which adapters a batch uses), and
    gives the CPU path's tokens."""
    from gaudi_runtime.device.hpu import HpuBackend

    a, b = lora_dirs
    cfg = config(model_dir, LORA_ADAPTERS=f"a={a},b={b}")
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    slots = [1, 0, 2, 1, 2]
    on_hpu = generate(hpu, adapters=slots)
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0
    cpu = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    assert generate(cpu, adapters=slots) == on_hpu
    assert generate(cpu) != on_hpu  # the adapters change the tokens


def test_adapters_loaded_after_warmup_replay_its_graphs_and_give_the_start_adapters_tokens(lora_dirs, fake_hpu,
                                                                                          model_dir):
    """With runtime LoRA updating every targetable layer has its slots from the start, so writing
    adapters into them after warmup (what the shard's LoadAdapter does) changes no shape: serving
    replays the graphs warmup captured, which read the new weights, and the tokens are those of the
    same adapters given at start."""
    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.models.lora import read_new_adapter, write_adapter

    a, b = lora_dirs
    cfg = config(model_dir, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", MAX_LORAS="2")
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    for slot, (name, path) in enumerate([("a", a), ("b", b)], start=1):
        write_adapter(hpu.model, slot, read_new_adapter(hpu.model, cfg.adapters, str(model_dir), name, str(path)))
    slots = [1, 0, 2, 1, 2]
    on_hpu = generate(hpu, adapters=slots)
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0
    cpu = ModelRunner(config(model_dir, LORA_ADAPTERS=f"a={a},b={b}"), str(model_dir), Backend(torch.device("cpu")))
    assert generate(cpu, adapters=slots) == on_hpu
