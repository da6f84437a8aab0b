"""`gaudi-serve launch`: spawn the shards and the router, supervise, exit non-zero if any dies.

SIGTERM (what the kubelet sends when a pod is deleted) or SIGINT shuts down in
order: the router first, which stops admitting and lets running requests
finish for up to --shutdown-grace-seconds (router/drain.py), then the shards it
was using. A second signal is passed on to the router, which then ends what is
left at once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gaudi_runtime.config import Config, ConfigError
from gaudi_runtime.download import DOWNLOAD_SECONDS_ENV, DownloadError, ensure_snapshot
from gaudi_runtime.router.images import check_image_budget

log = logging.getLogger("gaudi_runtime.launcher")

CONFIG_ENV = "GAUDI_SERVE_CONFIG"
MODEL_DIR_ENV = "GAUDI_SERVE_MODEL_DIR"
STOP_GRACE_S = 10.0
# A shard died: how long the router has to notice (its calls fail), answer /health 503, end every
# stream with an error event and exit by itself (after GAUDI_SERVE_FAIL_EXIT_DELAY_S) before it is stopped.
ROUTER_REPORT_S = 5.0


def resolve_model_dir(cfg: Config) -> str:
    """A local directory as is; otherwise a complete, checked hub snapshot, fetched as `gaudi-serve download`
    fetches it (HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE honoured). Raises DownloadError."""
    if os.path.isdir(cfg.model_id):
        return cfg.model_id
    return ensure_snapshot(cfg.model_id, cfg.revision, cfg.huggingface_hub_cache)["path"]


def check_model(model_dir: str) -> None:
    """Fail before spawning anything if the model cannot be served."""
    from gaudi_runtime.models import SUPPORTED_ARCHITECTURES

    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"--model-id: {model_dir} has no config.json")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    served = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not served:
        raise ConfigError(
            f"--model-id: architecture {', '.join(archs) or '(none)'} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    # A variant the model class refuses (e.g. an ALiBi Falcon) fails here, not as a shard traceback.
    try:
        SUPPORTED_ARCHITECTURES[served[0]].config_class.from_dict(cfg, served[0])
    except KeyError as e:
        raise ConfigError(f"--model-id: {model_dir}/config.json lacks {e} for {served[0]}") from e
    except ValueError as e:
        raise ConfigError(f"--model-id: {model_dir}: {e}") from e
    if not list(Path(model_dir).glob("*.safetensors")):
        raise ConfigError(f"--model-id: {model_dir} has no .safetensors weights")


def _die_with_parent() -> None:
    # Children must not outlive the launcher, even when it is killed with SIGKILL. They run in
    # process groups of their own, so a signal to the launcher's group (Ctrl-C in a terminal)
    # reaches only the launcher, which passes it on once.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(cfg: Config, model_dir: str, download_seconds: float | None = None) -> dict[str, str]:
    env = dict(os.environ, **{CONFIG_ENV: cfg.to_json(), MODEL_DIR_ENV: model_dir})
    if download_seconds is not None:
        env[DOWNLOAD_SECONDS_ENV] = f"{download_seconds:.3f}"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    return env


_EXE = [sys.executable, "-m", "gaudi_runtime.cli"]


def spawn_shards(cfg: Config, model_dir: str, env: dict[str, str] | None = None) -> list[tuple[str, subprocess.Popen]]:
    env = env or _child_env(cfg, model_dir)
    return [
        (f"shard-{rank}", subprocess.Popen(_EXE + ["shard", "--rank", str(rank), "--world-size", str(cfg.num_shard)],
                                           env=env, preexec_fn=_die_with_parent, process_group=0))
        for rank in range(cfg.num_shard)
    ]


def spawn(cfg: Config, model_dir: str, download_seconds: float | None = None) -> list[tuple[str, subprocess.Popen]]:
    env = _child_env(cfg, model_dir, download_seconds)
    procs = spawn_shards(cfg, model_dir, env)
    return procs + [("router", subprocess.Popen(_EXE + ["router"], env=env, preexec_fn=_die_with_parent,
                                                 process_group=0))]


def stop_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    for _, p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for _, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Stop(Exception):
    pass


def _raise_stop(*_):
    raise _Stop


def let_router_report(procs: list[tuple[str, subprocess.Popen]]) -> None:
    """Give the router up to ROUTER_REPORT_S to exit on its own after a shard died, so that its
    clients get error events and /health its 503 rather than a connection cut mid-answer."""
    router = dict(procs).get("router")
    if router is None:
        return
    try:
        router.wait(timeout=ROUTER_REPORT_S)
    except (subprocess.TimeoutExpired, _Stop):  # an idle router may not notice: it is stopped next
        pass


def drain_router(procs: list[tuple[str, subprocess.Popen]], grace_s: float) -> int:
    """Stop the router gracefully (SIGTERM: it drains for up to `grace_s`); 0 when it exited cleanly."""
    router = dict(procs)["router"]

    def pass_on(*_) -> None:  # a second signal: the router ends its requests now
        if router.poll() is None:
            router.send_signal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)
    pass_on()
    try:
        code = router.wait(timeout=grace_s + STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log.error("the router did not stop within %gs of its grace period; killing it", STOP_GRACE_S)
        router.kill()
        router.wait()
        return 1
    if code:
        log.error("the router exited with code %s while shutting down", code)
    return 0 if code == 0 else 1


def supervise(procs: list[tuple[str, subprocess.Popen]], grace_s: float = 0.0) -> int:
    """Block until a child exits or we are told to stop (then the router drains for up to `grace_s`);
    then stop every child."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    try:
        while True:
            # WNOWAIT leaves the child for Popen to reap, so its exit code stays readable.
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            for name, p in procs:
                code = p.poll()
                if code is not None:
                    log.error("%s exited with code %s; stopping every process", name, code)
                    if name != "router":
                        let_router_report(procs)
                    return code or 1
    except _Stop:
        log.info("stop requested; the router finishes its requests (up to %gs), then the shards stop", grace_s)
        return drain_router(procs, grace_s)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all(procs)


def main(cfg: Config) -> int:
    t0 = time.monotonic()
    try:
        model_dir = resolve_model_dir(cfg)
    except DownloadError as e:
        log.error("--model-id %s: model download failed (%s): %s", cfg.model_id, e.reason, e)
        return e.exit_code
    # Seconds spent getting the model, shown in /info (none for a local directory).
    download_seconds = None if model_dir == cfg.model_id else time.monotonic() - t0
    check_model(model_dir)
    check_image_budget(cfg, json.loads((Path(model_dir) / "config.json").read_text()))
    log.info("effective configuration: %s", cfg.to_log_json())  # every flag and env setting, secrets masked
    log.info("launching %d shard(s) and the router for %s", cfg.num_shard, model_dir)
    return supervise(spawn(cfg, model_dir, download_seconds), cfg.shutdown_grace_seconds)
