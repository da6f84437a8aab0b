"""FP8 checkpoints as published (compressed-tensors, block-scaled) served by `gaudi-serve launch`.

Each served answer must be the greedy output of `transformers` loading the same checkpoint (the
libraries dequantize it: compressed-tensors, transformers' FineGrainedFP8), 16 of 16 tokens, on a tiny
Llama, Gemma, Qwen3-MoE and DeepSeek-V3, with 1 and 2 shards; /info says which format was loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.family_parity import PROMPTS, served_ids_and_info
from tests.runtime.launched import free_port
from tests.runtime.prequantized import reference_model, write_block_fp8, write_compressed_tensors_fp8

pytestmark = pytest.mark.slow

# (family, format, shards): every format with 2 shards on Llama; Gemma with 1 and 2; block FP8 as Qwen3-MoE
# and DeepSeek-V3 publish it (float8 experts; DeepSeek's MLA projections too, kv_b_proj dequantized at
# load), 1 and 2 shards each: their dense layers stand for a dense model on 1 shard.
CASES = [("llama", "ct-channel", 2), ("llama", "ct-tensor-static", 2), ("llama", "block", 2),
         ("gemma", "ct-channel", 1), ("gemma", "block", 2), ("qwen3_moe", "block", 1), ("qwen3_moe", "block", 2),
         ("deepseek_v3", "block", 1), ("deepseek_v3", "block", 2)]
NEW_TOKENS = 16


def write(model_dir, fmt: str):
    if fmt == "block":
        return write_block_fp8(model_dir)
    strategy = "channel" if "channel" in fmt else "tensor"
    return write_compressed_tensors_fp8(model_dir, strategy, static=fmt.endswith("static"))


def reference_ids(model_dir, prompts: list[str]) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = reference_model(model_dir)
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("family,fmt,shards", CASES, ids=[f"{f}-{q}-{n}shards" for f, q, n in CASES])
def test_served_greedy_tokens_match_transformers(family, fmt, shards, tmp_path):
    model_dir = write(make_tiny_model(tmp_path / "model", family), fmt)
    prompts = PROMPTS[:3]
    expected = reference_ids(model_dir, prompts)
    got, code, info = served_ids_and_info(model_dir, tmp_path / "run", shards, prompts, NEW_TOKENS)
    assert got == expected
    assert all(len(ids) == NEW_TOKENS for ids in got)
    assert code == 200
    name = "block FP8" if fmt == "block" else "compressed-tensors FP8"
    assert name in info["quantization"], info["quantization"]


def test_bad_checkpoints_stop_the_start_with_one_line(tmp_path):
    """An unknown quant_method, a GPTQ bit width not served, a missing scale: `launch` exits 2 with one
    error line naming it, before any shard starts (nothing half-loaded serves)."""
    from safetensors.torch import load_file, save_file

    model_dir = write_block_fp8(make_tiny_model(tmp_path / "model", "llama"))
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")

    def launch_error(config: dict, drop: str | None = None) -> str:
        (model_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
        save_file({k: v for k, v in tensors.items() if k != drop}, model_dir / "model.safetensors")
        r = subprocess.run([sys.executable, "-m", "gaudi_runtime.cli", "launch", "--model-id", str(model_dir),
                            "--device", "cpu", "--port", str(free_port())], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "launching" not in r.stderr, r.stderr  # no shard was started
        return errors[0]

    assert "quant_method: 'bitnet' is not a format" in launch_error({"quant_method": "bitnet"})
    assert "bits: 3-bit GPTQ is not served" in launch_error({"quant_method": "gptq", "bits": 3, "group_size": 128})
    assert "model.layers.0.mlp.up_proj.weight_scale_inv is missing" in launch_error(
        cfg["quantization_config"], drop="model.layers.0.mlp.up_proj.weight_scale_inv")
