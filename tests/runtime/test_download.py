"""`gaudi-serve download` as a cold-starting pod runs it: a real process against a hub stand-in on
loopback (HF_ENDPOINT), printing JSON lines. Whole, interrupted and resumed, corrupted and fetched
again, refused (401), offline from a complete cache; then `launch` serving the hub id offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from gaudi_runtime.progress import STALL_EXIT_CODE
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.hub_standin import HubStandIn, StandInRepo
from tests.runtime.launched import get_json, hold_mid_warmup, launch, signal_all

BIG_WEIGHTS = 24 << 20  # over huggingface_hub's 10 MiB write chunk, so an interrupted transfer leaves bytes on disk
CHUNK = 10 << 20


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    # What a hub repository also holds and the runtime does not load.
    files.update({"README.md": b"# tiny\n", "original/params.json": b"{}", "pytorch_model.bin": b"\0" * 1000})
    return files


@pytest.fixture(scope="module")
def big_files(tiny_files, tmp_path_factory) -> dict[str, bytes]:
    path = tmp_path_factory.mktemp("big") / "model.safetensors"
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal(BIG_WEIGHTS // 4, dtype=np.float32)}, str(path))
    return {**{k: v for k, v in tiny_files.items() if not k.endswith(".safetensors")},
            "model.safetensors": path.read_bytes()}


@pytest.fixture
def hub(tiny_files, big_files):
    h = HubStandIn({"org/tiny": StandInRepo(tiny_files), "org/big": StandInRepo(big_files)}).start()
    yield h
    h.stop()


def hub_env(hub: HubStandIn, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HUGGINGFACE_HUB_CACHE=str(tmp_path / "cache"), **extra)
    return env


def download(hub, tmp_path, *args: str, **env: str) -> tuple[int, list[dict], str]:
    r = subprocess.run([sys.executable, "-m", "gaudi_runtime.cli", "download", *args], capture_output=True, text=True,
                       timeout=300, env=hub_env(hub, tmp_path, **env))
    return r.returncode, [json.loads(line) for line in r.stdout.splitlines()], r.stderr


def served(snapshot: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(snapshot).iterdir() if not p.name.startswith(".")}


def test_a_download_fetches_what_the_runtime_loads_and_reports_bytes(hub, tiny_files, tmp_path):
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny")
    assert code == 0, err
    *progress, done = events
    wanted = {k: v for k, v in tiny_files.items() if "/" not in k and k not in ("README.md", "pytorch_model.bin")}
    total = sum(len(v) for v in wanted.values())
    assert done["event"] == "done" and done["bytes"] == done["fetched"] == total
    assert done["commit"] == hub.repos["org/tiny"].commit and done["revision"] is None and done["repo"] == "org/tiny"
    assert done["config"] == json.loads(tiny_files["config.json"])  # what the operator's memory estimate reads
    assert served(done["path"]) == wanted
    assert all(e["event"] == "progress" and e["total"] == total for e in progress)
    assert [e["done"] for e in progress] == sorted(e["done"] for e in progress) and progress[-1]["done"] == total
    assert progress[-1]["file"] == "model.safetensors"

    hub.requests.clear()
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", "--revision", "main")
    assert code == 0, err
    assert events[-1]["fetched"] == 0 and events[-1]["path"] == done["path"]
    assert [r["path"] for r in hub.requests] == ["/api/models/org/tiny/revision/main"]  # the complete snapshot is trusted


def test_an_interrupted_download_resumes_from_its_partial_file(hub, big_files, tmp_path):
    hub.fail_once("model.safetensors", after=CHUNK + (4 << 20), mode="hang")
    cmd = [sys.executable, "-m", "gaudi_runtime.cli", "download", "--model-id", "org/big"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=hub_env(hub, tmp_path))
    partial = tmp_path / "cache" / "models--org--big" / "blobs"
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size >= CHUNK for p in partial.glob("*.incomplete")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)  # poll interval of a deadline-bounded wait
    proc.send_signal(signal.SIGTERM)  # the download Job's pod is deleted
    out, err = proc.communicate(timeout=60)
    hub.release()
    last = json.loads(out.splitlines()[-1])
    assert proc.returncode == 143 and last["event"] == "error" and last["reason"] == "interrupted", err
    kept = sum(p.stat().st_size for p in partial.glob("*.incomplete"))
    assert kept >= CHUNK

    hub.requests.clear()
    code, events, err = download(hub, tmp_path, "--model-id", "org/big")
    assert code == 0, err
    size = len(big_files["model.safetensors"])
    gets = [r for r in hub.requests if r["method"] == "GET" and r["path"].endswith("model.safetensors")]
    assert [r["range"] for r in gets] == [f"bytes={kept}-"]
    assert hub.bytes_sent("model.safetensors") == size - kept == events[-1]["fetched"]
    assert served(events[-1]["path"])["model.safetensors"] == big_files["model.safetensors"]


def test_a_dropped_connection_is_resumed_within_the_run(hub, big_files, tmp_path):
    hub.fail_once("model.safetensors", after=CHUNK + (4 << 20), mode="drop")
    code, events, err = download(hub, tmp_path, "--model-id", "org/big")
    assert code == 0, err
    ranges = [r["range"] for r in hub.requests if r["method"] == "GET" and r["path"].endswith("model.safetensors")]
    assert ranges == [None, f"bytes={CHUNK}-"]
    assert served(events[-1]["path"])["model.safetensors"] == big_files["model.safetensors"]


def test_a_corrupted_file_is_detected_and_fetched_again(hub, tiny_files, tmp_path):
    hub.corrupt_once("model.safetensors")
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny")
    assert code == 0, err
    assert "model.safetensors: not a valid safetensors file" in err
    assert hub.bytes_sent("model.safetensors") == 2 * len(tiny_files["model.safetensors"])
    snapshot = Path(events[-1]["path"])
    assert served(snapshot)["model.safetensors"] == tiny_files["model.safetensors"]

    # The same on disk later (a bad sector, a half-copied volume): the next run notices and heals it.
    weights = (snapshot / "model.safetensors").resolve()
    data = weights.read_bytes()
    weights.chmod(0o644)
    weights.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    hub.requests.clear()
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny")
    assert code == 0, err
    assert events[-1]["fetched"] == len(data)
    assert served(snapshot)["model.safetensors"] == tiny_files["model.safetensors"]


def test_a_refused_token_is_a_clear_unauthorized_error(hub, tmp_path):
    hub.token = "hf_right"
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", HF_TOKEN="hf_wrong")
    assert code == 3
    assert events[-1]["event"] == "error" and events[-1]["reason"] == "unauthorized", events
    assert "HF_TOKEN" in events[-1]["message"] and "Traceback" not in err

    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", HF_TOKEN="hf_right")
    assert code == 0, err
    assert {r["authorization"] for r in hub.requests[-3:]} == {"Bearer hf_right"}


@pytest.mark.parametrize("args, reason", [
    (["--model-id", "org/absent"], "not_found"),
    (["--model-id", "org/tiny", "--revision", "v9"], "not_found"),
])
def test_what_the_hub_does_not_have_is_not_found(hub, tmp_path, args, reason):
    code, events, _ = download(hub, tmp_path, *args)
    assert code == 4 and events[-1]["reason"] == reason, events


def test_offline_a_complete_cache_needs_no_hub_and_an_empty_one_says_so(hub, tmp_path):
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", HF_HUB_OFFLINE="1")
    assert code == 6 and events[-1]["reason"] == "not_cached", (events, err)
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny")
    assert code == 0, err
    path = events[-1]["path"]

    hub.requests.clear()
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", HF_HUB_OFFLINE="1")
    assert code == 0, err
    assert events[-1]["path"] == path and events[-1]["fetched"] == 0
    r = subprocess.run([sys.executable, "-m", "gaudi_runtime.cli", "download", "--model-id", "org/tiny",
                        "--progress", "bar"], capture_output=True, text=True, timeout=120,
                       env=hub_env(hub, tmp_path, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0 and r.stdout == path + "\n", r.stderr  # the bar goes to stderr
    assert hub.requests == []


def test_offline_a_snapshot_another_hub_client_completed_is_served(hub, tmp_path):
    fill = ("import sys; from huggingface_hub import snapshot_download; "
            "print(snapshot_download('org/tiny', allow_patterns=sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", fill, "*.json", "*.safetensors", "*.jinja"], capture_output=True,
                       text=True, timeout=120, env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    hub.requests.clear()
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny", HF_HUB_OFFLINE="1")
    assert code == 0, err
    assert events[-1]["path"] == r.stdout.strip() and events[-1]["fetched"] == 0 and hub.requests == []


def test_launch_serves_a_hub_id_offline_from_the_cache_and_reports_its_start(hub, tmp_path):
    code, events, err = download(hub, tmp_path, "--model-id", "org/tiny")
    assert code == 0, err
    hub.requests.clear()
    env = hub_env(hub, tmp_path, HF_HUB_OFFLINE="1", PAD_SEQUENCE_TO_MULTIPLE_OF="16", BATCH_BUCKET_SIZE="2")
    srv = launch("org/tiny", tmp_path, "--dtype", "float32", "--max-input-tokens", "256", "--max-total-tokens", "512",
                 "--max-batch-size", "16", env=env)
    seen = []
    try:
        shards, _ = hold_mid_warmup(srv.proc, srv.url)
        try:  # one look mid-warmup, whatever this machine's speed
            seen.append(get_json(srv.url + "/health")[1])
        finally:
            signal_all(shards, signal.SIGCONT)
        srv.wait_ready(on_poll=lambda code, body: seen.append(body))
        _, info = get_json(srv.url + "/info")
        _, health = get_json(srv.url + "/health")
    finally:
        srv.stop()
    assert hub.requests == []
    startup = info["startup_seconds"]
    assert 0 <= startup["download"] < 60 and startup["load"] > 0 and startup["warmup"] > 0
    # /health, which stays open with an API key (the operator reads it), says the same once ready.
    assert health["startup_seconds"] == startup and health["warmup_from_cache"] is None
    assert health["status"] == "ok" and health["warmup"]["done"] == health["warmup"]["total"] > 0
    assert info["quantization"] is None and info["kv_cache_dtype"] == "float32"
    assert info["warmup_from_cache"] is None and info["recipe_cache"] is None  # no Gaudi here
    warming = [b["warmup"] for b in seen if b.get("status") == "warming_up"]
    assert warming and all(w["from_cache"] is None for w in warming)  # /health says it during warmup


def test_launch_answers_the_probes_while_it_downloads_and_ends_a_stalled_download(hub, tmp_path):
    """The port answers from the launcher's first second: /health with the download's bytes, /livez 200
    while bytes come; once none came for --warmup-stall-seconds, /livez 503 and the launcher ends with the
    stall's exit code and reason (the download resumes at the next start)."""
    message = tmp_path / "termination-log"
    message.write_text("")
    hub.fail_once("model.safetensors", after=CHUNK, mode="hang")
    # A connection that hangs unnoticed: huggingface_hub would give up on a read after 10 s and resume.
    srv = launch("org/big", tmp_path, "--dtype", "float32", "--warmup-stall-seconds", "10",
                 env=hub_env(hub, tmp_path, TERMINATION_MESSAGE_PATH=str(message), HF_HUB_DOWNLOAD_TIMEOUT="300"))
    seen: list[tuple[int, dict, int, dict]] = []
    try:
        deadline = time.monotonic() + 120
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                seen.append((*get_json(srv.url + "/health", timeout=2), *get_json(srv.url + "/livez", timeout=2)))
            except OSError:
                pass  # not bound yet
            time.sleep(0.1)  # poll interval of a deadline-bounded wait
        code = srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    held = [(h, lv) for hc, h, lc, lv in seen if hc == 503 and h.get("status") == "downloading" and lc == 200]
    assert held, seen[:3]
    assert 0 < held[-1][0]["download"]["done"] < held[-1][0]["download"]["total"] and \
        held[-1][0]["download"]["total"] > BIG_WEIGHTS
    stalled = [lv for _, _, lc, lv in seen if lc == 503]
    assert stalled and stalled[0]["status"] == "stalled", seen[-3:]
    assert stalled[0]["error"].startswith("start stalled: no progress for ") and "while downloading the model" in \
        stalled[0]["error"]
    assert code == STALL_EXIT_CODE
    assert message.read_text().startswith("start stalled: no progress for ") and "while downloading the model" in \
        message.read_text()


def test_lora_adapters_are_fetched_before_the_model_and_a_missing_one_is_named(tiny_files, tmp_path):
    """`download --lora-adapters` (what the operator's download Job runs for spec.model.adapters): each hub
    adapter at its revision into the same cache, its `done` line before the model's (the last line stays
    the model's); an adapter the hub lacks fails the download before the model, its error naming it."""
    path = tmp_path / "adapter_model.safetensors"
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 4), np.float32)},
              str(path))
    adapter = {"adapter_config.json": b'{"peft_type": "LORA", "r": 2}', "adapter_model.safetensors": path.read_bytes(),
               "README.md": b"# sql\n"}
    hub = HubStandIn({"org/tiny": StandInRepo(tiny_files), "org/sql": StandInRepo(adapter)}).start()
    try:
        commit = hub.repos["org/sql"].commit
        code, events, err = download(hub, tmp_path, "--model-id", "org/tiny",
                                     "--lora-adapters", f"sql=org/sql@{commit},local={tmp_path}")
        assert code == 0, err
        done = [e for e in events if e["event"] == "done"]
        assert [(e["repo"], e["revision"]) for e in done] == [("org/sql", commit), ("org/tiny", None)]
        assert events[-1] is done[-1]
        assert served(done[0]["path"]) == {k: v for k, v in adapter.items() if k != "README.md"}
        assert "config" not in done[0] and "config" in done[1]  # an adapter has no config.json

        hub.requests.clear()
        code, events, err = download(hub, tmp_path / "other", "--model-id", "org/tiny",
                                     "--lora-adapters", "sql=org/sql,chat=org/chat@main")
        assert code == 4, err
        last = events[-1]
        assert (last["event"], last["reason"], last["adapter"]) == ("error", "not_found", "chat")
        assert last["message"].startswith("adapter 'chat' (org/chat): ")
        assert not any("/org/tiny/" in r["path"] for r in hub.requests)  # the model waits for its adapters
    finally:
        hub.stop()
