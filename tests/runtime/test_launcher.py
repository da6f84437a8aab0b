"""`gaudi-serve launch` as an operator of the pod sees it: start-up errors, warmup progress, deaths."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import alive, children, launch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def run_launch(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "gaudi_runtime.cli", "launch", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def test_contradictory_settings_fail_with_one_line_naming_the_setting(model_dir):
    r = run_launch("--model-id", str(model_dir), "--max-input-tokens", "100", "--max-total-tokens", "100")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-input-tokens" in lines[0], r.stderr
    r = run_launch("--model-id", str(model_dir), env={"MAX_BATCH_SIZE": "lots"})
    assert r.returncode == 2 and "MAX_BATCH_SIZE" in r.stderr


def test_unsupported_architecture_lists_the_supported_ones(model_dir, tmp_path):
    bad = tmp_path / "gpt"
    bad.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTJForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run_launch("--model-id", str(bad))
    assert r.returncode == 2
    assert "GPTJForCausalLM" in r.stderr
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in r.stderr


def test_a_token_budget_beyond_the_models_context_fails_naming_the_setting(model_dir, tmp_path):
    short = tmp_path / "short-context"
    shutil.copytree(model_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (short / "config.json").write_text(json.dumps(cfg))
    r = run_launch("--model-id", str(short), "--max-total-tokens", "2048", "--max-input-tokens", "1000")
    assert r.returncode != 0
    assert "--max-total-tokens (2048) exceeds the model's context of 1024 positions" in r.stderr, r.stderr[-3000:]


def test_health_reports_warmup_progress_then_ready(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, "--max-input-tokens", "256", "--max-total-tokens", "512",
                 "--max-batch-size", "32", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "2"})
    seen = []
    try:
        srv.wait_ready(on_poll=lambda code, body: seen.append((code, body)))
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    finally:
        srv.stop()
    gauges = dict(line.split() for line in metrics.splitlines() if line.startswith("gaudi_serve_warmup_"))
    assert float(gauges["gaudi_serve_warmup_done"]) == float(gauges["gaudi_serve_warmup_total"]) > 0
    warming = [b for c, b in seen if c == 503 and b.get("status") == "warming_up"]
    assert warming, seen[:5]
    w = warming[-1]["warmup"]
    assert 0 <= w["done"] <= w["total"] and w["total"] > 0 and w["phase"] in ("prefill", "decode", "done")
    assert seen[-1][0] == 200


def test_a_dying_shard_stops_the_launcher_non_zero_leaving_no_process(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, "--max-input-tokens", "32", "--max-total-tokens", "64",
                 "--max-batch-size", "4", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        assert len(kids) == 2  # shard-0 and the router
        shard = next(p for p in kids if b"shard" in open(f"/proc/{p}/cmdline", "rb").read())
        os.kill(shard, signal.SIGKILL)
        code = srv.proc.wait(timeout=60)
        assert code != 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval of a deadline-bounded wait
        assert not any(alive(p) for p in kids)
    finally:
        srv.stop()


def test_the_start_up_log_never_shows_the_api_key(model_dir, monkeypatch, caplog):
    """`launch` logs its effective configuration; a key given as API_KEY (from a Secret) is masked there."""
    import logging

    from gaudi_runtime import launcher
    from gaudi_runtime.config import resolve

    monkeypatch.setattr(launcher, "spawn", lambda cfg, model_dir: [])
    monkeypatch.setattr(launcher, "supervise", lambda procs: 0)
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "API_KEY": "s3cret-from-a-secret", "DEVICE": "cpu"})
    with caplog.at_level(logging.INFO, logger="gaudi_runtime.launcher"):
        assert launcher.main(cfg) == 0
    (line,) = [r.getMessage() for r in caplog.records if "effective configuration" in r.getMessage()]
    assert json.loads(line.split("effective configuration:", 1)[1])["api_key"] == "<redacted>"
    assert "s3cret-from-a-secret" not in caplog.text
