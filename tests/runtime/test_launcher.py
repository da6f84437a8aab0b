"""`gaudi-serve launch` as an operator of the pod sees it: start-up errors, warmup progress, deaths."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import alive, children, get_json, hold_mid_warmup, launch, shard_of, signal_all


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
    """While it warms up, /health says how far it got, and every other route (/v1/models, which
    clients probe to learn that a server is up, included) answers 503: /v1 in OpenAI's error envelope,
    which names the state (the progress itself is /health's)."""
    srv = launch(model_dir, tmp_path, "--max-input-tokens", "256", "--max-total-tokens", "512",
                 "--max-batch-size", "32", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "2"})
    seen = []

    def poll(code, body):
        seen.append(("/health", code, body))
        seen.append(("/v1/models", *get_json(srv.url + "/v1/models")))

    try:
        shards, _ = hold_mid_warmup(srv.proc, srv.url)
        try:  # one look mid-warmup, whatever this machine's speed
            poll(*get_json(srv.url + "/health"))
        finally:
            signal_all(shards, signal.SIGCONT)
        srv.wait_ready(on_poll=poll)
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    finally:
        srv.stop()
    gauges = dict(line.split() for line in metrics.splitlines() if line.startswith("gaudi_serve_warmup_"))
    assert float(gauges["gaudi_serve_warmup_done"]) == float(gauges["gaudi_serve_warmup_total"]) > 0
    warming = [b for p, c, b in seen if p == "/health" and c == 503 and b.get("status") == "warming_up"]
    assert warming, seen[:5]
    w = warming[-1]["warmup"]
    assert 0 <= w["done"] <= w["total"] and w["total"] > 0 and w["phase"] in ("prefill", "prefill_context", "decode", "done")
    assert seen[-2][:2] == ("/health", 200)
    models = [(c, b) for p, c, b in seen if p == "/v1/models"]
    refused = [b for c, b in models if c == 503]
    assert any(b["error"]["type"] == "ServiceUnavailableError" and "warming_up" in b["error"]["message"]
               for b in refused), models[:5]
    first_ok = next(i for i, (p, c, _) in enumerate(seen) if p == "/v1/models" and c == 200)
    assert all(c == 200 for p, c, _ in seen[first_ok:] if p == "/health"), seen[first_ok:]  # one rule, one moment


def test_a_dying_shard_stops_the_launcher_non_zero_leaving_no_process(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, "--max-input-tokens", "32", "--max-total-tokens", "64",
                 "--max-batch-size", "4", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        assert len(kids) == 2  # shard-0 and the router
        shard = shard_of(srv)
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

    monkeypatch.setattr(launcher, "spawn", lambda *args, **kwargs: [])
    monkeypatch.setattr(launcher, "supervise", lambda *args, **kwargs: 0)
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "API_KEY": "s3cret-from-a-secret", "DEVICE": "cpu"})
    with caplog.at_level(logging.INFO, logger="gaudi_runtime.launcher"):
        assert launcher.main(cfg) == 0
    (line,) = [r.getMessage() for r in caplog.records if "effective configuration" in r.getMessage()]
    assert json.loads(line.split("effective configuration:", 1)[1])["server"]["api_key"] == "<redacted>"
    assert "s3cret-from-a-secret" not in caplog.text


async def _stream_until_cut(session, url: str, started: asyncio.Event, after: int = 3) -> tuple[list, float]:
    """Every event of a long /generate_stream, and when the stream ended (monotonic)."""
    body = {"inputs": "hello world", "parameters": {"max_new_tokens": 2000}}
    events = []
    async with session.post(url + "/generate_stream", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if len(events) == after:
                    started.set()
    return events, time.monotonic()


async def _health_until_down(url: str, since: float) -> tuple[int | None, float]:
    """Poll /health until it is not 200; its status (None: refused) and when."""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - since < 30:
            try:
                async with session.get(url + "/health") as r:
                    if r.status != 200:
                        return r.status, time.monotonic()
            except aiohttp.ClientConnectionError:
                return None, time.monotonic()
            await asyncio.sleep(0.02)  # poll interval of a deadline-bounded wait
    return 200, time.monotonic()


def test_a_shard_killed_mid_stream_ends_every_stream_with_an_error_event(model_dir, tmp_path):
    """SIGKILL to the shard while three streams run: each ends with TGI's error event (not a hang, not
    a silent cut), /health turns 503, the launcher exits non-zero and no process is left."""
    srv = launch(model_dir, tmp_path, "--max-input-tokens", "32", "--max-total-tokens", "2048",
                 "--max-batch-size", "4", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
                                               "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        shard = shard_of(srv)

        async def run():
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(_stream_until_cut(session, srv.url, e)) for e in started]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                killed = time.monotonic()
                os.kill(shard, signal.SIGKILL)
                health = await _health_until_down(srv.url, killed)
                ended = await asyncio.wait_for(asyncio.gather(*streams), 30)
                return killed, health, ended

        killed, (health_status, health_at), ended = asyncio.run(run())
        for events, _ in ended:
            assert events[-1].keys() == {"error", "error_type"}, events[-1]
            assert events[-1]["error_type"] == "generation"
            assert all("token" in e for e in events[:-1])
        assert health_status == 503
        code = srv.proc.wait(timeout=60)
        exited = time.monotonic()
        assert code != 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval of a deadline-bounded wait
        assert not any(alive(p) for p in kids)
        print(f"\nshard SIGKILL: streams ended after {max(t for _, t in ended) - killed:.3f}s, "
              f"/health 503 after {health_at - killed:.3f}s, launcher exited {code} after {exited - killed:.3f}s")
    finally:
        srv.stop()
