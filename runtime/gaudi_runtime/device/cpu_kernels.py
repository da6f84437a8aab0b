"""Small C kernels for the CPU backend: prebuilt at install time, else compiled at first use and cached.

Each ``device/cpu_*.c`` is one kernel (its name without ``cpu_``; compiler flags of its own on a line
``// gaudi-serve cflags: ...``): a new kernel is that file and the Python that calls it, with no list to
extend. ``gaudi-serve build-kernels`` (the image build, ``make venv``) compiles every one for each
instruction-set level of this machine (``cpu_isa``) into a directory (``$GAUDI_SERVE_KERNELS``, else
``prebuilt/`` beside this module), so that a server starts without a compiler. At start the loader takes
the best prebuilt level this CPU runs whose file name carries the key of today's source (source and the
headers beside it, flags, the OpenMP runtime torch loaded): an edited kernel is not served a stale build.
No prebuilt library that loads: the kernel is compiled with the system C compiler (``$CC``, else ``cc``)
for this CPU (``-march=native``) into a per-user cache (``$XDG_CACHE_HOME/gaudi-serve/kernels``; a
directory of the user's own under the temporary directory where that is read-only), keyed as above plus
the compiler and the CPU's flags, so a restart loads it in milliseconds. Every library is written under a
temporary name and renamed, so that shards and tests compiling at once never load a half-written file.
Callers load it with ``ctypes`` (``CDLL``: calls release the GIL) and fall back to torch when it cannot
be had.

Every library links against the libgomp torch has loaded, whose soname it records (no path is needed at
load time: the dynamic loader matches the soname to the library already in the process), so a kernel's
threads are torch's: one OpenMP runtime.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from gaudi_runtime.device import cpu_isa

K = TypeVar("K")
log = logging.getLogger(__name__)

# No -ffast-math: the kernels order their sums themselves (docs/performance.md has the flags measured).
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=gnu11")
FLAGS = (*BASE_FLAGS, "-march=native")  # compiled at start, for this CPU
COMPILE_TIMEOUT_S = 120
HERE = Path(__file__).parent
PREBUILT = HERE / "prebuilt"  # build-kernels' default output, shipped with the package when present
KERNELS_ENV = "GAUDI_SERVE_KERNELS"
_CFLAGS_LINE = re.compile(r"^\s*//\s*gaudi-serve cflags:(.*)$", re.MULTILINE)


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


def kernel_sources(directory: Path = HERE) -> list[Path]:
    """Every kernel's C source: ``cpu_*.c`` in `directory`."""
    return sorted(directory.glob("cpu_*.c"))


def kernel_name(source: Path) -> str:
    """A kernel's name, in its libraries' file names: the source's stem without ``cpu_``."""
    return source.stem.removeprefix("cpu_")


def source_flags(source: Path) -> tuple[str, ...]:
    """The kernel's own compiler flags, from its ``// gaudi-serve cflags: ...`` lines."""
    return tuple(flag for line in _CFLAGS_LINE.findall(source.read_text()) for flag in shlex.split(line))


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


def _link() -> list[str]:
    runtime = openmp_runtime()
    return [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else ["-lgomp"]


def _key(source: Path, flags: Iterable[str], *more: str) -> str:
    """What selects a library: the source, the headers beside it (what `#include "..."` finds), the flags
    and `more`."""
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    text = "\0".join([source.read_text(), *headers, shlex.join(flags), *more])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _compile(cc: list[str], flags: tuple[str, ...], source: Path, target: Path) -> Path:
    """`source` compiled with `flags` into `target`, written whole or not at all."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel into {target.parent}: {e}") from None
    try:
        # Compiled, then linked without -fopenmp, which would add the compiler's own libgomp.
        _run([*cc, *flags, "-c", "-o", f"{tmp}.o", str(source)])
        _run([*cc, "-shared", "-o", tmp, f"{tmp}.o", *_link()])
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a prebuilt library from the image's user
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        for leftover in (tmp, f"{tmp}.o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def build(source: Path, name: str, environ=None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library compiled from `source` for this compiler and CPU, named `name`-<key>.so: from the cache,
    else compiled into it. `extra_flags`: after FLAGS and the source's own."""
    cc = compiler(environ)
    flags = (*FLAGS, *source_flags(source), *extra_flags)
    version = (_run([*cc, "--version"]).splitlines() or [""])[0]
    # The compiler's own command is part of the key: $CC may carry flags (e.g. -mno-avx512f).
    key = _key(source, flags, shlex.join(cc), shlex.join(_link()), version, _cpu_flags())
    target = _writable_dir(environ) / f"{name}-{key}.so"
    return target if target.exists() else _compile(cc, flags, source, target)


def _prebuilt_flags(source: Path, level: cpu_isa.Level, extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    return (*BASE_FLAGS, *level.flags, *source_flags(source), *extra_flags)


def prebuilt_name(source: Path, level: cpu_isa.Level, extra_flags: tuple[str, ...] = ()) -> str:
    """The file name of the kernel's library for `level`, as today's source and OpenMP runtime build it (the
    runtime by its soname: torch may be installed elsewhere than where the library was built)."""
    runtime = openmp_runtime()
    key = _key(source, _prebuilt_flags(source, level, extra_flags), os.path.basename(runtime or "-lgomp"))
    return f"{kernel_name(source)}-{level.name}-{key}.so"


def prebuilt_dirs(environ=None) -> list[Path]:
    """Where prebuilt libraries are looked for: ``$GAUDI_SERVE_KERNELS``, then the package's own."""
    environ = os.environ if environ is None else environ
    given = environ.get(KERNELS_ENV)
    return [Path(given), PREBUILT] if given else [PREBUILT]


def build_prebuilt(source: Path, level: cpu_isa.Level, out: Path, environ=None) -> Path:
    """`source` compiled for `level` into `out` (``gaudi-serve build-kernels``), under ``prebuilt_name``."""
    target = out / prebuilt_name(source, level)
    return _compile(compiler(environ), _prebuilt_flags(source, level, ()), source, target)


def prebuilt(source: Path, environ=None, extra_flags: tuple[str, ...] = (), machine: str | None = None,
             cpu_flags: str | None = None) -> list[Path]:
    """The prebuilt libraries of `source`'s kernel this CPU runs, best level first (none: compile at start)."""
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    levels = cpu_isa.runnable(machine or platform.machine(), flags)
    names = [prebuilt_name(source, level, extra_flags) for level in levels]
    return [d / n for n in names for d in prebuilt_dirs(environ) if (d / n).is_file()]


def load(source: Path, name: str, wrap: Callable[[Path], K], environ=None, extra_flags: tuple[str, ...] = ()) -> K:
    """The best prebuilt library this CPU runs (named for the source: ``kernel_name``), else the library
    compiled here as `name`, wrapped (``wrap(path)``
    opens it with ctypes); raises KernelUnavailable saying why not. A prebuilt library that does not load
    (a truncated file, a missing symbol) is passed over for the next."""
    for path in prebuilt(source, environ, extra_flags):
        try:
            return wrap(path)
        except (OSError, AttributeError) as e:
            log.warning("cpu: prebuilt kernel %s does not load (%s); trying the next", path, e)
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
