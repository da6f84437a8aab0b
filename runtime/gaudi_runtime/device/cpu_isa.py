"""The instruction-set levels the CPU kernels are prebuilt for, and which of them a CPU runs.

A prebuilt kernel cannot be compiled for the CPU it will run on (``-march=native``): the image is built on
one machine and runs on others. So it is compiled once per level below, and the loader takes the best level
whose every feature the CPU lists in /proc/cpuinfo (a library of a level the CPU lacks would die of an
illegal instruction, not fail to load). x86-64's levels are the psABI's (x86-64-v3: AVX2 and FMA, Haswell
on; x86-64-v4: AVX-512, Skylake-SP on), plus AVX-512 with bfloat16 dot products (Sapphire Rapids, Zen 4:
the few-row product's bfloat16 path, docs/performance.md); below them the plain x86-64 baseline, which
every x86-64 CPU runs. Other architectures get their baseline only. Pure: the caller reads the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
# abm is how /proc/cpuinfo names LZCNT; xsave is the OS side of AVX.
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Level:
    """One build of every kernel: its name (in the library's file name), the compiler flags that select
    it, and the CPU flags (as /proc/cpuinfo spells them) a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str] = frozenset()


# Best first, per machine (platform.machine()).
LEVELS: dict[str, tuple[Level, ...]] = {
    "x86_64": (
        Level("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16"), _V4 | {"avx512_bf16"}),
        Level("x86-64-v4", ("-march=x86-64-v4",), _V4),
        Level("x86-64-v3", ("-march=x86-64-v3",), _V3),
        Level("x86-64", ("-march=x86-64",)),
    ),
    "aarch64": (Level("armv8-a", ("-march=armv8-a",)),),
}
GENERIC = (Level("generic", ()),)  # another machine: the compiler's own default target
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def levels_for(machine: str) -> tuple[Level, ...]:
    """The levels kernels are built for on `machine`, best first."""
    machine = machine.lower()
    return LEVELS.get(_ALIASES.get(machine, machine), GENERIC)


def runnable(machine: str, cpu_flags: set[str] | frozenset[str]) -> tuple[Level, ...]:
    """The levels of `machine` a CPU with `cpu_flags` runs, best first (the baseline always)."""
    return tuple(level for level in levels_for(machine) if level.needs <= cpu_flags)
