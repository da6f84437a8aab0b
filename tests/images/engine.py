"""The container engine of the image tests, and the images they run.

podman, with storage of its own under ~/.cache/gaudi-serve/containers (overlay): the tests never
touch a user's images, and the layers of the last build stay there as the next run's build
cache (the dependencies' layer, torch included, is rebuilt only when pyproject.toml changes).
The images are built by hack/build-images.sh (what `make images` runs) from the offline base of
hack/base-image.sh, in the background from the end of collection on (tests/conftest.py), so
that a cold build overlaps the other tests instead of adding to them.

Containers run with host networking (everything stays on 127.0.0.1, as tests/e2e/netwatch.py
requires) and the security settings of the pod that would run the image (`pod_flags`).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GAUDI_SERVE_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gaudi-serve")
STORE = CACHE / "containers"
OPERATOR_IMAGE = "localhost/gaudi-serve-test/operator:latest"
RUNTIME_IMAGE = "localhost/gaudi-serve-test/runtime:latest"
SESSION_LABEL = "io.gaudiserve.test-session"
BUILD_TIMEOUT_S = 45 * 60
# Only PyPI is reachable from CI: torch comes from there (with its CUDA libraries) rather than
# from the CPU-only index the Dockerfile names.
TORCH_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://pypi.org/simple")


class Podman:
    """`podman` on the tests' own storage."""

    def __init__(self, store: Path = STORE) -> None:
        store.mkdir(parents=True, exist_ok=True)
        conf = store / "storage.conf"
        conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{store / "storage"}"\n'
                        f'runroot = "{store / "run"}"\n')
        self.env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf)}
        self.store = store
        self.session = uuid.uuid4().hex[:12]
        self._run_flags: list[str] | None = None

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
        return out

    def inspect(self, image: str) -> dict[str, Any]:
        return json.loads(self("image", "inspect", image).stdout)[0]

    def run_flags(self, image: str) -> list[str]:
        """What `podman run` needs on this machine, found once by starting `true` in `image`.

        As root, podman asks for resource limits of 1048576 open files and processes, which a
        machine without CAP_SYS_RESOURCE (a VM like CI's) refuses: the limits this process has
        are given instead. crun refuses a hybrid cgroup hierarchy with controllers on its v2
        side, where runc works."""
        if self._run_flags is None:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            limits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]
            tried = []
            for flags in ([], limits, ["--runtime", "runc", *limits]):
                out = self("run", "--rm", "--network", "host", *flags, "--entrypoint", "true", image, check=False)
                if out.returncode == 0:
                    self._run_flags = flags
                    break
                tried.append(f"{flags}: {out.stderr.strip()[-500:]}")
            else:
                raise AssertionError("podman cannot run a container here:\n" + "\n".join(tried))
        return self._run_flags

    def start(self, image: str, args: list[str], flags: list[str]) -> Container:
        name = f"gaudi-serve-test-{uuid.uuid4().hex[:8]}"
        self("run", "--detach", "--name", name, "--network", "host", "--label", f"{SESSION_LABEL}={self.session}",
             *self.run_flags(image), *flags, image, *args)
        return Container(self, name)

    def cleanup(self) -> None:
        """Remove this session's containers, and images no tag holds any more (earlier builds)."""
        ids = self("ps", "--all", "--quiet", "--filter", f"label={SESSION_LABEL}={self.session}", check=False)
        for cid in ids.stdout.split():
            self("rm", "--force", cid, check=False)
        self("image", "prune", "--force", check=False, timeout=600)

    def remove_leftovers(self) -> None:
        """Before a build: remove what an interrupted session left in this storage, which no later
        prune would: containers (a build stopped mid-step keeps its working container, with the
        layer it was writing: gigabytes in the dependencies' step) and the untagged images they held.
        The storage is the tests' own, so nothing in it belongs to anyone else."""
        ids = self("ps", "--all", "--external", "--quiet", check=False)
        for cid in ids.stdout.split():
            self("rm", "--force", cid, check=False)
        self("image", "prune", "--force", "--external", check=False, timeout=600)


@dataclass
class Container:
    podman: Podman
    name: str

    def pid(self) -> int:
        return int(self.podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout)

    def running(self) -> bool:
        return self.podman("inspect", "--format", "{{.State.Running}}", self.name).stdout.strip() == "true"

    def logs(self) -> str:
        out = self.podman("logs", self.name, check=False)
        return (out.stdout + out.stderr)[-4000:]

    def users(self) -> set[tuple[int, int]]:
        """(uid, gid) of each of the container's processes, read on the host (/proc)."""
        pids = self.podman("top", self.name, "hpid").stdout.split()[1:]
        out = set()
        for pid in pids:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            out.add((int(status["Uid"].split()[1]), int(status["Gid"].split()[1])))  # effective ids
        return out

    def stop(self, grace: int = 30) -> int:
        """SIGTERM, as the kubelet sends it; the exit code."""
        self.podman("stop", "--time", str(grace), self.name, timeout=grace + 60)
        return int(self.podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout)

    def remove(self) -> None:
        self.podman("rm", "--force", self.name, check=False)


def pod_flags(pod_spec: dict[str, Any], container: dict[str, Any], binds: dict[str, str]) -> list[str]:
    """`podman run` flags for what a pod spec says about its container: user and group, read-only
    root filesystem, capabilities, privilege escalation, environment (plain values) and volumes.
    `binds` maps mount paths to host paths (`/host/dir` or `/host/dir:ro`): they stand in for the
    pod's volumes at those paths (a PVC, the ServiceAccount token); an emptyDir is a tmpfs."""
    sc = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    flags = []
    if "runAsUser" in sc:
        flags += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    if sc.get("readOnlyRootFilesystem"):
        flags += ["--read-only"]  # podman also mounts a tmpfs on /tmp, /var/tmp and /run then
    caps = sc.get("capabilities") or {}
    flags += [f"--cap-drop={c}" for c in caps.get("drop") or []]
    flags += [f"--cap-add={c}" for c in caps.get("add") or []]
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    flags += [f"--env={e['name']}={e['value']}" for e in container.get("env") or [] if "value" in e]
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    for m in container.get("volumeMounts") or []:
        path, empty = m["mountPath"], volumes[m["name"]].get("emptyDir")
        if path in binds:
            continue
        assert empty is not None, f"volume {m['name']} at {path}: give a host path for it"
        size = _podman_size(empty.get("sizeLimit"))
        if path == "/dev/shm":
            flags += [f"--shm-size={size}"] if size else []
        else:
            flags += ["--tmpfs", f"{path}:size={size}" if size else path]
    for path, host in binds.items():
        source, _, mode = host.partition(":")
        flags += [f"--volume={source}:{path}" + (f":{mode}" if mode else "")]
    return flags


def _podman_size(quantity: str | None) -> str | None:
    """A Kubernetes quantity (16Gi, 64Mi) in podman's units (16g, 64m)."""
    if not quantity:
        return None
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g"), ("Ti", "t")):
        if quantity.endswith(suffix):
            return quantity[:-2] + unit
    return quantity


def image_env(config: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in config.get("Env") or [])


@dataclass
class Images:
    podman: Podman
    base: str
    operator: str = OPERATOR_IMAGE
    runtime: str = RUNTIME_IMAGE
    seconds: dict[str, float] = field(default_factory=dict)

    def config(self, image: str) -> dict[str, Any]:
        return self.podman.inspect(image)["Config"]

    def size(self, image: str) -> int:
        return int(self.podman.inspect(image)["Size"])


class Build:
    """Provision podman and build both images in a background thread, logging to `log`."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.result: Images | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="image-build", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")  # this session's build only
        self._thread.start()

    def _step(self, what: str, cmd: list[str], env: dict[str, str], timings: dict[str, float]) -> str:
        if self._stopping:
            raise RuntimeError("the session ended")
        start = time.monotonic()
        with open(self.log, "a") as out:
            out.write(f"\n===== {what}: {' '.join(cmd)}\n")
            out.flush()
            self.proc = subprocess.Popen(["nice", "-n", "19", *cmd], stdout=subprocess.PIPE, stderr=out,
                                         text=True, env=env, cwd=ROOT, start_new_session=True)
            stdout, _ = self.proc.communicate(timeout=BUILD_TIMEOUT_S)
        timings[what] = time.monotonic() - start
        if self.proc.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {self.proc.returncode})")
        return stdout.strip().splitlines()[-1] if stdout.strip() else ""

    def _run(self) -> None:
        timings: dict[str, float] = {}
        try:
            self._step("podman", [str(ROOT / "hack" / "container-engine.sh"), "--install-podman"], dict(os.environ),
                       timings)
            podman = Podman()
            podman.remove_leftovers()
            env = {**podman.env, "ENGINE": "podman", "PYTHON": sys.executable}
            base = self._step("base image", [str(ROOT / "hack" / "base-image.sh")], env, timings)
            self._step("images", [str(ROOT / "hack" / "build-images.sh")], {
                **env, "PYTHON_IMAGE": base, "OPERATOR_IMAGE": OPERATOR_IMAGE, "RUNTIME_IMAGE": RUNTIME_IMAGE,
                "VARIANT": "cpu", "IMAGES": "operator runtime", "TORCH_CPU_INDEX": TORCH_INDEX}, timings)
            self.result = Images(podman, base, seconds=timings)
        except Exception as exc:  # reported by the `images` fixture, as a failure
            tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            self.error = f"{exc} (log: {self.log})\n{tail}"

    def wait(self) -> Images:
        self._thread.join(BUILD_TIMEOUT_S)
        if self.result is None:
            raise RuntimeError(self.error or f"the image build did not finish in {BUILD_TIMEOUT_S}s")
        return self.result

    def stop(self) -> None:
        """Stop a build still running (the session ended before it was needed)."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self._thread.join(60)
