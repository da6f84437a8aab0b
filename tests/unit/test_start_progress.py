"""The stall rule (progress.py) and the launcher's port before the router has it (start_http.py):
a slow start that keeps making steps is alive, a start without a step for the window is not, and the
probes get an answer from the launcher's first second (a real HTTP server on loopback)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from gaudi_runtime import progress
from gaudi_runtime.progress import Reporter, Step, latest, stall
from gaudi_runtime.start_http import StartServer, bind, liveness


def step(phase: str, at: float, done: int = 0, total: int = 0) -> Step:
    return Step("router", phase, done, total, at)


def test_a_start_is_stuck_only_after_a_window_without_any_step() -> None:
    last = step("decode", at=1000.0, done=80, total=298)
    assert stall(last, started_at=0.0, now=1599.0, window_s=600) is None
    why = stall(last, started_at=0.0, now=1601.0, window_s=600)
    assert why == ("start stalled: no progress for 601s while warming up (decode shapes), 80/298 "
                   "(--warmup-stall-seconds 600); exiting so that the pod restarts")
    # However long the whole start took: only the time since the last step counts.
    assert stall(step("prefill", at=86_000.0, done=5, total=9), 0.0, 86_500.0, 600) is None


def test_no_rule_once_serving_or_with_no_window() -> None:
    assert stall(step(progress.READY, at=0.0), 0.0, 10_000.0, 600) is None
    assert stall(step("loading", at=0.0), 0.0, 10_000.0, 0) is None


def test_before_any_step_the_window_counts_from_the_start() -> None:
    assert stall(None, started_at=100.0, now=150.0, window_s=60) is None
    assert "while starting" in stall(None, started_at=100.0, now=161.0, window_s=60)
    assert "while downloading the model, 10/40" in stall(step("downloading", 100.0, 10, 40), 0.0, 200.0, 60)
    assert "while loading the model" in stall(step("loading", 100.0), 0.0, 200.0, 60)


def test_the_newest_report_of_any_process_is_the_pods_progress(tmp_path) -> None:
    shard, router = Reporter(tmp_path, "shard-0"), Reporter(tmp_path, "router")
    shard.report("loading", 1, 2)
    router.report("prefill", 3, 40)
    (tmp_path / "junk.json").write_text("{not json")
    last = latest(tmp_path)
    assert (last.process, last.phase, last.done, last.total) == ("router", "prefill", 3, 40)
    assert latest(tmp_path / "missing") is None and latest(None) is None


def test_a_new_count_is_always_written_the_same_report_again_at_most_once_an_interval(tmp_path) -> None:
    r = Reporter(tmp_path, "shard-0", interval_s=3600)
    r.report("downloading", 1, 10)
    r.report("downloading", 2, 10)  # then the download hangs: /health must show 2, not 1
    assert latest(tmp_path).done == 2
    at = latest(tmp_path).at
    r.report("downloading", 2, 10)  # the same again (a tensor of the same file): within the interval, not rewritten
    assert latest(tmp_path).at == at
    r.report("decode", 1, 5)
    assert (latest(tmp_path).phase, latest(tmp_path).done) == ("decode", 1)


def test_liveness_answers(tmp_path) -> None:
    Reporter(tmp_path, "launcher").report("downloading", 5, 50)
    at = latest(tmp_path).at
    code, body = liveness(str(tmp_path), started_at=at, window_s=60, now=lambda: at + 59)
    assert code == 200 and body["progress"] == {"phase": "downloading", "done": 5, "total": 50, "idle_seconds": 59}
    code, body = liveness(str(tmp_path), started_at=at, window_s=60, now=lambda: at + 61)
    assert code == 503 and body["status"] == "stalled" and body["error_type"] == "unhealthy"
    assert body["error"].startswith("start stalled: no progress for 61s while downloading the model, 5/50")


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_launchers_port_answers_the_probes_then_passes_to_the_router_unclosed(tmp_path) -> None:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    state = {"status": "downloading", "download": {"done": 1, "total": 4}}
    live = {"code": 200}
    server = StartServer(sock, lambda: state, lambda: (live["code"], {"status": "ok" if live["code"] == 200 else "stalled"}))
    server.start()
    assert get(url + "/health") == (503, state)
    assert get(url + "/ping") == (200, {"status": "ok"})
    assert get(url + "/livez") == (200, {"status": "ok"})
    live["code"] = 503
    assert get(url + "/livez") == (503, {"status": "stalled"})
    code, body = get(url + "/info")  # TGI's routes: TGI's body, with the progress
    assert code == 503 and body["error_type"] == "unhealthy" and "(downloading)" in body["error"]
    assert body["download"] == {"done": 1, "total": 4}
    code, body = get(url + "/v1/models")  # /v1: OpenAI's envelope, as the router will answer it
    assert code == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert "(downloading)" in body["error"]["message"]

    fd = server.hand_over()
    # A probe arriving between the launcher and the router waits in the backlog, then the router answers.
    probe = socket.create_connection(("127.0.0.1", port), timeout=10)
    probe.sendall(b"GET /ping HTTP/1.0\r\n\r\n")
    # The router's socket becomes the descriptor's one owner: `sock`, detached, can no longer close it again
    # once collected (by then the number may be another test's file).
    assert fd == sock.detach()
    router = StartServer(socket.socket(fileno=fd), lambda: {"status": "loading"}, lambda: (200, {"status": "ok"}))
    router.start()
    answer = b""
    while chunk := probe.recv(4096):
        answer += chunk
    probe.close()
    assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b'{"status": "ok"}'), answer
    assert get(url + "/health") == (503, {"status": "loading"})
    router.hand_over()
    router.sock.close()
