"""Graceful shutdown of a real `gaudi-serve launch` (tiny model, CPU), SIGTERM sent to the launcher
alone as the kubelet does on a pod deletion: the running stream ends with its final event, new
requests get 503 in TGI's shape and /health 503, the launcher exits 0 and leaves no process; past
--shutdown-grace-seconds, a stream still running ends with an error event instead.

The shard is held with SIGSTOP once the stream has its first tokens, and SIGTERM comes only once the
router still reports the request running with the shard held: on a loaded machine the shard may have
made every token before the stop landed, and then the test holds the shard again with a new stream.
So the stream is running while the test looks at the draining server, whatever this machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.launched import (
    SMALL_ARGS,
    SMALL_ENV,
    Launched,
    alive,
    children,
    get_json,
    launch,
    shard_of,
)

MAX_NEW_TOKENS = 60
ENV = {**SMALL_ENV, "WARMUP_ENABLED": "false", "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@dataclass
class Stream:
    """A /generate_stream read in a thread: its events, and whether the server closed it."""

    url: str
    hold_pid: int  # the shard, stopped (SIGSTOP) by the reader as soon as tokens come: a tiny model is fast
    events: list[dict] = field(default_factory=list)
    got_tokens: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        body = json.dumps({"inputs": "Drain me slowly", "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}).encode()
        req = urllib.request.Request(self.url + "/generate_stream", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data:"):
                        self.events.append(json.loads(line[5:]))
                        if len(self.events) == 2:
                            os.kill(self.hold_pid, signal.SIGSTOP)
                            self.got_tokens.set()
        finally:
            self.got_tokens.set()
            self.done.set()


def wait_until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)  # poll interval of a deadline-bounded wait
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def post_generate(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/generate", data=json.dumps({"inputs": "late", "parameters": {
        "max_new_tokens": 2}}).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def running_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        families = text_string_to_metric_families(r.read().decode())
    return sum(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples)


def start_draining(srv: Launched) -> tuple[Stream, int, list[int]]:
    """A stream running on a held shard, then SIGTERM to the launcher alone (as the kubelet signals
    a container's PID 1, not its process group)."""
    kids = children(srv.proc.pid)
    shard = shard_of(srv)
    for _ in range(5):
        stream = Stream(srv.url, shard).start()
        assert stream.got_tokens.wait(120) and len(stream.events) >= 2, stream.events
        if running_requests(srv.url) >= 1:
            os.kill(srv.proc.pid, signal.SIGTERM)
            return stream, shard, kids
        os.kill(shard, signal.SIGCONT)  # it had finished before the stop: again
        assert stream.done.wait(120)
    raise AssertionError("every stream finished before the shard could be held")


def health(url: str) -> tuple[int, dict] | None:
    try:
        return get_json(url + "/health", timeout=5)
    except OSError:
        return None


def assert_all_gone(srv: Launched, kids: list[int], code: int) -> None:
    assert srv.proc.wait(timeout=60) == code, srv.log()[-3000:]
    wait_until(lambda: not any(alive(p) for p in kids), 30, "every child process to exit")


def test_sigterm_lets_the_running_stream_finish_refuses_new_requests_then_exits_0(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, *SMALL_ARGS, "--shutdown-grace-seconds", "60", env=ENV)
    try:
        srv.wait_ready()
        stream, shard, kids = start_draining(srv)
        code, body = wait_until(lambda: (h := health(srv.url)) and h[0] == 503 and h, 30,
                                "/health to answer 503 while draining")
        assert body["status"] == "draining" and body["error_type"] == "unhealthy", body
        code, body = post_generate(srv.url)
        assert (code, body["error_type"]) == (503, "unhealthy") and "shutting down" in body["error"], body
        assert get_json(srv.url + "/ping")[0] == 200  # liveness holds: the kubelet must not restart it
        assert get_json(srv.url + "/livez") == (200, {"status": "ok"})
        os.kill(shard, signal.SIGCONT)
        assert stream.done.wait(120)
        last = stream.events[-1]
        assert "error" not in last, last
        assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == MAX_NEW_TOKENS
        assert len(stream.events) == MAX_NEW_TOKENS
        assert_all_gone(srv, kids, 0)
        assert "every request finished" in srv.log()
    finally:
        srv.stop()


def test_a_stream_still_running_at_the_end_of_the_grace_period_ends_with_an_error_event(model_dir, tmp_path):
    srv = launch(model_dir, tmp_path, *SMALL_ARGS, "--shutdown-grace-seconds", "2", env=ENV)
    try:
        srv.wait_ready()
        stream, shard, kids = start_draining(srv)
        assert stream.done.wait(120), "the stream was not ended after the grace period"
        last = stream.events[-1]
        assert last["error_type"] == "generation" and "grace period" in last["error"], last
        assert all("error" not in e and e["details"] is None for e in stream.events[:-1])
        os.kill(shard, signal.SIGCONT)  # the launcher stops it next
        assert_all_gone(srv, kids, 0)
    finally:
        srv.stop()
