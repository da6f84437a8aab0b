"""Gemma 2 on Gaudi (the recording fake): its local layers decode over the flat block layout with the
window's bias and soft-capped scores, prefill under the window's mask, warmup compiles every shape serving
runs, and the tokens are the plain CPU path's (gathered decode), on prompts of up to five windows."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.test_hpu_paged_decode import PROMPT_LENS, config, generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma2"), "gemma2")
    randomize_vectors(path)
    return path


def test_windowed_layers_decode_over_flat_blocks_as_the_cpu_path(fake_hpu, model_dir):
    from gaudi_runtime.device.hpu import HpuBackend

    cfg = config(model_dir)
    hpu = ModelRunner(cfg, str(model_dir), HpuBackend(torch_device=torch.device("cpu")))
    windows = [layer.self_attn.attn.window for layer in hpu.model.model.layers]
    assert hpu.flat_decode and windows == [8, None] and max(PROMPT_LENS) > 4 * windows[0]
    list(hpu.warmup())
    warmed = len(fake_hpu["captures"])
    fake_hpu["block_softmax_adjustment"].clear()
    on_hpu = generate(hpu)
    assert len(fake_hpu["captures"]) == warmed and hpu.unwarmed_shapes == 0  # serving compiled nothing
    assert len(fake_hpu["block_softmax_adjustment"]) == 9 * hpu.model.num_layers
    cpu = ModelRunner(cfg, str(model_dir), Backend(torch.device("cpu")))
    assert generate(cpu) == on_hpu
