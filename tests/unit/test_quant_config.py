"""QUANT_CONFIG as a user writes it: INC's JSON is accepted, anything wrong fails at start naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

from gaudi_runtime import cli
from gaudi_runtime.config import ConfigError, resolve
from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.models.llama import LlamaConfig, LlamaForCausalLM
from gaudi_runtime.quant.apply import quantize_model
from gaudi_runtime.quant.config import check_quant_config, load_quant_config, parse_quant_config
from gaudi_runtime.quant.layers import select_layers
from gaudi_runtime.quant.stats import NodeStats, read_stats, stats_file, write_stats

TGI_GAUDI_QUANT = {"method": "HOOKS", "mode": "QUANTIZE", "observer": "maxabs", "scale_method": "maxabs_hw",
                   "allowlist": {"types": [], "names": []}, "blocklist": {"types": [], "names": ["lm_head"]},
                   "dump_stats_path": "./hqt_output/measure", "dump_stats_xlsx_path": "./hqt_output/m.xlsx"}


def tiny_llama(**over) -> LlamaForCausalLM:
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, **over)
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg, "LlamaForCausalLM"), TPContext(), torch.float32, "cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


def write(tmp_path, obj, name="q.json") -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def env(model_dir, **kw):
    return {"MODEL_ID": str(model_dir), "DEVICE": "cpu", **kw}


def start(environ):
    """What `launch` checks before starting anything."""
    cfg = resolve(None, environ)
    check_quant_config(cfg)
    return cfg


def test_tgi_gaudi_config_is_accepted_and_relative_dump_path_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    qc = load_quant_config(write(tmp_path, {**TGI_GAUDI_QUANT, "mode": "MEASURE"}))
    assert qc.mode == "MEASURE" and qc.blocklist.names == ("lm_head",)
    assert qc.dump_stats_path == str(tmp_path / "hqt_output" / "measure")
    assert qc.raw["dump_stats_xlsx_path"] == "./hqt_output/m.xlsx"  # INC's own keys travel to INC untouched


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"mode": "CALIBRATE"}), "mode 'CALIBRATE' is not one of MEASURE, QUANTIZE"),
    (json.dumps({"observer": "minmax"}), "observer 'minmax' is not supported"),
    (json.dumps({"fp8_config": "E5M2"}), "fp8_config 'E5M2' is not supported"),
    (json.dumps({"mode": "MEASURE"}), "MEASURE needs dump_stats_path"),
    (json.dumps({"blocklist": ["lm_head"]}), "blocklist must be an object"),
    (json.dumps({"allowlist": {"names": "lm_head"}}), "allowlist.names must be a list"),
])
def test_malformed_config_fails_at_start_with_exit_2_naming_the_problem(tmp_path, content, message, capsys,
                                                                         monkeypatch):
    path = write(tmp_path, content)
    with pytest.raises(ConfigError, match=message):
        start(env(tmp_path, QUANT_CONFIG=path))
    monkeypatch.setenv("QUANT_CONFIG", path)
    assert cli.main(["launch", "--model-id", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: QUANT_CONFIG {path}") and message.split("'")[0] in err


def test_missing_config_file_and_missing_statistics_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"QUANT_CONFIG .*nope.json: no such file"):
        start(env(tmp_path, QUANT_CONFIG=str(tmp_path / "nope.json")))
    path = write(tmp_path, {**TGI_GAUDI_QUANT, "dump_stats_path": str(tmp_path / "stats" / "measure")})
    with pytest.raises(ConfigError, match=r"measure_hooks_maxabs.json, which does not exist"):
        start(env(tmp_path, QUANT_CONFIG=path))
    # Sharded, each rank needs its own file: rank 1 of 2 is missing here.
    write_stats(tmp_path / "stats" / "measure", {"lm_head": NodeStats([1.0])}, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"measure_hooks_maxabs_1_2.json, which does not exist"):
        start(env(tmp_path, QUANT_CONFIG=path, NUM_SHARD="2"))
    write_stats(tmp_path / "stats" / "measure", {"lm_head": NodeStats([1.0])}, rank=1, world_size=2)
    cfg = start(env(tmp_path, QUANT_CONFIG=path, NUM_SHARD="2"))
    assert cfg.model.quantize == "fp8" and cfg.model.quant_config == path  # QUANT_CONFIG alone turns FP8 on


def test_measure_config_is_refused_for_serving(tmp_path):
    path = write(tmp_path, {**TGI_GAUDI_QUANT, "mode": "MEASURE"})
    with pytest.raises(ConfigError, match="MEASURE is for `gaudi-serve calibrate`"):
        start(env(tmp_path, QUANT_CONFIG=path))


@pytest.mark.parametrize("flags, message", [
    ({"QUANTIZE": "bitsandbytes"}, "--quantize bitsandbytes: not served"),
    ({"QUANTIZE": "int3"}, "--quantize 'int3': choose one of fp8, compressed-tensors, gptq, awq"),
    ({"KV_CACHE_DTYPE": "fp8_e5m2"}, "--kv-cache-dtype 'fp8_e5m2'"),
])
def test_unsupported_quantize_flags_are_named(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve(None, env(tmp_path, **flags))


def test_stats_files_follow_inc_layout_per_rank(tmp_path):
    nodes = {"model.layers.0.mlp.down_proj": NodeStats([3.5], 1.25, 0.5),
             "model.embed_tokens": NodeStats([], 0.3, 0.4)}
    single = write_stats(tmp_path / "measure", nodes)
    assert single.name == "measure_hooks_maxabs.json"
    doc = json.loads(single.read_text())
    assert doc["GlobalRank"] is None and doc["Mode"] == "DynamicRange"
    assert doc["Nodes"]["model.layers.0.mlp.down_proj"] == {"inputs": [[[3.5]]], "outputs": [[1.25]],
                                                            "params": {"weight": [[0.5]]}}
    assert json.loads((tmp_path / "measure_hooks_maxabs_mod_list.json").read_text()) == sorted(nodes)
    import numpy as np

    npz = np.load(tmp_path / "measure_hooks_maxabs.npz", allow_pickle=True)["arr_0"].item()
    assert float(npz["Nodes"]["model.layers.0.mlp.down_proj"]["inputs"].max()) == 3.5
    assert read_stats(tmp_path / "measure") == nodes
    ranked = write_stats(tmp_path / "measure", nodes, rank=1, world_size=4)
    assert ranked.name == "measure_hooks_maxabs_1_4.json"
    assert json.loads(ranked.read_text())["LocalRank"] == 1
    # INC under a launcher names a single rank "_0_1": read as well.
    (tmp_path / "inc_hooks_maxabs_0_1.json").write_text(single.read_text())
    assert stats_file(tmp_path / "inc", 0, 1).name == "inc_hooks_maxabs_0_1.json"
    assert read_stats(tmp_path / "inc")["model.layers.0.mlp.down_proj"].inputs == [3.5]


def test_allowlist_and_blocklist_select_layers_by_type_and_name():
    model = tiny_llama()
    everything = select_layers(model, parse_quant_config({}))
    assert "lm_head" in everything and "model.embed_tokens" in everything
    assert "model.layers.1.self_attn.qkv_proj" in everything
    no_head = select_layers(model, parse_quant_config({"blocklist": {"names": ["lm_head"]}}))
    assert set(everything) - set(no_head) == {"lm_head"}
    mlp_only = select_layers(model, parse_quant_config({"allowlist": {"types": ["MergedColumnParallelLinear"],
                                                                      "names": ["down_proj"]}}))
    assert sorted(mlp_only) == [f"model.layers.{i}.mlp.{n}" for i in (0, 1) for n in ("down_proj", "gate_up_proj")]
    linear = select_layers(model, parse_quant_config({"allowlist": {"types": ["Linear"]}}))
    assert "model.embed_tokens" not in linear and "lm_head" in linear
    report = quantize_model(model, parse_quant_config({"blocklist": {"names": ["lm_head"]}}), torch.float32)
    assert report.kept == ["lm_head"] and model.lm_head.weight.dtype == torch.float32  # stays in the model dtype
    assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("raw, message", [
    ({"blocklist": {"names": ["lm_haed"]}}, "blocklist name 'lm_haed' matches no layer"),
    ({"allowlist": {"types": ["Conv2d"]}}, "allowlist type 'Conv2d' matches no layer"),
])
def test_filter_naming_no_layer_fails(raw, message):
    with pytest.raises(ConfigError, match=message):
        select_layers(tiny_llama(), parse_quant_config(raw, "q.json"))


def test_statistics_that_miss_a_layer_or_are_not_inc_layout_are_named(tmp_path):
    from gaudi_runtime.quant.apply import load_rank_stats

    prefix = tmp_path / "measure"
    write_stats(prefix, {"lm_head": NodeStats([2.0], 1.0, 0.5)})
    qc = parse_quant_config({"mode": "QUANTIZE", "dump_stats_path": str(prefix)}, "q.json")
    with pytest.raises(ConfigError, match="no input measurement for layer 'model.layers.0.self_attn.qkv_proj'"):
        quantize_model(tiny_llama(), qc, torch.float32, load_rank_stats(qc, 0, 1))
    only_head = parse_quant_config({"mode": "QUANTIZE", "dump_stats_path": str(prefix),
                                    "allowlist": {"names": ["lm_head"]}}, "q.json")
    report = quantize_model(tiny_llama(), only_head, torch.float32, load_rank_stats(only_head, 0, 1))
    assert report.input_scales == {"lm_head": pytest.approx(2.0 / 448)}
    (tmp_path / "measure_hooks_maxabs.json").write_text(json.dumps({"Nodes": {"lm_head": {"inputs": "x"}}}))
    with pytest.raises(ConfigError, match="measure_hooks_maxabs.json is not in INC's layout"):
        load_rank_stats(qc, 0, 1)
