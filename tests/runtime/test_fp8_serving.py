"""FP8 end to end: calibrate -> QUANTIZE config -> serve over HTTP, single and sharded, and start-up failures."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from gaudi_runtime import cli
from gaudi_runtime.config import resolve
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.quant.fp8_linear import FP8_MAX, is_fp8
from gaudi_runtime.shard.runner import ModelRunner, PrefillInput
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, get_json, launch
from tests.runtime.prefix_checks import bypassed, check_conversations

pytestmark = pytest.mark.slow

PROMPTS = ["the deep learning model is", "gaudi card shard router token", "hello world kubernetes pod operator",
           "what is a warmup bucket", "café naïve über 東京"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def calibrated(model_dir, tmp_path_factory):
    """`gaudi-serve calibrate` run for 1 and 2 shards; returns {shards: QUANTIZE config path}."""
    tmp = tmp_path_factory.mktemp("calib")
    (tmp / "prompts.jsonl").write_text("\n".join(json.dumps({"inputs": p}) for p in PROMPTS) + "\n")
    (tmp / "measure.json").write_text(json.dumps({"method": "HOOKS", "mode": "MEASURE", "observer": "maxabs",
                                                  "dump_stats_path": "./hqt_output/measure"}))
    out = {}
    for shards in (1, 2):
        args = ["calibrate", "--model-id", str(model_dir), "--dataset", str(tmp / "prompts.jsonl"),
                "--quant-config", str(tmp / "measure.json"), "--output", str(tmp / f"hqt{shards}"),
                "--num-shard", str(shards), "--dtype", "float32"]
        assert cli.main(args) == 0
        out[shards] = tmp / f"hqt{shards}" / "maxabs_quant.json"
    return out


def runner(model_dir, **env) -> ModelRunner:
    base = {"MODEL_ID": str(model_dir), "DEVICE": "cpu", "DTYPE": "float32", "MAX_TOTAL_TOKENS": "64",
            "MAX_BATCH_SIZE": "4", "BLOCK_SIZE": "4", "WARMUP_ENABLED": "false"}
    return ModelRunner(resolve(None, {**base, **env}), str(model_dir), CpuBackend())


def test_calibrate_writes_inc_layout_per_rank(calibrated):
    one = calibrated[1].parent
    doc = json.loads((one / "measure_hooks_maxabs.json").read_text())
    assert doc["Mode"] == "DynamicRange" and doc["GlobalRank"] is None
    node = doc["Nodes"]["model.layers.0.self_attn.qkv_proj"]
    assert set(node) == {"inputs", "outputs", "params"} and node["inputs"][0][0][0] > 0
    assert "model.layers.1.self_attn.attn.k_cache" in doc["Nodes"]
    two = calibrated[2].parent
    ranks = [json.loads((two / f"measure_hooks_maxabs_{r}_2.json").read_text()) for r in range(2)]
    assert [d["LocalRank"] for d in ranks] == [0, 1]
    # A row-parallel layer's input is split over the ranks: each rank measured its own half.
    down = [d["Nodes"]["model.layers.0.mlp.down_proj"]["inputs"][0][0][0] for d in ranks]
    full = doc["Nodes"]["model.layers.0.mlp.down_proj"]["inputs"][0][0][0]
    assert max(down) == pytest.approx(full, rel=1e-5) and min(down) < full


def test_quantize_config_reads_the_statistics_into_static_scales(model_dir, calibrated):
    doc = json.loads((calibrated[1].parent / "measure_hooks_maxabs.json").read_text())["Nodes"]
    static = runner(model_dir, QUANT_CONFIG=str(calibrated[1]), KV_CACHE_DTYPE="fp8_e4m3fn")
    dynamic = runner(model_dir, QUANTIZE="fp8", KV_CACHE_DTYPE="fp8_e4m3fn")
    layers = {n: m for n, m in static.model.named_modules() if is_fp8(m)}
    assert "model.layers.0.mlp.down_proj" in layers and "lm_head" in layers
    for name, m in layers.items():
        if name == "model.embed_tokens":
            continue  # token ids: no input scale
        assert float(m.input_scale) == pytest.approx(doc[name]["inputs"][0][0][0] / FP8_MAX, rel=1e-6)
        assert dict(dynamic.model.named_modules())[name].input_scale is None
    attn = static.model.model.layers[1].self_attn.attn
    assert attn.k_scale == pytest.approx(doc["model.layers.1.self_attn.attn.k_cache"]["inputs"][0][0][0] / FP8_MAX)
    assert dynamic.model.model.layers[1].self_attn.attn.k_scale == 1.0
    assert static.kv_cache[0][0].dtype == torch.float8_e4m3fn
    # Same prompt through both: the static and dynamic scales give (nearly) the same next-token distribution.
    outs = []
    for r in (static, dynamic):
        res = r.prefill(1, [PrefillInput(7, [5, 9, 30, 44, 2, 17], SamplingParameters(), 0, [1, 2], False)])
        outs.append(res.sample.next_ids[0].item())
        r.decode([(1, [7])])
    assert outs[0] == outs[1]


def test_filter_naming_no_layer_fails_at_shard_start(model_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mode": "QUANTIZE", "blocklist": {"names": ["lm_haed"]}}))
    server = launch(model_dir, tmp_path, *SMALL_ARGS, env={**SMALL_ENV, "QUANT_CONFIG": str(bad)})
    try:
        code = server.proc.wait(timeout=120)
    finally:
        server.stop()
    assert code == 2  # a configuration error, like the ones found before anything starts
    assert "error: shard 0: QUANT_CONFIG" in server.log()
    assert "blocklist name 'lm_haed' matches no layer" in server.log()


def _generate(url: str, prompt: str, n: int) -> dict:
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.mark.parametrize("shards", [1, 2])
def test_launch_serves_fp8_over_http(model_dir, calibrated, tmp_path, shards):
    if shards == 1:  # --quantize fp8 alone: dynamic scales, plus the float8 KV cache
        args, env = ["--quantize", "fp8", "--kv-cache-dtype", "fp8_e4m3fn"], {}
    else:  # QUANT_CONFIG from a 2-rank calibration: each rank reads its own statistics
        args, env = ["--num-shard", "2"], {"QUANT_CONFIG": str(calibrated[2])}
    server = launch(model_dir, tmp_path, *SMALL_ARGS, *args, env={**SMALL_ENV, **env})
    try:
        server.wait_ready()
        for prompt in PROMPTS[:2]:
            out = _generate(server.url, prompt, 6)
            assert out["details"]["generated_tokens"] == 6 and out["generated_text"]
        code, info = get_json(server.url + "/info")
        assert code == 200
        log = server.log()
        assert "layers in FP8" in log
        if shards == 2:
            assert "rank 1: 10 layers in FP8 (9 with static input scales)" in log
        else:
            assert "KV cache in fp8_e4m3fn" in log
    finally:
        assert server.stop() in (0, -15)


def test_prompts_read_from_a_float8_kv_cache_answer_as_when_computed_whole(model_dir, tmp_path):
    """Prefix caching over a float8 KV cache, 2 shards: a turn whose history is read from the cache gets
    the tokens the same server gives with every prompt token computed (a request wanting its prompt's
    log-probabilities bypasses the cache). Weights stay in fp32: dynamic FP8 activation scales would make
    any answer depend on what else shares its batch, cached or not."""
    server = launch(model_dir, tmp_path, *SMALL_ARGS, "--num-shard", "2", "--kv-cache-dtype", "fp8_e4m3fn",
                    env=SMALL_ENV)
    try:
        server.wait_ready()
        server.model_dir = model_dir
        check_conversations(server, conversations=2, turns=3, reference=bypassed(server))
        assert get_json(server.url + "/info")[1]["kv_cache_dtype"] == "fp8_e4m3fn"
    finally:
        assert server.stop() in (0, -15)
