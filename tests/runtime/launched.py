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
from collections.abc import Iterator
from contextlib import contextmanager
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
    model_dir: Path

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
    return Launched(proc, f"http://127.0.0.1:{port}", log_path, Path(model_dir))


# Small shapes so that prompts span several KV blocks, batches are padded and several buckets are used.
SMALL_ARGS = ["--dtype", "float32", "--max-input-tokens", "64", "--max-total-tokens", "128",
              "--max-batch-size", "8", "--max-batch-prefill-tokens", "128", "--block-size", "4",
              "--max-concurrent-requests", "64"]
SMALL_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"}



def serve_small(model_dir: Path | str, tmp: Path, *args: str, env: dict | None = None) -> Launched:
    """A server with SMALL_ARGS and SMALL_ENV (`args` and `env` win over them), once it serves."""
    srv = launch(model_dir, tmp, *SMALL_ARGS, *args, env={**SMALL_ENV, **(env or {})})
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


_REFERENCE: dict[str, tuple] = {}


def greedy_reference(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens on the same weights in fp32: the correctness reference."""
    import torch
    import transformers

    key = str(model_dir)
    if key not in _REFERENCE:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _REFERENCE[key] = (tok, model, {})
    tok, model, cache = _REFERENCE[key]
    if (prompt, max_new_tokens) not in cache:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
        cache[prompt, max_new_tokens] = out[0, ids.shape[1]:].tolist()
    return cache[prompt, max_new_tokens]


async def stream_ids(session, url: str, prompt: str, max_new_tokens: int, started=None, after: int = 2) -> list[int]:
    """Token ids of a /generate_stream; sets `started` once `after` tokens arrived (or at the end)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    ids = []
    async with session.post(url + "/generate_stream", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            ids.append(json.loads(line[5:])["token"]["id"])
            if started is not None and len(ids) >= after:
                started.set()
    if started is not None:
        started.set()
    return ids


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def shard_pids(launcher_pid: int) -> list[int]:
    """The shard processes a launcher started (its other child is the router)."""
    return [p for p in children(launcher_pid) if b"shard" in open(f"/proc/{p}/cmdline", "rb").read()]


def shard_of(srv: Launched) -> int:
    """The one shard of a single-shard server."""
    (shard,) = shard_pids(srv.proc.pid)
    return shard


def signal_all(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids` still alive."""
    for p in pids:
        if alive(p):
            os.kill(p, sig)


def run_in_slices(pids, until, timeout_s: float, slice_max_s: float = 0.05):
    """Run the processes `pids()` names a slice at a time (1 ms, doubling up to `slice_max_s`) until
    `until()`, asked while they are stopped, returns something truthy; return it, leaving them stopped.
    They move about a slice past what `until` waits for (more if what it reads lags them), on a fast
    machine as on a loaded one."""
    deadline, slice_s = time.monotonic() + timeout_s, 0.001
    while True:
        procs = pids()
        signal_all(procs, signal.SIGSTOP)
        try:
            value = until()
        except BaseException:
            signal_all(procs, signal.SIGCONT)  # a failed test leaves no process stopped
            raise
        if value:
            return value
        if time.monotonic() > deadline:
            signal_all(procs, signal.SIGCONT)
            raise TimeoutError(f"nothing after {timeout_s}s of slices")
        signal_all(procs, signal.SIGCONT)
        time.sleep(slice_s)  # the processes' run, not a poll interval
        slice_s = min(slice_s * 2, slice_max_s)


def hold_mid_warmup(launcher: subprocess.Popen, url: str, timeout_s: float = 240.0) -> tuple[list[int], dict]:
    """Stop a launched server's shards from their start and run them in slices until the router shows a
    warmup shape done: (the shards, left stopped; the warmup /health shows). A tiny model warms hundreds
    of shapes in under a second, less than a loaded machine may take between two polls; a slice is far
    shorter (at most 50 ms while loading, 5 ms once the router warms up, so that a router slow to read
    the shard's progress lets it run a few shapes past the first, not the rest), so the warmup is caught
    in its middle however fast it runs. SIGCONT the shards to go on."""
    def health() -> dict | None:
        assert launcher.poll() is None, f"the server exited with {launcher.returncode}"
        try:
            code, body = get_json(url + "/health", timeout=2)
        except OSError:
            return None
        assert code != 200, "the warmup ended within one slice"
        return body if body.get("status") == "warming_up" else None

    def shards() -> list[int]:
        return shard_pids(launcher.pid)
    deadline = time.monotonic() + timeout_s
    run_in_slices(shards, health, timeout_s)
    warmup = run_in_slices(shards, lambda: (b := health()) and b["warmup"]["done"] >= 1 and b["warmup"],
                           deadline - time.monotonic(), slice_max_s=0.005)
    return shards(), warmup


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead for our purposes
    except FileNotFoundError:
        return False


@contextmanager
def running(model_dir: Path | str, tmp: Path, *args: str, env: dict | None = None) -> Iterator[Launched]:
    """`launch`, ready to serve, stopped afterwards (a module fixture's `with`)."""
    srv = launch(model_dir, tmp, *args, env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
