"""`gaudi-operator` (the console script) against the emulator: namespaced mode + its liveness endpoint."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from k8s_emulator import ThreadedEmulator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(fn, timeout: float = 60.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = fn()
        except OSError:
            out = None
        if out:
            return out
        time.sleep(0.1)  # polling interval
    raise AssertionError(f"timed out waiting for {what}")


def test_console_script_runs_namespaced_with_liveness(tmp_path: Path) -> None:
    exe = shutil.which("gaudi-operator", path=str(Path(sys.executable).parent)) or shutil.which("gaudi-operator")
    assert exe, "gaudi-operator console script not installed (pip install -e '.[operator]')"
    with ThreadedEmulator() as emu:
        for ns in ("team-a", "team-b"):
            emu.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(emu.kubeconfig()))
        port = _free_port()
        env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"), "GAUDI_OPERATOR_RESYNC_SECONDS": "60"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = (tmp_path / "operator.log").open("w")
        proc = subprocess.Popen([exe, "-n", "team-a", "--standalone", "--log-format", "plain",
                                 "--liveness", f"http://127.0.0.1:{port}/healthz"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200,
                  what="liveness endpoint")
            for ns in ("team-a", "team-b"):
                emu.create({"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
                            "metadata": {"name": "llama", "namespace": ns}, "spec": {"model": {"id": "m"}}})
            _wait(lambda: emu.get("apps/v1", "Deployment", "team-a", "llama"), what="deployment in team-a")
            phase = _wait(lambda: (emu.get("gaudiserve.io/v1alpha1", "InferenceService", "team-a", "llama")
                                   .get("status") or {}).get("phase"), what="status in team-a")
            assert phase == "Pending"
            # team-b is not watched: by the time team-a was handled, team-b had been created and was ignored.
            assert emu.get("apps/v1", "Deployment", "team-b", "llama") is None
            assert not any("/namespaces/team-b/" in p for _, p, *_ in emu.emu.requests if "inferenceservices/" in p)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            log.close()
        output = (tmp_path / "operator.log").read_text()
        assert rc == 0, output
        assert "Traceback" not in output, output
