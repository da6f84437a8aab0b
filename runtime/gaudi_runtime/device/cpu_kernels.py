"""Small C kernels for the CPU backend, compiled at first use and cached.

A kernel's C source ships with the package and is compiled with the system C compiler (``$CC``, else
``cc``) for this CPU (``-march=native``), into a per-user cache (``$XDG_CACHE_HOME/gaudi-serve/kernels``;
a directory of the user's own under the temporary directory where that is read-only) keyed by everything
that changes the binary (source and the headers beside it, flags, compiler command and version, CPU
flags, the OpenMP runtime torch loaded), so a restart loads it in milliseconds. It is written under a
temporary name and renamed, so that shards and tests compiling at once never load a half-written file.
Callers load it with ``ctypes`` (``CDLL``: calls release the GIL) and fall back to torch when it cannot
be had.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

K = TypeVar("K")

# No -ffast-math: the kernels order their sums themselves (docs/performance.md has the flags measured).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11")
COMPILE_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def compiler(environ=None) -> list[str]:
    """The C compiler command: ``$CC`` (may carry arguments, e.g. ``ccache gcc``), else ``cc``."""
    environ = os.environ if environ is None else environ
    return shlex.split(environ.get("CC") or "") or ["cc"]


def cache_dir(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gaudi-serve" / "kernels"


def _writable_dir(environ=None) -> Path:
    """The cache directory, else (a read-only home, a user without one) a directory of this user's own
    under the temporary directory, which nobody else may write to: the library found there is loaded."""
    directory = cache_dir(environ)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    directory = Path(tempfile.gettempdir()) / f"gaudi-serve-kernels-{os.getuid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        st = directory.stat()
    except OSError as e:
        raise KernelUnavailable(f"no writable directory for the kernel ({cache_dir(environ)}, {directory}): {e}") \
            from None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise KernelUnavailable(f"{directory} belongs to another user or others may write to it")
    return directory


def _cpu_flags() -> str:
    """What -march=native sees: the CPU's feature flags (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def openmp_runtime() -> str | None:
    """The libgomp torch has loaded (Linux), which the kernel links against: a wheel may ship it under
    a name of its own, and a kernel linked to the system's would then load a second OpenMP runtime,
    whose threads would compete with torch's for the same cores. None: link the compiler's own."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    return min(paths) if len(paths) == 1 else None


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{shlex.join(cmd[:1])}: {e}") from None
    if done.returncode != 0:
        raise KernelUnavailable(f"{shlex.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout


def build(source: Path, name: str, environ=None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library compiled from `source` for this compiler and CPU, named `name`-<key>.so: from the cache,
    else compiled into it. `extra_flags`: this kernel's own, after FLAGS."""
    cc = compiler(environ)
    flags = (*FLAGS, *extra_flags)
    version = (_run([*cc, "--version"]).splitlines() or [""])[0]
    runtime = openmp_runtime()
    link = [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else ["-lgomp"]
    # The compiler's own command is part of the key: $CC may carry flags (e.g. -mno-avx512f).
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what `#include "..."` finds
    key = hashlib.sha256("\0".join([source.read_text(), *headers, shlex.join(cc), shlex.join(flags),
                                     shlex.join(link), version, _cpu_flags()]).encode())
    directory = _writable_dir(environ)
    target = directory / f"{name}-{key.hexdigest()[:24]}.so"
    if target.exists():
        return target
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {directory}: {e}") from None
    try:
        # Compiled, then linked without -fopenmp, which would add the compiler's own libgomp.
        _run([*cc, *flags, "-c", "-o", f"{tmp}.o", str(source)])
        _run([*cc, "-shared", "-o", tmp, f"{tmp}.o", *link])
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        for leftover in (tmp, f"{tmp}.o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def load(source: Path, name: str, wrap: Callable[[Path], K], environ=None, extra_flags: tuple[str, ...] = ()) -> K:
    """Build (or find) the library and wrap it (``wrap(path)`` opens it with ctypes); raises
    KernelUnavailable saying why not."""
    path = build(source, name, environ, extra_flags)
    try:
        return wrap(path)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None


def load_or_warn(load_kernel: Callable[[], K], what: str, instead: str, log: logging.Logger) -> K | None:
    """``load_kernel()``, or None after a warning that names `what` kernel is missing and what runs
    `instead`."""
    try:
        k = load_kernel()
    except KernelUnavailable as e:
        log.warning("cpu: no %s kernel (%s); %s", what, e, instead)
        return None
    log.info("cpu: %s kernel %s", what, k.path)
    return k
