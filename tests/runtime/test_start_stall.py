"""A start that is slow is left alone, one that is stuck ends with its reason (progress.py's stall rule),
as the kubelet and the operator see them through `gaudi-serve launch`: /livez, the exit code, the
termination message. The stuck start is a shard stopped with SIGSTOP mid-warmup, as a hung collective or
a starved process would leave it."""

from __future__ import annotations

import signal

import pytest

from gaudi_runtime.progress import STALL_EXIT_CODE
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.e2e.harness import wait_for
from tests.runtime.launched import alive, children, get_json, hold_mid_warmup, launch, signal_all

# Hundreds of shapes on CPU, held in their middle by hold_mid_warmup (they take under a second here).
WARM_ARGS = ["--dtype", "float32", "--max-input-tokens", "256", "--max-total-tokens", "512", "--max-batch-size", "32"]
WARM_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def poll(url: str) -> tuple[int, dict] | None:
    try:
        return get_json(url, timeout=2)
    except OSError:
        return None


def test_liveness_answers_through_the_start_and_stays_200_while_warmup_progresses(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, *WARM_ARGS, "--warmup-stall-seconds", "30", env=WARM_ENV)
    seen: list[tuple[str, int, dict]] = []

    def look() -> bool:
        assert srv.proc.poll() is None, srv.log()[-3000:]
        live, health = poll(srv.url + "/livez"), poll(srv.url + "/health")
        if live and health:
            seen.append((health[1].get("status", "ok"), live[0], live[1]))
        return bool(health and health[0] == 200)
    try:
        shards, _ = hold_mid_warmup(srv.proc, srv.url)
        try:
            look()  # mid-warmup, whatever this machine's speed
        finally:
            signal_all(shards, signal.SIGCONT)
        wait_for(look, 240, "the server to be ready")
        assert poll(srv.url + "/livez") == (200, {"status": "ok"})
    finally:
        assert srv.stop() == 0
    states = [s for s, _, _ in seen]
    assert "warming_up" in states, states[:10]
    assert all(code == 200 for _, code, _ in seen), [x for x in seen if x[1] != 200][:3]
    steps = [body["progress"] for s, _, body in seen if s == "warming_up" and "progress" in body]
    assert steps and all(p["idle_seconds"] < 30 for p in steps), steps[:3]


def test_a_stalled_warmup_ends_the_pod_with_the_reason(model_dir, tmp_path):
    message = tmp_path / "termination-log"
    message.write_text("")  # the kubelet creates the file; the runtime only writes into it
    srv = launch(model_dir, tmp_path, *WARM_ARGS, "--warmup-stall-seconds", "15",
                 env={**WARM_ENV, "TERMINATION_MESSAGE_PATH": str(message)})
    kids: list[int] = []
    try:
        hold_mid_warmup(srv.proc, srv.url)  # the shard hangs there: no shape finishes any more
        kids = children(srv.proc.pid)

        def refused() -> dict | None:
            live = poll(srv.url + "/livez")
            return live[1] if live and live[0] == 503 else None
        body = wait_for(refused, 60, "/livez to fail")
        assert body["status"] == "stalled" and "no progress for" in body["error"], body
        assert srv.proc.wait(timeout=60) == STALL_EXIT_CODE
    finally:
        signal_all(kids, signal.SIGCONT)
        srv.stop()
    text = message.read_text()
    assert text.startswith("start stalled: no progress for ") and "while warming up" in text, text
    assert "--warmup-stall-seconds 15" in text and text.strip() in srv.log()
    wait_for(lambda: not any(alive(p) for p in kids), 30, "every process to be gone")
