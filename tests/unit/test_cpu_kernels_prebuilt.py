"""Kernels prebuilt at install time (``gaudi-serve build-kernels``): a server on any CPU of the architecture
loads the best level that CPU runs without running a compiler; a level the CPU lacks is never loaded; a
library that does not load is passed over for the next; none at all (or none of today's source): compiled
at start as before, else torch's path after one warning. A new kernel is one C file, its flags in it."""

from __future__ import annotations

import ctypes
import logging
import platform
import shutil
from pathlib import Path

import pytest

from gaudi_runtime.device import cpu_isa, cpu_kernels, cpu_paged_attention, cpu_sampling
from gaudi_runtime.tools import build_kernels

MACHINE = platform.machine()
LEVELS = cpu_isa.levels_for(MACHINE)
RUNNABLE = cpu_isa.runnable(MACHINE, set(cpu_kernels._cpu_flags().split()))
# The best level this CPU runs and the baseline: enough to see the choice, half the compile time.
BUILT = list(dict.fromkeys([RUNNABLE[0], LEVELS[-1]]))
SAPPHIRE_RAPIDS = ("fpu sse2 cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave "
                   "avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 amx_tile")
HASWELL = "fpu sse2 cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"


def names(levels: tuple[cpu_isa.Level, ...]) -> list[str]:
    return [level.name for level in levels]


def test_each_cpu_gets_the_levels_its_flags_allow():
    assert names(cpu_isa.runnable("x86_64", set(SAPPHIRE_RAPIDS.split()))) == [
        "x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert names(cpu_isa.runnable("x86_64", set(HASWELL.split()))) == ["x86-64-v3", "x86-64"]
    assert names(cpu_isa.runnable("AMD64", set(HASWELL.split()) - {"fma"})) == ["x86-64"]
    assert names(cpu_isa.runnable("aarch64", {"fp", "asimd"})) == ["armv8-a"]
    assert names(cpu_isa.runnable("riscv64", set())) == ["generic"]


@pytest.fixture(scope="module")
def prebuilt_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prebuilt")
    argv = ["--out", str(out), *(arg for level in BUILT for arg in ("--level", level.name))]
    assert build_kernels.main(argv) == 0
    return out


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a compiler, whose cache is empty; running one fails the test."""
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "no-package-prebuilt")
    monkeypatch.setattr(cpu_kernels, "_run", lambda cmd: pytest.fail(f"ran {cmd} although a library was prebuilt"))


def use(monkeypatch, directory: Path) -> None:
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, str(directory))


def test_every_kernel_is_built_for_each_level(prebuilt_dir):
    libs = sorted(p.name for p in prebuilt_dir.glob("*.so"))
    kernels = [cpu_kernels.kernel_name(s) for s in cpu_kernels.kernel_sources()]
    assert {"gemv", "paged_attention", "layer_ops", "sampling"} <= set(kernels)
    assert len(libs) == len(kernels) * len(BUILT)
    for kernel in kernels:
        for level in BUILT:
            assert any(n.startswith(f"{kernel}-{level.name}-") and n.count("-") == f"{kernel}-{level.name}-".count("-")
                       for n in libs), (kernel, level.name, libs)


def test_a_server_loads_the_best_prebuilt_level_without_a_compiler(prebuilt_dir, no_compiler, monkeypatch):
    use(monkeypatch, prebuilt_dir)
    for source in cpu_kernels.kernel_sources():
        lib = cpu_kernels.load(source, cpu_kernels.kernel_name(source), lambda p: p)
        assert lib.parent == prebuilt_dir and lib.name.startswith(f"{cpu_kernels.kernel_name(source)}-{RUNNABLE[0].name}-")
    k = cpu_paged_attention.load()
    assert k.path.parent == prebuilt_dir
    with open("/proc/self/maps") as f:  # its OpenMP runtime is the one torch loaded
        assert len({line.split()[-1] for line in f if "libgomp" in line or "libomp" in line}) <= 1
    assert not (Path(cpu_kernels.cache_dir()).exists() and any(Path(cpu_kernels.cache_dir()).iterdir()))


def test_a_cpu_without_the_best_level_gets_one_it_runs(prebuilt_dir, no_compiler, monkeypatch):
    use(monkeypatch, prebuilt_dir)
    baseline = cpu_kernels.prebuilt(cpu_sampling.SOURCE, cpu_flags="fpu sse2 ssse3")
    assert [p.name.startswith(f"sampling-{LEVELS[-1].name}-") for p in baseline] == [True]


def test_a_library_that_does_not_load_is_passed_over(prebuilt_dir, no_compiler, monkeypatch, tmp_path, caplog):
    if len(BUILT) == 1:
        pytest.fail("this architecture has one level: nothing to fall back to")
    broken = tmp_path / "broken"
    shutil.copytree(prebuilt_dir, broken)
    best = next(broken.glob(f"sampling-{BUILT[0].name}-*.so"))
    best.write_bytes(best.read_bytes()[:100])  # truncated: an interrupted copy, a full disk
    use(monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        k = cpu_sampling.load()
    assert k.path.name.startswith(f"sampling-{BUILT[-1].name}-")
    assert any(str(best) in r.getMessage() for r in caplog.records)


def test_no_prebuilt_library_compiles_at_start(prebuilt_dir, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, str(tmp_path / "empty"))
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "no-package-prebuilt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    k = cpu_sampling.load()
    assert k.path.parent == tmp_path / "cache" / "gaudi-serve" / "kernels"


def _no_compiler(cmd):
    raise cpu_kernels.KernelUnavailable(f"{cmd[0]}: No such file or directory")


def test_no_prebuilt_library_and_no_compiler_is_torchs_path_after_a_warning(no_compiler, monkeypatch, tmp_path,
                                                                           caplog):
    monkeypatch.setattr(cpu_kernels, "_run", _no_compiler)
    use(monkeypatch, tmp_path / "empty")
    with caplog.at_level(logging.WARNING):
        k = cpu_kernels.load_or_warn(cpu_sampling.load, "greedy choice", "torch's argmax", logging.getLogger("t"))
    assert k is None
    assert [r.getMessage() for r in caplog.records if "no greedy choice kernel" in r.getMessage()]


def test_an_edited_kernel_is_not_served_the_old_prebuilt_library(prebuilt_dir, monkeypatch, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("cpu_sampling.c", "cpu_vectors.h"):
        shutil.copy(cpu_kernels.HERE / name, src / name)
    use(monkeypatch, prebuilt_dir)
    assert cpu_kernels.prebuilt(src / "cpu_sampling.c")  # the same source: served
    (src / "cpu_vectors.h").write_text((src / "cpu_vectors.h").read_text() + "\n/* edited */\n")
    assert cpu_kernels.prebuilt(src / "cpu_sampling.c") == []


def test_a_new_kernel_is_one_c_file_with_its_flags_in_it(monkeypatch, tmp_path):
    """Dropped beside the others, built by build-kernels with the flags it names, loaded without a compiler;
    a rebuild after an edit removes the library of the old source."""
    src, out = tmp_path / "device", tmp_path / "out"
    src.mkdir()
    shutil.copy(cpu_kernels.HERE / "cpu_vectors.h", src)
    source = src / "cpu_twice.c"
    source.write_text('// gaudi-serve cflags: -DFACTOR=2\n#include "cpu_vectors.h"\nint twice(int x) { return FACTOR * x; }\n')
    first = build_kernels.build_all(out, [LEVELS[-1]], directory=src)
    source.write_text(source.read_text() + "int thrice(int x) { return 3 * x; }\n")
    second = build_kernels.build_all(out, [LEVELS[-1]], directory=src)
    assert [p.name for p in out.iterdir()] == [second[0].name] and first != second
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(cpu_kernels, "_run", lambda cmd: pytest.fail(f"ran {cmd}"))
    use(monkeypatch, out)
    lib = cpu_kernels.load(source, "twice", lambda p: ctypes.CDLL(str(p)))
    assert lib.twice(21) == 42 and lib.thrice(2) == 6


def test_build_kernels_check_says_what_a_server_would_load(prebuilt_dir, no_compiler, tmp_path, capsys):
    """`gaudi-serve build-kernels --check` (the image build's last step): each kernel's library, or the
    kernel that has none and exit 1."""
    from gaudi_runtime import cli

    assert cli.main(["build-kernels", "--check", "--out", str(prebuilt_dir)]) == 0
    listed = capsys.readouterr().out.split()
    assert sorted(Path(p).name.split("-")[0] for p in listed) == sorted(
        cpu_kernels.kernel_name(s) for s in cpu_kernels.kernel_sources())
    assert all(Path(p).parent == prebuilt_dir for p in listed)
    assert cli.main(["build-kernels", "--check", "--out", str(tmp_path / "empty")]) == 1
    assert "sampling: no prebuilt library" in capsys.readouterr().err
