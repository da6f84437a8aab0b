"""How `gaudi-serve download` tells its progress and outcome: a bar on a terminal, JSON lines otherwise.

The JSON lines are a stable interface (the operator reads them from the download Job's log), one
object per line on stdout, every line a complete JSON object with an "event" key:

* ``{"event": "progress", "done": N, "total": M, "file": NAME}``: bytes of the snapshot present so
  far (files already in the cache and resumed partial files included) out of the bytes of every file
  the runtime loads. ``file`` is the file being fetched, or null before the first one. At most one a
  second, plus one when each file is complete.
* ``{"event": "done", "path": DIR, "bytes": M, "fetched": F, "seconds": S, "repo": ID,
  "revision": REV, "commit": SHA}``: the last line of a success (exit code 0). ``path`` is the
  snapshot directory to serve (`--model-id`); ``fetched`` the bytes this run transferred (0 when the
  cache was complete); ``revision`` as asked (null: the default branch), ``commit`` what it resolved to.
  With ``--lora-adapters``, each hub adapter's ``done`` comes first (``repo`` says whose), the model's last.
  The model's also holds ``"config": {...}``, its config.json (left out above 32 KiB): the operator's memory
  estimate reads it.
* ``{"event": "error", "reason": REASON, "message": TEXT[, "adapter": NAME]}``: the last line of a
  failure (``adapter``: the LoRA adapter of ``--lora-adapters`` whose download failed), whose exit
  code is the reason's (see `EXIT_CODES`). Reasons: ``unauthorized`` (the hub refused access: missing
  or wrong HF_TOKEN, gated or private repository), ``not_found`` (no such repository, revision or
  weights), ``no_space`` (the cache volume is full), ``not_cached`` (HF_HUB_OFFLINE is set and the
  cache lacks a complete snapshot), ``corrupt`` (a file failed its checks twice), ``unreachable``
  (connection errors, timeouts, 5xx from the hub), ``interrupted`` (SIGTERM/SIGINT; a later run
  resumes), ``error`` (anything else).

New keys may be added to these objects; existing keys keep their meaning.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Protocol

# Exit code of each error reason: distinct so that a Job's podFailurePolicy can tell a retriable
# failure (unreachable, interrupted) from one that will not heal by itself (unauthorized, not_found).
EXIT_CODES = {"error": 1, "unauthorized": 3, "not_found": 4, "no_space": 5, "not_cached": 6, "corrupt": 7,
              "unreachable": 8, "interrupted": 143}
PROGRESS_INTERVAL_S = 1.0


class Reporter(Protocol):
    def progress(self, done: int, total: int, file: str | None) -> None: ...

    def done(self, result: dict) -> None: ...

    def error(self, reason: str, message: str, adapter: str | None = None) -> None: ...


class JsonLines:
    """The stable machine-readable form (see the module docstring)."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def _emit(self, event: dict) -> None:
        self.stream.write(json.dumps(event) + "\n")
        self.stream.flush()

    def progress(self, done: int, total: int, file: str | None) -> None:
        self._emit({"event": "progress", "done": done, "total": total, "file": file})

    def done(self, result: dict) -> None:
        self._emit({"event": "done", **result})

    def error(self, reason: str, message: str, adapter: str | None = None) -> None:
        self._emit({"event": "error", "reason": reason, "message": message, **({"adapter": adapter} if adapter else {})})


class TerminalBar:
    """A byte progress bar on stderr; the snapshot path alone on stdout at the end (for `$(...)`)."""

    def __init__(self, stdout: IO[str]):
        self.stdout = stdout
        self.bar = None

    def progress(self, done: int, total: int, file: str | None) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        self.bar.total = total
        self.bar.n = done
        if file:
            self.bar.set_description(file, refresh=False)
        self.bar.refresh()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def done(self, result: dict) -> None:
        self._close()
        print(f"{result['repo']}@{result['commit']}: {result['bytes']} bytes ({result['fetched']} fetched) in "
              f"{result['seconds']:.1f}s", file=sys.stderr)
        print(result["path"], file=self.stdout)

    def error(self, reason: str, message: str, adapter: str | None = None) -> None:
        self._close()
        print(f"error: {reason}: {message}", file=sys.stderr)


class LogLines:
    """For `launch`, which downloads before it starts anything: progress in its log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.log = logger
        self.interval_s = interval_s
        self._last = 0.0

    def progress(self, done: int, total: int, file: str | None) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s or done == total:
            self._last = now
            self.log.info("download: %.1f of %.1f MiB%s", done / 2**20, total / 2**20, f" ({file})" if file else "")

    def done(self, result: dict) -> None:
        self.log.info("model %s at commit %s: %d bytes in the cache (%d fetched) in %.1fs", result["repo"],
                      result["commit"], result["bytes"], result["fetched"], result["seconds"])

    def error(self, reason: str, message: str, adapter: str | None = None) -> None:
        self.log.error("download failed (%s): %s", reason, message)


def for_output(mode: str, stdout: IO[str]) -> Reporter:
    """`--progress auto` is a bar when stdout is a terminal and JSON lines when it is not (a pod log)."""
    if mode == "json" or (mode == "auto" and not stdout.isatty()):
        return JsonLines(stdout)
    return TerminalBar(stdout)


class Progress:
    """Counts the snapshot's bytes and tells a reporter, at most every PROGRESS_INTERVAL_S and at each file's end."""

    def __init__(self, reporter: Reporter, total: int, done: int = 0, interval_s: float = PROGRESS_INTERVAL_S):
        self.reporter = reporter
        self.total = total
        self.done = done
        self.interval_s = interval_s
        self.file: str | None = None
        self._last = 0.0

    def advance(self, n: int, file: str | None = None) -> None:
        self.done += n
        self.file = file or self.file
        if time.monotonic() - self._last >= self.interval_s:
            self.report()

    def report(self) -> None:
        self._last = time.monotonic()
        self.reporter.progress(self.done, self.total, self.file)

    def bar_class(self, file: str):
        """A tqdm stand-in for huggingface_hub's `http_get`, counting its chunks into this progress."""
        progress = self

        class _Counter:
            def __init__(self, *args, **kwargs):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                return None

            def update(self, n: int | float | None = 1) -> None:
                progress.advance(int(n or 0), file)

            def close(self) -> None:
                pass

        return _Counter
