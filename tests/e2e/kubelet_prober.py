"""The kubelet's prober and restarts, for one pod whose container a test plays with a real process.

kwok runs no container and no probe. Where a scenario is about what the probes do to a real runtime
(scenario 6c), this stand-in does the kubelet's part for that pod, from the pod's own spec:

* it starts the container's command (restartPolicy Always: again after each exit), creating an empty
  termination message file first, as the kubelet does (the runtime is pointed at it with
  TERMINATION_MESSAGE_PATH, since nothing is mounted at /dev/termination-log here);
* it runs the startupProbe, then the livenessProbe and the readinessProbe, each an httpGet on the pod
  IP with the probe's periodSeconds, timeoutSeconds and failureThreshold (success: a status in
  200..399); a liveness (or startup) failure kills the container as the kubelet does: SIGTERM to its
  main process, SIGKILL to what is left after the pod's terminationGracePeriodSeconds;
* it reports what the kubelet reports in the pod's status: Ready and ContainersReady from the
  readiness probe, and on each restart restartCount and lastState.terminated (exit code, reason, and
  the message: the termination message file, or with FallbackToLogsOnError and a failed exit the
  log's tail, as the kubelet takes it).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.harness import Kube
from tests.e2e.netwatch import WATCH

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
LOG_TAIL_BYTES = 2048  # what the kubelet keeps of the log's tail as a message (FallbackToLogsOnError)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Probe:
    """One of the container's probes, with its consecutive failures and when it runs next."""

    spec: dict[str, Any]
    failures: int = 0
    due: float = 0.0

    def run(self, ip: str) -> bool:
        get = self.spec["httpGet"]
        url = f"http://{ip}:8080{get['path']}"  # port "http": the container's 8080
        self.due = time.monotonic() + self.spec.get("periodSeconds", 10)
        try:
            with NO_PROXY.open(url, timeout=self.spec.get("timeoutSeconds", 1)) as r:
                ok = 200 <= r.status < 400
        except urllib.error.HTTPError as e:
            ok = 200 <= e.code < 400
        except OSError:
            ok = False
        self.failures = 0 if ok else self.failures + 1
        return ok

    @property
    def failed(self) -> bool:
        return self.failures >= self.spec.get("failureThreshold", 3)


@dataclass
class ProbingKubelet:
    """The kubelet for `pod` (see the module docstring); `command(workdir)` gives the container's
    command line and environment."""

    kube: Kube
    pod: dict[str, Any]
    command: Callable[[Path], tuple[list[str], dict[str, str]]]
    workdir: Path
    started: list[subprocess.Popen] = field(default_factory=list)  # every container run, for clean-up
    kills: list[str] = field(default_factory=list)  # which probe killed a run
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def proc(self) -> subprocess.Popen:
        return self.started[-1]

    @property
    def restarts(self) -> int:
        return len(self.started) - 1

    def log_path(self, run: int) -> Path:
        return self.workdir / f"runtime-{run}.log"

    def start(self) -> ProbingKubelet:
        self._launch()
        self._thread = threading.Thread(target=self._loop, name="kubelet-prober", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _launch(self) -> None:
        message = self.workdir / "termination-log"
        message.write_text("")  # a new, empty file for each container, as the kubelet mounts one
        cmd, env = self.command(self.workdir)
        env["TERMINATION_MESSAGE_PATH"] = str(message)
        with open(self.log_path(len(self.started)), "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started.append(proc)
        WATCH.watch(proc.pid)

    def _loop(self) -> None:
        container = self.pod["spec"]["containers"][0]
        ip = self.pod["status"]["podIP"]
        while not self._stop.is_set():
            startup, liveness, readiness = (Probe(container[k]) for k in ("startupProbe", "livenessProbe",
                                                                          "readinessProbe"))
            ready = started = False
            while not self._stop.is_set() and self.proc.poll() is None:
                now = time.monotonic()
                if not started and startup.due <= now:
                    started = startup.run(ip)
                    if startup.failed:
                        self._kill("startupProbe")
                elif started and liveness.due <= now:
                    liveness.run(ip)
                    if liveness.failed:
                        self._kill("livenessProbe")
                if started and not ready and readiness.due <= now and readiness.run(ip):
                    ready = True
                    self.kube.mark_ready(self._read_pod())
                self._stop.wait(0.05)  # the prober's tick; each probe keeps its own period
            if self._stop.is_set():
                return
            self._restart()

    def _kill(self, probe: str) -> None:
        """What the kubelet does to a container whose probe failed: SIGTERM, the grace period, SIGKILL."""
        self.kills.append(probe)
        grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _terminated(self) -> dict[str, Any]:
        code = self.proc.returncode
        code = 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a container shows it
        message = (self.workdir / "termination-log").read_text()
        if not message.strip() and code != 0:  # FallbackToLogsOnError
            message = self.log_path(len(self.started) - 1).read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
        return {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message,
                "finishedAt": _now()}

    def _restart(self) -> None:
        """restartPolicy Always: the container's end goes to lastState, and it runs again, not ready."""
        pod = self._read_pod()
        terminated = self._terminated()
        (status,) = pod["status"]["containerStatuses"]
        conds = [c for c in pod["status"].get("conditions") or [] if c["type"] not in ("Ready", "ContainersReady")]
        conds += [{"type": t, "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": _now()}
                  for t in ("Ready", "ContainersReady")]
        self._launch()
        status = {**status, "ready": False, "restartCount": self.restarts,
                  "state": {"running": {"startedAt": _now()}}, "lastState": {"terminated": terminated}}
        self.kube.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"],
            {"status": {"conditions": conds, "containerStatuses": [status]}},
            _content_type="application/merge-patch+json")

    def _read_pod(self) -> dict[str, Any]:
        meta = self.pod["metadata"]
        pod = self.kube.core.read_namespaced_pod(meta["name"], meta["namespace"])
        return self.kube.client.sanitize_for_serialization(pod)
