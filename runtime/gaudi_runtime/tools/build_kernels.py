"""`gaudi-serve build-kernels`: compile every CPU kernel (``device/cpu_*.c``) for each instruction-set level
of this machine (``device/cpu_isa.py``) into a directory a server loads them from without a compiler.

The image build runs it (Dockerfile.runtime), as does ``make venv``; a server started on any CPU of this
architecture then takes the best level that CPU runs (``cpu_kernels.load``). It imports torch first: the
libraries link against the OpenMP runtime torch loads, which they must share with it at run time.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gaudi_runtime.device import cpu_isa, cpu_kernels


def _parser() -> argparse.ArgumentParser:
    levels = [level.name for level in cpu_isa.levels_for(platform.machine())]
    default = os.environ.get(cpu_kernels.KERNELS_ENV) or str(cpu_kernels.PREBUILT)
    parser = argparse.ArgumentParser(prog="gaudi-serve build-kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(default),
                        help=f"directory to write them into (default: ${cpu_kernels.KERNELS_ENV}, else {default})")
    parser.add_argument("--level", action="append", choices=levels, dest="levels",
                        help="build only this level (repeatable; default: all of this machine's)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilers run at once")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: say which library each kernel loads from here, as a server would "
                             "(no compiler run), and fail if one has none")
    return parser


def check(environ=None) -> tuple[list[Path], list[str]]:
    """The prebuilt library each kernel loads on this CPU, and what is wrong where one has none that loads."""
    import ctypes

    import torch  # noqa: F401  (the libraries need its OpenMP runtime loaded)

    found, problems = [], []
    for source in cpu_kernels.kernel_sources():
        name = cpu_kernels.kernel_name(source)
        paths = cpu_kernels.prebuilt(source, environ)
        if not paths:
            problems.append(f"{name}: no prebuilt library of this source for this CPU in "
                            f"{', '.join(map(str, cpu_kernels.prebuilt_dirs(environ)))}")
            continue
        try:
            ctypes.CDLL(str(paths[0]))
            found.append(paths[0])
        except OSError as e:
            problems.append(f"{name}: {e}")
    return found, problems


def build_all(out: Path, levels: list[cpu_isa.Level], jobs: int = 1, environ=None,
              directory: Path = cpu_kernels.HERE) -> list[Path]:
    """Every kernel of `directory` for every level in `levels`, into `out`, where libraries of an earlier
    source of those kernels are removed; raises KernelUnavailable on the first that fails."""
    import torch  # noqa: F401  (loads the OpenMP runtime the libraries link against)

    out.mkdir(parents=True, exist_ok=True)
    sources = cpu_kernels.kernel_sources(directory)
    work = [(source, level) for source in sources for level in levels]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        built = list(pool.map(lambda w: cpu_kernels.build_prebuilt(w[0], w[1], out, environ), work))
    wanted = {p.name for p in built}
    prefixes = tuple(f"{cpu_kernels.kernel_name(s)}-{level.name}-" for s in sources for level in levels)
    for old in out.glob("*.so"):
        # The key is 24 hex digits after the prefix: "v4-bf16" is not mistaken for an old "v4" library.
        rest = next((old.name[len(p):] for p in prefixes if old.name.startswith(p)), None)
        if rest is not None and len(rest) == 27 and old.name not in wanted:
            old.unlink()
    return built


def _report(environ=None) -> int:
    found, problems = check(environ)
    for path in found:
        print(path)
    for problem in problems:
        print(f"gaudi-serve build-kernels: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        return _report({**os.environ, cpu_kernels.KERNELS_ENV: str(args.out)})
    machine = platform.machine()
    levels = [lv for lv in cpu_isa.levels_for(machine) if args.levels is None or lv.name in args.levels]
    try:
        built = build_all(args.out, levels, args.jobs)
    except cpu_kernels.KernelUnavailable as e:
        print(f"gaudi-serve build-kernels: {e}", file=sys.stderr)
        return 1
    print(f"gaudi-serve build-kernels: {len(built)} libraries ({machine}: {', '.join(lv.name for lv in levels)}) "
          f"in {args.out}")
    return 0
