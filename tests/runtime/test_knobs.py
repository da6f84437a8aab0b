"""TGI-Gaudi's knobs on a real server: USE_FLASH_ATTENTION both ways, the PROF_* profiler, --rope-scaling /
--rope-factor, --tokenizer-config-path and --disable-grammar-support, each against `transformers`."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import SMALL_ARGS, SMALL_ENV, greedy_reference, launch

PROMPTS = ["What is deep learning?", "kubernetes pod operator cluster node graph warmup bucket prefill decode",
           "hello world", "a"]
TEMPLATE = "Q: {{ messages[-1]['content'] }} A:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("knobs") / "llama", "llama")


@pytest.fixture(scope="module")
def math_server(model_dir, tmp_path_factory):
    """Explicit softmax(QK^T)V attention, the profiler on, a chat template from another file."""
    tmp = tmp_path_factory.mktemp("knobs-math")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    env = dict(SMALL_ENV, USE_FLASH_ATTENTION="false", FLASH_ATTENTION_RECOMPUTE="true", PROF_WAITSTEP="1",
               PROF_STEP="3", PROF_PATH=str(tmp / "prof"), PROF_RECORD_SHAPES="true")
    srv = launch(model_dir, tmp, *SMALL_ARGS, "--tokenizer-config-path", str(tmp / "tokenizer_config.json"),
                 "--disable-grammar-support", env=env)
    try:
        srv.wait_ready()
        srv.prof = tmp / "prof"
        yield srv
    finally:
        srv.stop()


async def generate(url: str, prompt: str, n: int = 12) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [t["id"] for t in (await r.json())["details"]["tokens"]]


async def test_math_attention_equals_transformers(math_server, model_dir):
    for prompt in PROMPTS:
        assert await generate(math_server.url, prompt) == greedy_reference(model_dir, prompt, 12), prompt


async def test_profiler_writes_a_chrome_trace_of_decode_steps(math_server):
    await generate(math_server.url, PROMPTS[0], 8)  # 7 decode steps: 1 skipped, 3 recorded
    deadline = time.monotonic() + 30
    while not list(math_server.prof.glob("trace_rank0_*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)  # poll interval of a deadline-bounded wait
    (trace,) = list(math_server.prof.glob("trace_rank0_*.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#0" not in names
    assert any(n and n.startswith("aten::") for n in names)
    assert any("Input Dims" in e.get("args", {}) for e in events)  # PROF_RECORD_SHAPES


def test_start_up_log_reports_the_effective_settings(math_server):
    log = math_server.log()
    (line,) = [x for x in log.splitlines() if "effective configuration:" in x]
    parts = json.loads(line.split("effective configuration:", 1)[1])  # the settings, part by part
    cfg = {**parts["device"], **parts["structured_output"], **parts["model"]}
    assert cfg["use_flash_attention"] is False and cfg["flash_attention_recompute"] is True
    assert cfg["prof_step"] == 3 and cfg["prof_waitstep"] == 1 and cfg["disable_grammar_support"] is True
    assert cfg["tokenizer_config_path"].endswith("tokenizer_config.json")
    assert "attention: math (FLASH_ATTENTION_RECOMPUTE=True)" in log


async def test_chat_template_comes_from_the_tokenizer_config_path(math_server, model_dir):
    import torch
    import transformers

    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as s, s.post(math_server.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok("Q: hello world A:", add_special_tokens=False, return_tensors="pt").input_ids
    assert data["usage"]["prompt_tokens"] == ids.shape[1]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    assert data["choices"][0]["message"]["content"] == tok.decode(want[0, ids.shape[1]:])


async def test_grammar_is_refused_with_tgis_wording(math_server):
    body = {"inputs": "hello", "parameters": {"grammar": {"type": "json", "value": {}}}}
    async with aiohttp.ClientSession() as s, s.post(math_server.url + "/generate", json=body) as r:
        assert r.status == 422
        assert (await r.json()) == {"error": "grammar is not supported", "error_type": "validation"}


def linear_rope_copy(model_dir: Path, dest: Path, factor: float) -> Path:
    """The same weights with linear RoPE scaling written into config.json: transformers' view of the override."""
    shutil.copytree(model_dir, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_parameters"]["rope_theta"], "rope_type": "linear",
                              "factor": factor}
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


async def test_rope_override_with_fused_attention_equals_transformers(model_dir, tmp_path):
    reference = linear_rope_copy(model_dir, tmp_path / "linear", 2.0)
    srv = launch(model_dir, tmp_path, *SMALL_ARGS, "--rope-scaling", "linear", "--rope-factor", "2",
                 env=dict(SMALL_ENV, USE_FLASH_ATTENTION="true"))
    try:
        srv.wait_ready()
        for prompt in PROMPTS[:2]:
            got = await generate(srv.url, prompt)
            assert got == greedy_reference(reference, prompt, 12), prompt
            assert got != greedy_reference(model_dir, prompt, 12), prompt  # the override changed the model
        assert "attention: sdpa" in srv.log()
    finally:
        srv.stop()


def test_bad_rope_setting_fails_at_start(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, *SMALL_ARGS, "--rope-scaling", "yarn")
    assert srv.proc.wait(timeout=60) == 2
    assert "--rope-scaling 'yarn': choose linear or dynamic" in srv.log()
