"""Decode attention on a CPU that reads the paged KV cache in place, through a small C kernel.

The torch path gathers every sequence's KV blocks into a contiguous copy each step and each layer
(``index_select``) and masks past each context length; at long contexts that copy and the masked
work are most of a decode step. ``cpu_paged_attention.c`` walks the block table instead, as vLLM's
CPU build does with its own kernel.

The C source ships with the package and is compiled at first use with the system C compiler
(``$CC``, else ``cc``) for this CPU (``-march=native``), into a per-user cache
(``$XDG_CACHE_HOME/gaudi-serve/kernels``; a directory of the user's own under the temporary
directory where that is read-only) keyed by everything that changes the binary (source, flags,
compiler version, CPU flags, the OpenMP runtime torch loaded), so a restart loads it in
milliseconds. It is written under a temporary name and renamed, so that shards and tests compiling
at once never load a half-written file. ``ctypes`` calls it (releasing the GIL). No compiler, a
failed compile or a cache that cannot be written: one warning, and decode keeps the gather path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
# No -ffast-math: the kernel orders its sums itself, and its exp is its own (docs/performance.md
# has the flags measured).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The kernel's rows are whole vectors (16 lanes with AVX-512, 8 elsewhere); other head sizes gather.
HEAD_SIZE_MULTIPLE = 16
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


def build(environ=None) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else compiled into it."""
    cc = compiler(environ)
    version = (_run([*cc, "--version"]).splitlines() or [""])[0]
    runtime = openmp_runtime()
    link = [runtime, f"-Wl,-rpath,{os.path.dirname(runtime)}"] if runtime else ["-lgomp"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), shlex.join(FLAGS), shlex.join(link), version,
                                     _cpu_flags()]).encode())
    directory = _writable_dir(environ)
    target = directory / f"paged_attention-{key.hexdigest()[:24]}.so"
    if target.exists():
        return target
    try:
        fd, tmp = tempfile.mkstemp(prefix=".paged_attention-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel cache {directory}: {e}") from None
    try:
        # Compiled, then linked without -fopenmp, which would add the compiler's own libgomp.
        _run([*cc, *FLAGS, "-c", "-o", f"{tmp}.o", str(SOURCE)])
        _run([*cc, "-shared", "-o", tmp, f"{tmp}.o", *link])
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        for leftover in (tmp, f"{tmp}.o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


class PagedDecodeKernel:
    """The loaded library, called on tensors' data pointers."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the call runs without the GIL
        fn = lib.paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
        """q ``[B, 1, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]`` -> ``[B, Hq, D]`` in q's dtype;
        None when the tensors are not ones the kernel takes (another device or dtype, a strided cache, a
        head size that is not a multiple of HEAD_SIZE_MULTIPLE)."""
        dtype = k_cache.dtype
        num_blocks, block_size, hkv, d = k_cache.shape
        if (dtype not in DTYPES or q.dtype != dtype or v_cache.dtype != dtype or k_cache.device.type != "cpu"
                or d % HEAD_SIZE_MULTIPLE or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return None
        b = q.shape[0]
        q = q.reshape(b, -1, d).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        status = self._fn(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                          lens.data_ptr(), b, hkv, q.shape[1] // hkv, d, block_size, tables.shape[1], num_blocks,
                          scale, DTYPES[dtype], torch.get_num_threads())
        if status == -2:
            raise MemoryError("paged decode attention: no memory for its scratch rows")
        if status != 0:
            raise IndexError("paged decode attention: a block table names a block outside the KV cache, "
                             "or a context length exceeds its block table")
        return out


def load(environ=None) -> PagedDecodeKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    path = build(environ)
    try:
        return PagedDecodeKernel(path)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None


@functools.lru_cache(maxsize=1)
def kernel() -> PagedDecodeKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    try:
        k = load()
    except KernelUnavailable as e:
        log.warning("cpu: no paged decode attention kernel (%s); decode gathers the KV blocks instead", e)
        return None
    log.info("cpu: paged decode attention kernel %s", k.path)
    return k
