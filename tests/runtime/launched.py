"""Start a real `gaudi-serve launch` on loopback for tests, and stop it leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@dataclass
class Launched:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 240.0, on_poll=None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                code, body = get_json(self.url + "/health", timeout=2)
                if on_poll:
                    on_poll(code, body)
                if code == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.1)  # poll interval of a deadline-bounded wait
        raise TimeoutError(f"server not ready in {timeout_s}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def launch(model_dir: Path | str, tmp: Path, *args: str, env: dict | None = None) -> Launched:
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "gaudi_runtime.cli", "launch", "--model-id", str(model_dir),
           "--hostname", "127.0.0.1", "--port", str(port), "--shard-uds-path", str(tmp / f"shard-{port}"),
           *args]
    full_env = dict(os.environ, LOG_LEVEL="info", **(env or {}))
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return Launched(proc, f"http://127.0.0.1:{port}", log_path)
