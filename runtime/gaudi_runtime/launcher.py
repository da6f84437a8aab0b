"""`gaudi-serve launch`: spawn the shards and the router, supervise, exit non-zero if any dies.

The HTTP port is bound first and answers the probes from the start (start_http.py): during a download
here, then in the router, which inherits the socket. Until the router reports that it serves, a
watchdog applies the stall rule of progress.py to the steps every process reports: a start that has
made no step for --warmup-stall-seconds ends with STALL_EXIT_CODE and the reason in the termination
message, so that Kubernetes restarts the pod and the operator can say why.

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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gaudi_runtime import progress, start_http
from gaudi_runtime.config import Config, ConfigError
from gaudi_runtime.download import DOWNLOAD_SECONDS_ENV, DownloadError, ensure_snapshot
from gaudi_runtime.download_events import LogLines
from gaudi_runtime.router.images import check_image_budget

log = logging.getLogger("gaudi_runtime.launcher")

CONFIG_ENV = "GAUDI_SERVE_CONFIG"
MODEL_DIR_ENV = "GAUDI_SERVE_MODEL_DIR"
STOP_GRACE_S = 10.0
# A shard died: how long the router has to notice (its calls fail), answer /health 503, end every
# stream with an error event and exit by itself (after GAUDI_SERVE_FAIL_EXIT_DELAY_S) before it is stopped.
ROUTER_REPORT_S = 5.0
# While the start is watched: how often the launcher looks at its children and at the progress.
WATCH_INTERVAL_S = 0.5
# A stalled start fails /livez at once; the launcher ends the pod itself only this much later, so that a
# liveness probe (every 10 s by default) sees the failure first and the kubelet reports it as one.
PROBE_FIRST_S = 10.0


class _DownloadSteps(LogLines):
    """The download's progress in the log and, as steps of the start, for the stall rule."""

    def __init__(self, steps: progress.Reporter):
        super().__init__(log)
        self.steps = steps

    def progress(self, done: int, total: int, file: str | None) -> None:
        super().progress(done, total, file)
        self.steps.report("downloading", done, total)


def resolve_model_dir(cfg: Config, steps: progress.Reporter | None = None) -> str:
    """A local directory as is; otherwise a complete, checked hub snapshot, fetched as `gaudi-serve download`
    fetches it (HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE honoured). Raises DownloadError."""
    if os.path.isdir(cfg.model.model_id):
        return cfg.model.model_id
    reporter = _DownloadSteps(steps) if steps is not None else None
    m = cfg.model
    return ensure_snapshot(m.model_id, m.revision, m.huggingface_hub_cache, reporter)["path"]


def resolve_adapters(cfg: Config, model_dir: str, steps: progress.Reporter | None = None) -> Config:
    """`cfg` with every adapter found (a directory, or its hub snapshot fetched as the model's is) and
    checked against the model and --max-lora-rank, before any shard starts: ConfigError when one does
    not fit, DownloadError naming it when its fetch fails."""
    from gaudi_runtime.adapter_sources import resolve_and_check
    from gaudi_runtime.adapters import AdapterError

    reporter = _DownloadSteps(steps) if steps is not None else None
    rank, hub_cache = cfg.adapters.max_lora_rank, cfg.model.huggingface_hub_cache
    try:
        specs = tuple(resolve_and_check(a, model_dir, rank, hub_cache, reporter) for a in cfg.adapters.lora_adapters)
    except AdapterError as e:
        raise ConfigError(f"--lora-adapters: {e}") from None
    return cfg.replace(lora_adapters=specs)


def fetch_and_check(cfg: Config, steps: progress.Reporter, watch: Watchdog) -> tuple[str, Config]:
    """The model's directory, checked, and `cfg` with its adapters resolved; downloads run watched."""
    with watched_download(watch):
        model_dir = resolve_model_dir(cfg, steps)
    check_model(model_dir)
    with watched_download(watch):
        return model_dir, resolve_adapters(cfg, model_dir, steps)


def check_reasoning(cfg: Config, model_dir: str) -> None:
    """--reasoning-parser needs the tokenizer to hold `<think>` and `</think>` as single tokens (the
    shards' grammars wait for the one that ends the thinking): else ConfigError before any shard starts."""
    parser = cfg.structured_output.reasoning_parser
    if parser is None:
        return
    from transformers import AutoTokenizer

    from gaudi_runtime.router.reasoning import thinking_tokens

    tok = AutoTokenizer.from_pretrained(model_dir)  # as the router loads it
    try:
        thinking_tokens(parser, lambda text: tok.encode(text, add_special_tokens=False))
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class Watchdog:
    """The stall rule over the pod's start (progress.py), and what to do when it holds."""

    progress_dir: str
    started_at: float
    window_s: float
    message_path: str

    def serving(self) -> bool:
        last = progress.latest(self.progress_dir)
        return last is not None and last.phase == progress.READY

    def stalled(self) -> str | None:
        """Why the start counts as stuck, by the rule /livez answers by."""
        return progress.stall(progress.latest(self.progress_dir), self.started_at, time.monotonic(), self.window_s)

    def overdue(self) -> str | None:
        """Why the launcher ends the start itself: stuck for PROBE_FIRST_S longer than /livez says so."""
        last, now = progress.latest(self.progress_dir), time.monotonic()
        if self.window_s <= 0 or not progress.stall(last, self.started_at, now, self.window_s + PROBE_FIRST_S):
            return None
        return progress.stall(last, self.started_at, now, self.window_s)

    def give_up(self, why: str) -> int:
        log.error("%s", why)
        write_termination_message(self.message_path, why)
        return progress.STALL_EXIT_CODE


@contextmanager
def watched_download(watch: Watchdog) -> Iterator[None]:
    """While the main thread downloads: the stall rule from a thread, and a SIGTERM (the kubelet's
    liveness probe) that finds the start stalled ends it the same way. Nothing else runs yet, and a
    download resumes where it stopped, so the process ends at once."""
    done = threading.Event()

    def check() -> None:
        while not done.wait(WATCH_INTERVAL_S):
            if why := watch.overdue():
                os._exit(watch.give_up(why))

    def on_term(signum, frame) -> None:
        if why := watch.stalled():
            os._exit(watch.give_up(why))
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    previous = signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=check, name="download-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGTERM, previous)


def write_termination_message(path: str, message: str) -> None:
    """Where the kubelet created the container's termination message file, say why the container ends."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, "w") as f:
            f.write(message + "\n")
    except OSError as e:
        log.warning("could not write the termination message to %s: %s", path, e)


def check_quantized(cfg: Config, model_dir: str) -> None:
    """A pre-quantized checkpoint against --quantize / QUANT_CONFIG / LoRA / --batch-invariant (ConfigError before
    any shard starts)."""
    from gaudi_runtime.models.registry import safetensors_files
    from gaudi_runtime.quant.checkpoint import check_checkpoint

    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    m = cfg.model
    found = check_checkpoint(model_dir, model_config, safetensors_files(model_dir), m.quantize, m.quant_config)
    if found is None:
        return
    if cfg.adapters.lora_adapters or cfg.adapters.allow_runtime_lora_updating:
        raise ConfigError(f"--lora-adapters: LoRA over a quantized base model ({found.describe()}) is not served "
                          "(the adapters' products are not built beside quantized layers)")
    if cfg.device.batch_invariant:
        raise ConfigError(f"--batch-invariant cannot be combined with a quantized checkpoint ({found.describe()}): "
                          "its products round the weights by how many rows a step has")
    log.info("checkpoint quantization: %s", found.describe())


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


def _child_env(cfg: Config, model_dir: str, download_seconds: float | None = None,
               progress_dir: str | None = None) -> dict[str, str]:
    env = dict(os.environ, **{CONFIG_ENV: cfg.to_json(), MODEL_DIR_ENV: model_dir})
    if download_seconds is not None:
        env[DOWNLOAD_SECONDS_ENV] = f"{download_seconds:.3f}"
    if progress_dir is not None:
        env[progress.PROGRESS_DIR_ENV] = progress_dir
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    return env


_EXE = [sys.executable, "-m", "gaudi_runtime.cli"]


def spawn_shards(cfg: Config, model_dir: str, env: dict[str, str] | None = None) -> list[tuple[str, subprocess.Popen]]:
    env = env or _child_env(cfg, model_dir)
    return [
        (f"shard-{rank}", subprocess.Popen(_EXE + ["shard", "--rank", str(rank), "--world-size", str(cfg.device.num_shard)],
                                           env=env, preexec_fn=_die_with_parent, process_group=0))
        for rank in range(cfg.device.num_shard)
    ]


def spawn(cfg: Config, model_dir: str, download_seconds: float | None = None, progress_dir: str | None = None,
          listen_fd: int | None = None) -> list[tuple[str, subprocess.Popen]]:
    """The shards and the router; `listen_fd`: the bound HTTP socket the router serves on (else it binds)."""
    env = _child_env(cfg, model_dir, download_seconds, progress_dir)
    procs = spawn_shards(cfg, model_dir, env)
    router_env = dict(env, **({start_http.LISTEN_FD_ENV: str(listen_fd)} if listen_fd is not None else {}))
    return procs + [("router", subprocess.Popen(_EXE + ["router"], env=router_env, preexec_fn=_die_with_parent,
                                                 process_group=0, pass_fds=() if listen_fd is None else (listen_fd,)))]


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


def _exited(procs: list[tuple[str, subprocess.Popen]], block: bool) -> int | None:
    """The exit code to end with when a child has exited (waiting for one when `block`), else None."""
    # WNOWAIT leaves the child for Popen to reap, so its exit code stays readable.
    if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)) is None:
        return None
    for name, p in procs:
        code = p.poll()
        if code is not None:
            log.error("%s exited with code %s; stopping every process", name, code)
            if name != "router":
                let_router_report(procs)
            return code or 1
    return None


def supervise(procs: list[tuple[str, subprocess.Popen]], grace_s: float = 0.0, watch: Watchdog | None = None) -> int:
    """Block until a child exits, the start stalls (`watch`) or we are told to stop (then the router drains
    for up to `grace_s`); then stop every child."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    try:
        while True:
            code = _exited(procs, block=watch is None)
            if code is not None:
                return code
            if watch is not None and (why := watch.overdue()):
                return watch.give_up(why)
            if watch is not None and watch.serving():
                watch = None  # served once: from now on only a child's exit ends the pod
            elif watch is not None:
                time.sleep(WATCH_INTERVAL_S)
    except _Stop:
        if watch is not None and (why := watch.stalled()):  # the kubelet's liveness probe got there first
            return watch.give_up(why)
        log.info("stop requested; the router finishes its requests (up to %gs), then the shards stop", grace_s)
        return drain_router(procs, grace_s)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all(procs)


def _start_state(progress_dir: str) -> dict:
    """/health before the router has the port: downloading (with its bytes), else loading."""
    last = progress.latest(progress_dir)
    if last is not None and last.phase == "downloading":
        return {"status": "downloading", "download": {"done": last.done, "total": last.total}}
    return {"status": "loading"}


def main(cfg: Config) -> int:
    progress_dir = tempfile.mkdtemp(prefix="gaudi-serve-progress-")
    try:
        return _launch(cfg, progress_dir)
    finally:
        shutil.rmtree(progress_dir, ignore_errors=True)


def _launch(cfg: Config, progress_dir: str) -> int:
    t0 = time.monotonic()
    steps = progress.Reporter(progress_dir, "launcher")
    steps.report("starting")
    try:
        sock = start_http.bind(cfg.server.hostname, cfg.server.port)
    except OSError as e:
        log.error("--hostname %s --port %d: cannot listen: %s", cfg.server.hostname, cfg.server.port, e)
        return 1
    watch = Watchdog(progress_dir, t0, cfg.server.warmup_stall_seconds, cfg.server.termination_message_path)
    early = start_http.StartServer(sock, lambda: _start_state(progress_dir),
                                   lambda: start_http.liveness(progress_dir, t0, cfg.server.warmup_stall_seconds)).start()
    try:
        model_dir, cfg = fetch_and_check(cfg, steps, watch)
    except DownloadError as e:
        log.error("--model-id %s: download failed (%s): %s", cfg.model.model_id, e.reason, e)
        return e.exit_code
    # Seconds spent getting the model, shown in /info (none for a local directory).
    download_seconds = None if model_dir == cfg.model.model_id else time.monotonic() - t0
    steps.report("loading")
    check_image_budget(cfg.limits, json.loads((Path(model_dir) / "config.json").read_text()))
    check_reasoning(cfg, model_dir)
    check_quantized(cfg, model_dir)
    log.info("effective configuration: %s", cfg.to_log_json())  # every flag and env setting, secrets masked
    log.info("launching %d shard(s) and the router for %s", cfg.device.num_shard, model_dir)
    procs = spawn(cfg, model_dir, download_seconds, progress_dir, listen_fd=early.hand_over())
    sock.close()  # the router has its own copy
    return supervise(procs, cfg.server.shutdown_grace_seconds, watch)
