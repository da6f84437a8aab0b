"""A decoder layer's small operations on a CPU through one C call each: rotary and the cache writes give
torch's bits, RMSNorm torch's up to the order of its sum of squares; what the kernel does not take stays
on torch, and a model whose modules use it gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from gaudi_runtime.config import Config
from gaudi_runtime.device import cpu_layer_ops
from gaudi_runtime.device.cpu import CpuBackend
from gaudi_runtime.layers.attention import Attention, AttentionMetadata, write_kv
from gaudi_runtime.layers.kv_cache import allocate_kv_cache
from gaudi_runtime.layers.norm import RMSNorm
from gaudi_runtime.layers.rotary import RotaryEmbedding
from gaudi_runtime.models.registry import load_model
from gaudi_runtime.tools.tiny_model import make_tiny_model

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops():
    k = cpu_layer_ops.kernel()
    assert k is not None, "the layer operations kernel did not build here: is there a C compiler (cc or $CC)?"
    return k


def fused_qkv(rows: int, length: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k and v as a fused projection's views: rows of each lie the whole projection apart."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, length, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(rows, length, hq, d), k.view(rows, length, hk, d), v.view(rows, length, hk, d)


def norm_module(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,length,hq,hk,d", [(48, 1, 4, 2, 32), (3, 9, 8, 4, 64), (2, 5, 4, 4, 16),
                                                 (2, 3, 2, 1, 20), (1, 1, 32, 8, 128)])
def test_rotary_gives_torchs_bits(ops, dtype, rows, length, hq, hk, d):
    rotary = RotaryEmbedding(d, 512, 10000.0, dtype=dtype)
    q, k, _ = fused_qkv(rows, length, hq, hk, d, dtype)
    positions = torch.randint(0, 512, (rows, length), generator=torch.Generator().manual_seed(2))
    want_q, want_k = rotary(positions, q, k)
    got_q, got_k = ops.rotary(positions, q, k, rotary.cos, rotary.sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (48, 128), (7, 512), (5, 72), (3, 20)])
def test_rms_norm_gives_torchs_values(ops, dtype, rows, hidden):
    norm = norm_module(hidden, dtype)
    g = torch.Generator().manual_seed(3)
    projected = torch.randn(rows, 1, 2 * hidden, generator=g).to(dtype)
    x, residual = projected[..., :hidden], (torch.randn(rows, 1, hidden, generator=g) * 3).to(dtype)
    want, want_sum = norm(x, residual)
    got, got_sum = ops.rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(got_sum, want_sum)
    # the sum of squares is added in another order: at most the last bit of the dtype apart
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, norm.eps), norm(x), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_writes_give_index_copys_caches(ops, dtype):
    _, k, v = fused_qkv(6, 3, 4, 2, 32, dtype)
    want = allocate_kv_cache(1, 8, 16, 2, 32, dtype, torch.device("cpu"))[0]
    got = tuple(c.clone() for c in want)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(4))[:18].view(6, 3)
    write_kv(*want, k, v, slots)
    assert ops.write_kv(*got, k, v, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_positions_and_slots_outside_the_tables_raise_and_write_nothing(ops):
    rotary = RotaryEmbedding(32, 64, dtype=torch.bfloat16)
    q, k, v = fused_qkv(2, 1, 4, 2, 32, torch.bfloat16)
    with pytest.raises(IndexError, match="position"):
        ops.rotary(torch.tensor([[3], [64]]), q, k, rotary.cos, rotary.sin)
    caches = allocate_kv_cache(1, 2, 16, 2, 32, torch.bfloat16, torch.device("cpu"))[0]
    for cache in caches:
        cache.zero_()
    with pytest.raises(IndexError, match="slot"):
        ops.write_kv(*caches, k, v, torch.tensor([[1], [32]]))
    assert not caches[0].any() and not caches[1].any()


def test_what_the_kernel_does_not_take_is_left_to_torch(ops):
    norm = norm_module(64, torch.bfloat16)
    x = torch.randn(2, 1, 64).to(torch.bfloat16)
    assert ops.rms_norm(x.half(), None, norm.weight.half(), 1e-6) is None  # float16
    assert ops.rms_norm(x.float(), None, norm.weight, 1e-6) is None  # mixed dtypes
    assert ops.rms_norm(x.transpose(0, 2), None, norm.weight, 1e-6) is None  # a strided last dimension
    rotary = RotaryEmbedding(32, 64, dtype=torch.bfloat16)
    q, k, v = fused_qkv(2, 1, 4, 2, 32, torch.bfloat16)
    assert ops.rotary(torch.tensor([[1], [2]], dtype=torch.int32), q, k, rotary.cos, rotary.sin) is None
    fp8 = torch.zeros(2, 16, 2, 32, dtype=torch.float8_e4m3fn)
    assert ops.write_kv(fp8, fp8.clone(), k, v, torch.tensor([[1], [2]])) is False  # scaled: write_kv's job


def test_the_answer_does_not_depend_on_the_thread_count(ops):
    norm = norm_module(512, torch.bfloat16)
    x = torch.randn(512, 1, 512).to(torch.bfloat16)  # past the size the C calls split over threads
    rotary = RotaryEmbedding(64, 1024, dtype=torch.bfloat16)
    q, k, _ = fused_qkv(512, 1, 8, 4, 64, torch.bfloat16)
    positions = torch.arange(512).view(512, 1)
    most = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.rms_norm(x, x, norm.weight, 1e-6), ops.rotary(positions, q, k, rotary.cos, rotary.sin)
    finally:
        torch.set_num_threads(most)
    every = ops.rms_norm(x, x, norm.weight, 1e-6), ops.rotary(positions, q, k, rotary.cos, rotary.sin)
    assert all(torch.equal(a, b) for pair in zip(one, every) for a, b in zip(*pair))


@pytest.fixture(scope="module", params=["llama", "gemma", "falcon"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def greedy_tokens(model, steps: int = 6) -> list[list[int]]:
    """Two prompts prefilled, then `steps` greedy decode steps over the paged cache."""
    kv = allocate_kv_cache(model.num_layers, 8, 16, model.num_kv_heads, model.head_dim, model.dtype,
                           torch.device("cpu"))
    tables = torch.tensor([[1, 2], [3, 4]])
    ids = torch.arange(3, 13).view(2, 5)
    tokens = []
    with torch.inference_mode():
        meta = AttentionMetadata(is_prefill=True, slots=16 * tables[:, :1] + torch.arange(5))
        logits = model.compute_logits(model(ids, torch.arange(5).expand(2, 5), kv, meta)[:, -1])
        for step in range(steps):
            nxt = logits.argmax(-1)
            tokens.append(nxt.tolist())
            pos = torch.full((2, 1), 5 + step)
            meta = AttentionMetadata(is_prefill=False, slots=16 * tables[:, :1] + pos, block_tables=tables,
                                     context_lens=torch.full((2,), 6 + step))
            logits = model.compute_logits(model(nxt[:, None], pos, kv, meta)[:, -1])
    return tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prepared_model_uses_the_kernel_and_gives_the_same_tokens(model_dir, dtype, monkeypatch):
    model = load_model(str(model_dir), dtype, torch.device("cpu"))
    want = greedy_tokens(model)
    calls = []
    for name in ("rms_norm", "rotary", "write_kv"):
        real = getattr(cpu_layer_ops.LayerOpsKernel, name)
        monkeypatch.setattr(cpu_layer_ops.LayerOpsKernel, name,
                            lambda self, *a, _real=real, _name=name: calls.append(_name) or _real(self, *a))
    CpuBackend().prepare_model(model, Config.of().device)
    assert greedy_tokens(model) == want
    # Gemma's norm scales by 1 + weight: it keeps its own code
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert all((m.kernel is not None) == (type(m) is RMSNorm) for m in norms)
    assert ("rms_norm" in calls) == any(type(m) is RMSNorm for m in norms)
    assert {"rotary", "write_kv"} <= set(calls)


def test_switched_off_the_modules_keep_torchs_code(model_dir):
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    CpuBackend().prepare_model(model, Config.of(cpu_layer_ops=False).device)
    assert all(m.kernel is None for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding)))
    assert all(m.cache_writer is None for m in model.modules() if isinstance(m, Attention))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_shards_runner_takes_the_calls_on_its_own_tensors(tmp_path, dtype, monkeypatch):
    """The runner's prefill and decode hand the calls tensors they take (int64 positions and slots, rows
    evenly spaced): no step silently falls back to torch."""
    from gaudi_runtime.config import resolve
    from gaudi_runtime.proto import generate_pb2 as pb
    from gaudi_runtime.shard.runner import ModelRunner, PrefillInput
    from gaudi_runtime.shard.servicer import to_params

    answered, refused = [], []
    for name in ("rms_norm", "rotary", "write_kv"):
        real = getattr(cpu_layer_ops.LayerOpsKernel, name)

        def counted(self, *args, _real=real, _name=name):
            out = _real(self, *args)
            (refused if out is None or out is False else answered).append(_name)
            return out
        monkeypatch.setattr(cpu_layer_ops.LayerOpsKernel, name, counted)
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    cfg = resolve(None, {"MODEL_ID": str(model_dir), "DTYPE": dtype, "DEVICE": "cpu", "BLOCK_SIZE": "4",
                         "MAX_TOTAL_TOKENS": "64", "MAX_BATCH_SIZE": "4", "NUM_SHARD": "1"})
    runner = ModelRunner(cfg, str(model_dir), CpuBackend())
    params = to_params(pb.NextTokenChooserParameters())
    runner.prefill(1, [PrefillInput(1, list(range(3, 12)), params, 0, [1, 2, 3, 4], False),
                       PrefillInput(2, list(range(5, 10)), params, 0, [5, 6, 7], False)])
    for _ in range(3):
        runner.decode([(1, [1, 2])])
    assert not refused
    assert {"rms_norm", "rotary", "write_kv"} <= set(answered)
