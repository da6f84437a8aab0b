"""Decode attention that reads the paged KV cache in place on a CPU (the C kernel) gives the gather path's
answer and a float32 reference's, for every grouping, head size, block size and ragged batch the runtime
produces; without a C compiler decode still works, through the gather, after one warning."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gaudi_runtime.device import cpu_kernels, cpu_paged_attention
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.device.cpu_attention import CpuAttention
from gaudi_runtime.layers.attention import Attention, AttentionMetadata, attention_in_use
from gaudi_runtime.layers.kv_cache import allocate_kv_cache

LENGTHS = [1, 16, 17, 2000, 128, 129, 0, 5]  # a block, a block + 1, long, a padded row (0)


@pytest.fixture(scope="module")
def kernel():
    k = cpu_paged_attention.kernel()
    if k is None:
        pytest.fail("the kernel did not build here: is there a C compiler (cc or $CC)?")
    return k


def paged_batch(heads: int, kv_heads: int, head_size: int, block: int, dtype: torch.dtype, lengths=LENGTHS,
                seed: int = 0):
    """q [B, 1, Hq, D], caches and a block table whose blocks are in random order, padded with block 0 (the
    trash block, holding noise as padding rows' writes leave it) past each row's length."""
    gen = torch.Generator().manual_seed(seed)
    widths = [max(1, -(-n // block)) for n in lengths]
    width = max(widths) + 1  # one padding entry even on the longest row
    blocks = 1 + sum(widths)
    k_cache = torch.randn(blocks, block, kv_heads, head_size, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, head_size, generator=gen).to(dtype)
    order = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, w in enumerate(widths):
        tables[row, :w] = torch.tensor(order[:w])
        order = order[w:]
    q = torch.randn(len(lengths), 1, heads, head_size, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


def reference(q, k_cache, v_cache, tables, lengths, scale):
    """float32 softmax(q k^T) v over each row's positions, read one by one through its block table."""
    block, kv_heads, d = k_cache.shape[1:]
    out = []
    for row, n in enumerate(lengths.tolist()):
        pos = torch.arange(max(n, 1))  # a padded row reads its position 0
        keys = k_cache[tables[row, pos // block], pos % block].float()  # [L, Hkv, D]
        values = v_cache[tables[row, pos // block], pos % block].float()
        qg = q[row, 0].float().view(kv_heads, -1, d)
        probs = (torch.einsum("hgd,lhd->hgl", qg, keys) * scale).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", probs, values).reshape(-1, d))
    return torch.stack(out)


def gathered(q, k_cache, v_cache, tables, lengths, scale):
    """The gather path of `Attention._decode` (grouped bmm over the copied blocks)."""
    layer = Attention(q.shape[2], k_cache.shape[2], k_cache.shape[3], scale, backend=CpuAttention())
    meta = AttentionMetadata(is_prefill=False, slots=tables[:, :1], block_tables=tables, context_lens=lengths)
    return layer._gathered_decode(q, k_cache, v_cache, meta).view(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("block", [16, 128])  # CPU default and HPU default
def test_matches_reference_and_gather_path(kernel, dtype, group, head_size, block):
    kv_heads = 2
    q, k_cache, v_cache, tables, lengths = paged_batch(kv_heads * group, kv_heads, head_size, block, dtype)
    scale = head_size ** -0.5
    out = kernel(q, k_cache, v_cache, tables, lengths, scale)
    assert out.dtype == dtype and out.shape == (len(LENGTHS), kv_heads * group, head_size)
    assert torch.isfinite(out).all()
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, lengths, scale), **tol)
    torch.testing.assert_close(out, gathered(q, k_cache, v_cache, tables, lengths, scale), **tol)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lengths", [[700], [3, 900], LENGTHS], ids=["one-row", "two-rows", "ragged"])
def test_same_answer_on_any_thread_count(kernel, threads, lengths):
    """Rows split over threads, or one row's KV heads when there are fewer rows than threads."""
    q, k_cache, v_cache, tables, lens = paged_batch(8, 4, 64, 16, torch.bfloat16, lengths)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    expected = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    torch.set_num_threads(threads)
    try:
        torch.testing.assert_close(kernel(q, k_cache, v_cache, tables, lens, 0.125), expected, atol=0, rtol=0)
    finally:
        torch.set_num_threads(before)


def test_decode_layer_reads_the_cache_in_place(kernel, monkeypatch):
    """With the kernel selected, a decode step writes the new K/V, attends without copying the blocks
    (no index_select) and builds no mask; its answer is the gather path's."""
    impl = CpuBackend().attention(True, False)
    assert impl.paged_decode is kernel and "paged" in impl.name
    layer = Attention(8, 4, 64, backend=impl)
    caches = allocate_kv_cache(1, 9, 16, 4, 64, torch.bfloat16, "cpu")[0]
    for c in caches:
        c.normal_()
    tables, lens = torch.tensor([[3, 7, 0], [5, 1, 8]]), torch.tensor([20, 40])
    slots = torch.tensor([[7 * 16 + 3], [8 * 16 + 7]])
    q, k, v = (torch.randn(2, 1, h, 64).to(torch.bfloat16) for h in (8, 4, 4))
    meta = AttentionMetadata(is_prefill=False, slots=slots, block_tables=tables, context_lens=lens)
    real_index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda *a, **kw: pytest.fail("blocks were gathered"))
    out = layer(q, k, v, caches, meta)
    monkeypatch.setattr(torch.Tensor, "index_select", real_index_select)
    assert meta.decode_mask is None and out.shape == (2, 1, 8 * 64)
    expected = gathered(q, caches[0], caches[1], tables, lens, 0.125).reshape(2, 1, -1)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


def test_float8_cache_and_odd_or_large_head_sizes_keep_the_gather_path(kernel):
    impl = CpuBackend().attention(True, False)
    assert attention_in_use(impl, torch.bfloat16) == "sdpa (decode: paged C kernel)"
    assert "gathered" in attention_in_use(impl, torch.float8_e4m3fn)  # what /info says
    calls = []

    def spy(*args):
        calls.append(args)
        return kernel(*args)

    impl = CpuAttention(spy)
    meta = dict(is_prefill=False, slots=torch.tensor([[20]]), block_tables=torch.tensor([[1, 2]]),
                context_lens=torch.tensor([21]))
    fp8 = allocate_kv_cache(1, 3, 16, 2, 64, torch.float8_e4m3fn, "cpu")[0]
    q, k, v = torch.randn(1, 1, 4, 64), torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64)
    assert torch.isfinite(Attention(4, 2, 64, backend=impl)(q, k, v, fp8, AttentionMetadata(**meta))).all()
    assert calls == []  # never offered to the kernel
    odd = allocate_kv_cache(1, 3, 16, 2, 24, torch.float32, "cpu")[0]
    q, k, v = torch.randn(1, 1, 4, 24), torch.randn(1, 1, 2, 24), torch.randn(1, 1, 2, 24)
    out = Attention(4, 2, 24, backend=impl)(q, k, v, odd, AttentionMetadata(**meta))
    assert len(calls) == 1 and kernel(*calls[0]) is None  # offered, declined, gathered
    expected = reference(q, odd[0], odd[1], meta["block_tables"], meta["context_lens"], 24 ** -0.5)
    torch.testing.assert_close(out.view(1, 4, 24), expected)
    big = allocate_kv_cache(1, 3, 16, 1, 512, torch.float32, "cpu")[0]  # past the kernel's MAX_HEAD_SIZE
    q, k, v = torch.randn(1, 1, 2, 512), torch.randn(1, 1, 1, 512), torch.randn(1, 1, 1, 512)
    out = Attention(2, 1, 512, backend=impl)(q, k, v, big, AttentionMetadata(**meta))
    assert len(calls) == 2 and kernel(*calls[1]) is None
    expected = reference(q, big[0], big[1], meta["block_tables"], meta["context_lens"], 512 ** -0.5)
    torch.testing.assert_close(out.view(1, 2, 512), expected)


@pytest.mark.parametrize("tables, lengths", [
    ([[1, 99]], [20]),  # a block id past the cache
    ([[1, -1]], [20]),
    ([[1, 2]], [33]),  # a context longer than its table
], ids=["past-the-cache", "negative", "longer-than-table"])
def test_bad_block_tables_raise_instead_of_reading_outside_the_cache(kernel, tables, lengths):
    q, k_cache, v_cache, _, _ = paged_batch(4, 2, 32, 16, torch.float32, [20])
    with pytest.raises(IndexError, match="block table"):
        kernel(q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lengths), 0.1)


@pytest.fixture
def no_kernel_yet(monkeypatch, tmp_path):
    """Nothing loaded yet, and no prebuilt library to load (``gaudi-serve build-kernels``): compiled here."""
    monkeypatch.setattr(cpu_kernels, "PREBUILT", tmp_path / "no-prebuilt")
    monkeypatch.delenv(cpu_kernels.KERNELS_ENV, raising=False)
    cpu_paged_attention.kernel.cache_clear()
    yield
    cpu_paged_attention.kernel.cache_clear()


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["no-compiler", "compile-fails"])
def test_without_a_compiler_decode_gathers_after_one_warning(no_kernel_yet, monkeypatch, tmp_path, caplog, cc):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_paged_attention.__name__):
        for _ in range(3):  # the choice is made once per process
            impl = CpuBackend().attention(True, False)
    warnings = [r for r in caplog.records if "no paged decode attention kernel" in r.getMessage()]
    assert len(warnings) == 1 and "gathers" in warnings[0].getMessage()
    assert impl.paged_decode is None and impl.name == "sdpa (decode: grouped bmm)"
    q, k_cache, v_cache, tables, lengths = paged_batch(8, 4, 64, 16, torch.bfloat16, [30, 0])
    layer = Attention(8, 4, 64, backend=impl)
    meta = AttentionMetadata(is_prefill=False, slots=tables[:, :1], block_tables=tables, context_lens=lengths)
    out = layer._decode(q, k_cache, v_cache, meta)
    assert meta.decode_mask is not None  # the gather path ran
    torch.testing.assert_close(out.view(2, 8, 64).float(), reference(q, k_cache, v_cache, tables, lengths, 0.125),
                               atol=1e-2, rtol=1e-2)
    assert list(tmp_path.rglob("*.so")) == []


def test_switched_off_no_kernel_is_built(no_kernel_yet, monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "load", lambda *a: pytest.fail("compiled although switched off"))
    impl = CpuBackend().attention(True, False, cpu_paged=False)
    assert impl.paged_decode is None and impl.name == "sdpa (decode: grouped bmm)"


def test_compiled_once_into_the_cache_and_reused(no_kernel_yet, monkeypatch, tmp_path):
    """The library lands under $XDG_CACHE_HOME/gaudi-serve/kernels whole (no temporary file left); the next
    build finds it without compiling."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_paged_attention.build()
    assert first.parent == tmp_path / "gaudi-serve" / "kernels" and first.suffix == ".so"
    assert [p.name for p in first.parent.iterdir()] == [first.name]
    compiles = []
    real_run = cpu_kernels._run
    monkeypatch.setattr(cpu_kernels, "_run", lambda cmd: compiles.append(cmd) or real_run(cmd))
    assert cpu_paged_attention.build() == first
    assert all("--version" in cmd for cmd in compiles)  # asked its version for the key, compiled nothing
    assert cpu_paged_attention.load().path == first


def test_flags_in_cc_give_a_library_of_their_own(no_kernel_yet, monkeypatch, tmp_path):
    """CC="cc -mno-avx512f" (a build for older CPUs) is not served the library built without those flags."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plain = cpu_paged_attention.build()
    monkeypatch.setenv("CC", "cc -DGAUDI_SERVE_TEST_FLAG=1")
    flagged = cpu_paged_attention.build()
    assert flagged != plain and flagged.exists() and plain.exists()


def test_a_changed_header_gives_a_library_of_its_own(monkeypatch, tmp_path):
    """The kernels include cpu_vectors.h: a library built before the header changed is not served."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    source = src / "cpu_sampling.c"
    for name in (source.name, "cpu_vectors.h"):
        shutil.copy(Path(cpu_paged_attention.__file__).with_name(name), src / name)
    before = cpu_kernels.build(source, "sampling")
    (src / "cpu_vectors.h").write_text((src / "cpu_vectors.h").read_text() + "\n/* changed */\n")
    after = cpu_kernels.build(source, "sampling")
    assert after != before and after.exists()


def test_a_read_only_cache_falls_back_to_a_private_temporary_directory(no_kernel_yet, monkeypatch, tmp_path):
    """A read-only home (a hardened pod): the library goes to a directory of this user's own under $TMPDIR."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = cpu_paged_attention.build()
    assert path.parent == tmp_path / "tmp" / f"gaudi-serve-kernels-{os.getuid()}"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    path.parent.chmod(0o777)  # others could plant a library there: refused
    with pytest.raises(cpu_paged_attention.KernelUnavailable, match="others may write"):
        cpu_paged_attention.build()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_shares_torchs_openmp_runtime(kernel):
    """The library binds to the libgomp torch loaded: one OpenMP runtime, one thread pool."""
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_benchmark_prints_both_paths(kernel):
    """`python -m gaudi_runtime.bench.decode_attention` (docs/performance.md), on a tiny problem."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "gaudi_runtime.bench.decode_attention", "--batch", "2",
                          "--context", "40", "--threads", "1", "--layers", "2", "--repeats", "1", "--steps", "1",
                          "--heads", "4", "--kv-heads", "2", "--head-size", "32"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("1", "2", "40", "gather"), ("1", "2", "40", "paged")]
    assert all(float(r[4]) > 0 for r in rows)
