"""TGI-Gaudi's remaining settings: RoPE override, attention implementation, chat template file, tracing,
the offline API's parameters. The servers that use them are in tests/runtime/test_knobs.py."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from gaudi_runtime.config import ConfigError, add_arguments, resolve
from gaudi_runtime.device.attention import MathAttention, math_attention
from gaudi_runtime.device.base import Backend
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.rotary import rope_params_from_config
from gaudi_runtime.models.registry import override_rope
from gaudi_runtime.router.tokenizer import chat_template_from
from gaudi_runtime.router.tracing import RequestTimes, phases, traces_url
from tests.fake_modules import load_fake


def env(**kw):
    return {"MODEL_ID": "/m", **{k: str(v) for k, v in kw.items()}}


# ---- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("settings, scaling, factor", [
    ({}, None, None),
    ({"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "4"}, "dynamic", 4.0),
    ({"ROPE_SCALING": "linear"}, "linear", 1.0),  # TGI: a scaling type alone has factor 1
    ({"ROPE_FACTOR": "2.5"}, "linear", 2.5),  # TGI: a factor alone means linear
])
def test_rope_override_pairs_like_tgi(settings, scaling, factor):
    cfg = resolve(None, env(**settings))
    assert (cfg.model.rope_scaling, cfg.model.rope_factor) == (scaling, factor)


@pytest.mark.parametrize("settings, names", [
    ({"ROPE_SCALING": "yarn"}, "--rope-scaling"),
    ({"ROPE_FACTOR": "0"}, "--rope-factor"),
    ({"ROPE_FACTOR": "x"}, "ROPE_FACTOR"),
    ({"PROF_RANKS": "0,a"}, "PROF_RANKS"),
    ({"PROF_STEP": "-1"}, "PROF_STEP"),
    ({"USE_FLASH_ATTENTION": "maybe"}, "USE_FLASH_ATTENTION"),
    ({"TOKENIZER_CONFIG_PATH": "/nonexistent/tokenizer_config.json"}, "--tokenizer-config-path"),
])
def test_bad_settings_fail_naming_the_setting(settings, names):
    with pytest.raises(ConfigError, match=names):
        resolve(None, env(**settings))


def test_defaults_follow_tgi_gaudi():
    cfg = resolve(None, env())
    assert (cfg.device.prof_step, cfg.device.prof_waitstep, cfg.device.prof_warmupstep) == (0, 0, 0)
    assert cfg.device.prof_path == "/tmp/hpu_profile" and cfg.device.prof_ranks == [0] and not cfg.device.prof_record_shapes
    assert cfg.device.use_flash_attention and not cfg.device.flash_attention_recompute
    assert cfg.server.otlp_endpoint is None and cfg.server.otlp_service_name == "text-generation-inference.router"
    assert not cfg.structured_output.disable_grammar_support


def test_boolean_flags_may_be_bare_like_tgi_switches():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = resolve(p.parse_args(["--model-id", "/m", "--disable-grammar-support", "--json-output"]), {})
    assert cfg.structured_output.disable_grammar_support and cfg.server.json_output
    cfg = resolve(p.parse_args(["--model-id", "/m", "--disable-grammar-support", "false"]), {})
    assert not cfg.structured_output.disable_grammar_support


def test_every_knob_is_in_the_config_json():
    keys = {name for part in json.loads(resolve(None, env(PROF_STEP=1, ROPE_FACTOR=2)).to_json()).values()
            for name in part}
    for name in ("prof_step", "prof_waitstep", "prof_warmupstep", "prof_path", "prof_ranks", "prof_record_shapes",
                 "use_flash_attention", "flash_attention_recompute", "rope_scaling", "rope_factor",
                 "tokenizer_config_path", "otlp_endpoint", "otlp_service_name", "disable_grammar_support"):
        assert name in keys, name


# ---- RoPE override ----------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"rope_theta": 500000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    {"rope_theta": 500000.0},
])
def test_override_rope_replaces_the_scaling_and_keeps_theta(config):
    out = override_rope({"hidden_size": 8, **config}, "linear", 3.0)
    assert rope_params_from_config(out) == (500000.0, {"rope_type": "linear", "factor": 3.0})
    assert out["hidden_size"] == 8 and rope_params_from_config(config)[0] == 500000.0  # input untouched


# ---- attention implementation ---------------------------------------------------------------------

def test_math_attention_equals_sdpa_causal_and_masked():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(math_attention(q, k, v, is_causal=True, scale=0.3),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    mask = torch.rand(2, 1, 7, 7) > 0.4
    mask[..., 0] = True  # every row attends somewhere
    torch.testing.assert_close(math_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_select_attention_off_hpu():
    impl = CpuBackend().attention(False, False)
    assert type(impl) is MathAttention and impl.prefill is math_attention and impl.name == "math"
    impl = Backend(torch.device("cpu")).attention(True, True)  # CUDA's; recompute only means something to FusedSDPA
    assert type(impl) is AttentionBackend and impl.name == "sdpa"


def test_each_model_keeps_the_attention_its_runner_chose(tmp_path):
    """USE_FLASH_ATTENTION is a per-model choice: a second runner in the process with another setting leaves
    the first one's layers and /info as they were."""
    from gaudi_runtime.device.cpu_attention import CpuAttention
    from gaudi_runtime.layers.attention import Attention
    from gaudi_runtime.shard.runner import ModelRunner
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    env = {"MODEL_ID": str(model_dir), "DTYPE": "float32", "DEVICE": "cpu", "BLOCK_SIZE": "4",
           "MAX_TOTAL_TOKENS": "64", "MAX_BATCH_SIZE": "2", "NUM_SHARD": "1"}
    math = ModelRunner(resolve(None, {**env, "USE_FLASH_ATTENTION": "false"}), str(model_dir), CpuBackend())
    fast = ModelRunner(resolve(None, env), str(model_dir), CpuBackend())
    for runner, kind in ((math, MathAttention), (fast, CpuAttention)):
        backends = {id(m.backend): m.backend for m in runner.model.modules() if isinstance(m, Attention)}
        assert len(backends) == 1 and type(next(iter(backends.values()))) is kind
    assert math.attention_name == "math"
    assert fast.attention_name in ("sdpa (decode: paged C kernel)", "sdpa (decode: grouped bmm)")


@pytest.fixture
def fake_hpu(monkeypatch):
    for record in load_fake(monkeypatch, "habana_frameworks", "habana_frameworks.torch"):
        record["fused_sdpa"] = []
        yield record


@pytest.mark.parametrize("recompute", [False, True])
def test_hpu_uses_fused_sdpa_with_recompute_for_the_first_token(fake_hpu, recompute):
    from gaudi_runtime.device.hpu import HpuBackend
    from gaudi_runtime.layers.attention import Attention, AttentionMetadata

    def run_layer(backend):
        """A 5-token prefill into a paged cache, then one decode step over it."""
        torch.manual_seed(0)
        layer = Attention(num_heads=4, num_kv_heads=2, head_dim=8, backend=backend)
        cache = (torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))  # 4 blocks of 4 tokens
        q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
        first = layer(q, k, v, cache, AttentionMetadata(is_prefill=True, slots=torch.arange(4, 9)[None]))
        q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
        meta = AttentionMetadata(is_prefill=False, slots=torch.tensor([[9]]), block_tables=torch.tensor([[1, 2, 0]]),
                                 context_lens=torch.tensor([6]))
        return first, layer(q, k, v, cache, meta)

    hpu = HpuBackend(torch_device=torch.device("cpu"))
    impl = hpu.attention(True, recompute)
    assert impl.name == "fused_sdpa (decode: flat paged)"
    fused = run_layer(impl)
    assert fake_hpu["fused_sdpa"] == [{"is_causal": True, "recompute": recompute, "softmax_mode": "None"},
                                      {"is_causal": False, "recompute": False, "softmax_mode": "None"}]
    for got, want in zip(fused, run_layer(hpu.attention(False, False)), strict=True):
        torch.testing.assert_close(got, want)
    assert len(fake_hpu["fused_sdpa"]) == 2  # the math path calls no fused kernel


# ---- chat template file, tracing phases, offline parameters ------------------------------------------

def test_chat_template_from_a_tokenizer_config(tmp_path):
    f = tmp_path / "tokenizer_config.json"
    f.write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    assert chat_template_from(str(f)) == "{{ messages[0]['content'] }}!"
    f.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                               {"name": "default", "template": "D"}]}))
    assert chat_template_from(str(f)) == "D"
    f.write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="--tokenizer-config-path .* has no chat_template"):
        chat_template_from(str(f))
    f.write_text("{not json")
    with pytest.raises(ValueError, match="--tokenizer-config-path"):
        chat_template_from(str(f))


def test_trace_phases_follow_the_request():
    t = RequestTimes(start=10.0, validated=10.1, queue_time=0.4, first_token=10.7, end=12.0)
    assert [(n, round(a, 3), round(b, 3)) for n, a, b in phases(t)] == [
        ("validation", 10.0, 10.1), ("queue", 10.1, 10.5), ("prefill", 10.5, 10.7), ("decode", 10.7, 12.0)]
    # Refused at validation: one child span.
    assert [n for n, *_ in phases(RequestTimes(start=1.0, end=1.2))] == ["validation"]
    # Failed before its first token: no decode span.
    assert [n for n, *_ in phases(RequestTimes(start=1.0, validated=1.1, end=2.0))] == [
        "validation", "queue", "prefill"]


def test_traces_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/v1/traces/") == "http://collector:4318/v1/traces"


def test_sampling_params_map_to_tgi_parameters():
    from gaudi_runtime import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=5, stop="x").tgi_parameters()
    assert greedy["do_sample"] is False and greedy["temperature"] is None and greedy["top_k"] is None
    assert greedy["max_new_tokens"] == 5 and greedy["stop"] == ["x"]
    sampled = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3).tgi_parameters()
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["seed"]) == (
        True, 0.7, 20, 0.9, 3)
    assert SamplingParams(top_k=-1).tgi_parameters()["top_k"] is None  # vLLM's "off"


def test_import_stays_cheap():
    import subprocess

    code = ("import sys, gaudi_runtime; assert 'torch' not in sys.modules and 'gaudi_runtime.llm' not in "
            "sys.modules; from gaudi_runtime import LLM, SamplingParams; print(LLM.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "gaudi_runtime.llm"


def test_no_tracing_without_an_endpoint():
    import subprocess

    from gaudi_runtime.router.tracing import make_tracer

    assert make_tracer(resolve(None, env()).server) is None
    code = ("import sys, gaudi_runtime.router.main, gaudi_runtime.router.inference; "
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')]")
    subprocess.run([sys.executable, "-c", code], check=True)
