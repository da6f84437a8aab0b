"""The batch-invariant mode's pure parts: the fixed-order product gives each row the bits it gets alone, for any
row count, thread count and build; a prefill's queries (whole, after cached blocks, a chunk, padded, a verify
pass) attend exactly as that token's own decode step does; the setting is read from its flag, its env and
vLLM's name, and refused where the kernels cannot keep it."""

from __future__ import annotations

import argparse

import pytest
import torch

from gaudi_runtime.config import ConfigError, add_arguments, resolve
from gaudi_runtime.device import cpu_gemv, cpu_kernels, cpu_paged_attention
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.layers.attention import Attention, AttentionMetadata


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The product kernel as this CPU builds it, and as a CPU without avx512_bf16 does."""
    native = cpu_gemv.kernel()
    if native is None:
        pytest.fail("the kernel did not build here: is there a C compiler (cc or $CC)?")
    environ = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("kernels"))}
    return [native, cpu_kernels.load(cpu_gemv.SOURCE, "gemv", cpu_gemv.GemvKernel, environ,
                                     extra_flags=("-mno-avx512bf16",))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(512, 1024), (70, 33), (64, 8)])
def test_each_row_gets_its_bits_alone_whatever_the_batch(builds, dtype, shape):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(150, in_features, generator=gen).to(dtype)
    for k in builds:
        full = k.fixed(x, w, bias)
        exact = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        torch.testing.assert_close(full.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
        for rows in (1, 2, 7, 8, 9, 17, 64, 65):
            assert torch.equal(k.fixed(x[:rows], w, bias), full[:rows])
            assert torch.equal(k.fixed(x[rows - 1:rows], w, bias), full[rows - 1:rows])  # the row alone
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(k.fixed(x, w, bias), full)
        finally:
            torch.set_num_threads(threads)


def _layer(dtype, window=None):
    attention = CpuBackend().attention(batch_invariant=True)
    return Attention(8, 2, 32, backend=attention, window=window)


def _decode_alone(layer, q, k_cache, v_cache, table, position):
    """Token `position`'s attention as its own decode step computes it (a batch of one)."""
    meta = AttentionMetadata(is_prefill=False, slots=table[:1, None], block_tables=table[None],
                             context_lens=torch.tensor([position + 1]))
    return layer._decode(q.view(1, 1, 8, 32), k_cache, v_cache, meta).view(8, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 5])
def test_every_prefill_query_attends_as_its_decode_step(dtype, window):
    """Two rows of new tokens: one after 8 cached tokens (two blocks), one from position 0 and padded; the
    caches get the step's K/V first, then each query is compared with its own decode step alone."""
    if cpu_paged_attention.kernel() is None:
        pytest.fail("the paged attention kernel did not build here")
    block, gen = 4, torch.Generator().manual_seed(1)
    k_cache = torch.randn(12, block, 2, 32, generator=gen).to(dtype)
    v_cache = torch.randn(12, block, 2, 32, generator=gen).to(dtype)
    tables = torch.tensor([[3, 7, 5, 9], [2, 11, 0, 0]])
    cached, new = [8, 0], [5, 6]
    s = max(new)
    slots = torch.zeros(2, s, dtype=torch.long)  # padding writes to block 0
    for r in range(2):
        for j in range(new[r]):
            p = cached[r] + j
            slots[r, j] = tables[r, p // block] * block + p % block
    q = torch.randn(2, s, 8, 32, generator=gen).to(dtype)
    k, v = (torch.randn(2, s, 2, 32, generator=gen).to(dtype) for _ in range(2))
    layer = _layer(dtype, window)
    meta = AttentionMetadata(is_prefill=True, slots=slots, block_tables=tables[:, :2],
                             context_lens=torch.tensor(cached))
    out = layer(q, k, v, (k_cache, v_cache), meta).view(2, s, 8, 32)
    for r in range(2):
        for j in range(new[r]):
            assert torch.equal(out[r, j], _decode_alone(layer, q[r, j], k_cache, v_cache, tables[r], cached[r] + j))


def _settings(*flags: str, **env: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(["--model-id", "m", "--device", "cpu", *flags]), env)


def test_the_mode_is_read_from_its_flag_its_env_and_vllms_name():
    assert not _settings().device.batch_invariant
    assert _settings("--batch-invariant").device.batch_invariant
    assert _settings(BATCH_INVARIANT="true").device.batch_invariant
    assert _settings(VLLM_BATCH_INVARIANT="1").device.batch_invariant
    assert not _settings(VLLM_BATCH_INVARIANT="0").device.batch_invariant


@pytest.mark.parametrize("flags, named", [(("--dtype", "float16"), "--dtype float16"),
                                          (("--quantize", "fp8"), "--quantize"),
                                          (("--kv-cache-dtype", "fp8_e4m3fn"), "--kv-cache-dtype"),
                                          (("--lora-adapters", "a=/x"), "LoRA adapters"),
                                          (("--device", "hpu"), "--device hpu")])
def test_settings_the_kernels_cannot_keep_it_with_are_refused_by_name(flags, named):
    with pytest.raises(ConfigError, match=f"--batch-invariant cannot be combined with {named}"):
        _settings("--batch-invariant", *flags)
