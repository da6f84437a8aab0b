"""How far a pod's start got, across its processes, and the rule that tells a slow start from a stuck one.

A start is a download (the launcher, for a hub id), a load (each shard: its device, its process
group, each weight tensor, its KV cache) and a warmup (the router, one report per shape the shard streams). Each process
reports its steps into a file of its own under the directory the launcher names in
`GAUDI_SERVE_PROGRESS_DIR`; the newest report across the files is the pod's last progress.

The rule (`stall`): a pod that is not yet serving and has reported no step for `--warmup-stall-seconds`
is stuck. Nothing else bounds a start: a warmup of an hour that finishes a shape every minute is never
stuck, where any fixed budget would either kill it or wait an hour for a pod stuck at its first shape.
The liveness endpoint (`/livez`) and the launcher's own watchdog apply the same rule; the launcher then
exits with STALL_EXIT_CODE and says why in the container's termination message.

Times are CLOCK_MONOTONIC (`time.monotonic`), which every process of the machine shares.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROGRESS_DIR_ENV = "GAUDI_SERVE_PROGRESS_DIR"
# EX_TEMPFAIL: the start stalled; a restart may well get through (a hung collective, a stuck mount).
STALL_EXIT_CODE = 75
# The same report again from one process (a tensor of the same file) refreshes the file at most this often.
REPORT_INTERVAL_S = 1.0
READY = "ready"
PHASE_WORDS = {"starting": "starting", "downloading": "downloading the model", "loading": "loading the model",
               "warming_up": "warming up", "prefill": "warming up", "prefill_context": "warming up",
               "decode": "warming up"}

__all__ = ["PROGRESS_DIR_ENV", "STALL_EXIT_CODE", "Step", "latest", "report", "stall"]


@dataclass(frozen=True)
class Step:
    """One process's last report: its phase, how far into it (done of total; 0 of 0 when not counted)."""

    process: str
    phase: str
    done: int
    total: int
    at: float  # time.monotonic() of the report

    def describe(self) -> str:
        words = PHASE_WORDS.get(self.phase, self.phase)
        if self.phase in ("prefill", "prefill_context", "decode"):
            words += f" ({self.phase} shapes)"
        return f"{words}, {self.done}/{self.total}" if self.total else words


def stall(last: Step | None, started_at: float, now: float, window_s: float) -> str | None:
    """Why the start counts as stuck, or None: while serving, with no window (0), or with a step within it."""
    if window_s <= 0 or (last is not None and last.phase == READY):
        return None
    since = max(started_at, last.at if last is not None else started_at)
    idle = now - since
    if idle <= window_s:
        return None
    where = last.describe() if last is not None else "starting"
    return (f"start stalled: no progress for {idle:.0f}s while {where} (--warmup-stall-seconds {window_s:g}); "
            "exiting so that the pod restarts")


class Reporter:
    """One process's reports, written atomically (a reader never sees half a file)."""

    def __init__(self, directory: str | os.PathLike, process: str, interval_s: float = REPORT_INTERVAL_S):
        self.path = Path(directory) / f"{process}.json"
        self.process = process
        self.interval_s = interval_s
        self._last: tuple[tuple[str, int, int], float] = (("", 0, 0), float("-inf"))

    def report(self, phase: str, done: int = 0, total: int = 0) -> None:
        """Written when it says something new; the same report again (a tensor of the same file) only
        refreshes the time, at most every interval_s. A new count is never held back: it may be the last
        one before a long step (a download that hangs), which /health then shows."""
        now = time.monotonic()
        said = (phase, int(done), int(total))
        if said == self._last[0] and now - self._last[1] < self.interval_s:
            return
        self._last = (said, now)
        step = Step(self.process, phase, int(done), int(total), now)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(asdict(step)))
            os.replace(tmp, self.path)
        except OSError:
            pass  # progress is advice: a full or vanished directory must not fail the start


_REPORTER: Reporter | None = None


def start_reporting(process: str, environ=None) -> Reporter | None:
    """This process's reporter, into the launcher's directory (none when not started by the launcher)."""
    global _REPORTER
    directory = (os.environ if environ is None else environ).get(PROGRESS_DIR_ENV)
    _REPORTER = Reporter(directory, process) if directory else None
    return _REPORTER


def report(phase: str, done: int = 0, total: int = 0) -> None:
    """A step of this process (a no-op outside a launched pod)."""
    if _REPORTER is not None:
        _REPORTER.report(phase, done, total)


def latest(directory: str | os.PathLike | None) -> Step | None:
    """The newest report of any process under `directory`."""
    steps = []
    for path in Path(directory).glob("*.json") if directory else ():
        try:
            steps.append(Step(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # replaced while read, or not one of ours
    return max(steps, key=lambda s: s.at, default=None)
