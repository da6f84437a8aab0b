"""The Gaudi branch: Intel Neural Compressor's FP8 flow, driven through a recording fake of INC."""

from __future__ import annotations

import json

import pytest
import torch

from gaudi_runtime.config import resolve
from gaudi_runtime.quant.calibrate import measure
from gaudi_runtime.quant.config import load_quant_config
from gaudi_runtime.quant.fp8_linear import is_fp8
from gaudi_runtime.quant.setup import quantize_loaded
from gaudi_runtime.quant.stats import read_stats
from tests.fake_modules import load_fake
from tests.unit.test_quant_config import tiny_llama


@pytest.fixture
def fake_inc(monkeypatch):
    """The recording neural_compressor fake, importable for this test only; rank variables restored after."""
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    yield from load_fake(monkeypatch, "neural_compressor", "neural_compressor.torch.quantization")


def gaudi():
    """The HPU backend over the recording bridge (`fake_hpu`), its tensors on the host."""
    from gaudi_runtime.device.hpu import HpuBackend

    return HpuBackend(torch_device=torch.device("cpu"))


def quant_json(tmp_path, mode: str) -> tuple[str, dict]:
    raw = {"method": "HOOKS", "mode": mode, "observer": "maxabs", "scale_method": "maxabs_hw",
           "blocklist": {"types": [], "names": ["lm_head"]}, "dump_stats_path": str(tmp_path / "hqt" / "measure")}
    path = tmp_path / f"{mode.lower()}.json"
    path.write_text(json.dumps(raw))
    return str(path), raw


def test_measure_prepares_runs_the_prompts_and_finalizes_per_rank(fake_inc, tmp_path):
    path, raw = quant_json(tmp_path, "MEASURE")
    model = tiny_llama()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    assert measure(model, prompts, load_quant_config(path), with_inc=True, device="cpu", rank=1, world_size=2) is None
    stats = str(tmp_path / "hqt" / "measure_hooks_maxabs_1_2.json")
    assert fake_inc == [("from_json_file", path), ("FP8Config", raw), ("prepare", "MEASURE", stats),
                        ("finalize_calibration", stats, len(prompts))]
    assert "lm_head" in read_stats(tmp_path / "hqt" / "measure", rank=1, world_size=2)  # our reader reads INC's


@pytest.mark.parametrize("world_size", [1, 2])
def test_quantize_converts_with_the_json_and_each_rank_reads_its_own_file(fake_inc, fake_hpu, tmp_path, world_size):
    path, raw = quant_json(tmp_path, "QUANTIZE")
    (tmp_path / "hqt").mkdir()
    names = ["measure_hooks_maxabs.json"] if world_size == 1 else [
        f"measure_hooks_maxabs_{r}_{world_size}.json" for r in range(world_size)]
    for name in names:
        (tmp_path / "hqt" / name).write_text(json.dumps({"Nodes": {}}))
    cfg = resolve(None, {"MODEL_ID": str(tmp_path), "DEVICE": "hpu", "QUANT_CONFIG": path,
                         "NUM_SHARD": str(world_size)})
    rank = world_size - 1
    model = tiny_llama()
    served = quantize_loaded(model, cfg, gaudi(), torch.bfloat16, rank, world_size)
    assert served._inc_converted and not any(is_fp8(m) for m in served.modules())  # INC's layers, not ours
    assert fake_inc == [("from_json_file", path), ("FP8Config", raw),
                        ("convert", "QUANTIZE", str(tmp_path / "hqt" / names[rank]))]
    assert not any(call[0] == "prepare" for call in fake_inc)


def test_bare_quantize_flag_on_gaudi_hands_inc_the_default_config(fake_inc, fake_hpu, tmp_path):
    cfg = resolve(None, {"MODEL_ID": str(tmp_path), "DEVICE": "hpu", "QUANTIZE": "fp8", "NUM_SHARD": "1"})
    quantize_loaded(tiny_llama(), cfg, gaudi(), torch.bfloat16)
    assert fake_inc == [("FP8Config", {"method": "HOOKS", "mode": "QUANTIZE", "observer": "maxabs",
                                       "scale_method": "unit_scale"}), ("convert", "QUANTIZE", None)]
