"""Our Llama-family model vs transformers, on tiny random fp32 models of every family.

* prefill logits of a right-padded batch == transformers' logits of each prompt alone;
* greedy generation through the paged KV cache (block_size 4, shuffled blocks) == transformers generate;
* a continuous-batching pattern (prefills joining running decodes, changing row order) == generate;
  both with decode over the gathered blocks and in place (the CPU kernel);
* config variants (biases, MHA, head_dim != hidden/heads, linear/dynamic/llama3/yarn RoPE in both config
  layouts, sharded checkpoints, Mistral's sliding window) with every weight perturbed;
* unknown architectures raise UnsupportedModelError;
* tensor parallelism (gloo, 2 and 4 CPU processes) gives the tp=1 tokens and logits.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import socket

import pytest
import torch

from gaudi_runtime.layers import AttentionMetadata, allocate_kv_cache, kv_bytes_per_block
from gaudi_runtime.layers.attention import use_attention
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.kv_cache import allocate_cache, model_token_shapes
from gaudi_runtime.layers.rotary import compute_inv_freq, rope_params_from_config
from gaudi_runtime.models import SUPPORTED_ARCHITECTURES, UnsupportedModelError, load_model

FAMILIES = ["llama", "llama31", "mistral", "qwen2"]
BLOCK_SIZE = 4
PROMPT_LENS = [3, 9, 14]
MAX_NEW = 12


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {f: str(make_tiny_model(root / f, f)) for f in FAMILIES}


_REF_CACHE: dict[str, object] = {}


def _reference(model_dir: str):
    import transformers

    if model_dir not in _REF_CACHE:
        _REF_CACHE[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    return _REF_CACHE[model_dir]


def _prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lens]


class PagedRunner:
    """A minimal driver: one block table per sequence, blocks handed out in shuffled order.

    ``prefill(rows)`` / ``decode(rows)`` run a subset of the sequences (in the given order), so tests can
    mix prefills and decodes the way a continuous-batching scheduler does. Generated tokens go to ``out``.
    """

    def __init__(self, model, prompts, max_new, block_size=BLOCK_SIZE, pad_rows=1, seed=0,
                 dtype=torch.float32):
        self.model, self.prompts, self.bs, self.pad_rows = model, prompts, block_size, pad_rows
        need = [math.ceil((len(p) + max_new) / block_size) for p in prompts]
        free = list(range(1, 1 + sum(need) + 3))  # block 0 is the trash block; a few spare blocks
        random.Random(seed).shuffle(free)
        self.tables = []
        for n in need:
            self.tables.append(free[:n])
            free = free[n:]
        self.caches = allocate_cache(model.num_layers, 1 + sum(need) + 3, block_size, model_token_shapes(model),
                                     dtype, "cpu")
        self.nb = max(need) + 1  # decode block-table width (a bucket wider than any table)
        self.out: list[list[int]] = [[] for _ in prompts]

    def slot(self, i: int, pos: int) -> int:
        return self.tables[i][pos // self.bs] * self.bs + pos % self.bs

    def prefill(self, rows=None) -> torch.Tensor:
        """Right-padded batch (plus all-pad rows); returns last-token logits [len(rows), vocab]."""
        rows = list(range(len(self.prompts))) if rows is None else rows
        n = len(rows)
        b, s = n + self.pad_rows, max(len(self.prompts[i]) for i in rows) + 2
        ids = torch.zeros(b, s, dtype=torch.long)
        pos = torch.zeros(b, s, dtype=torch.long)
        slots = torch.zeros(b, s, dtype=torch.long)
        for r, i in enumerate(rows):
            p = self.prompts[i]
            ids[r, : len(p)] = torch.tensor(p)
            pos[r, : len(p)] = torch.arange(len(p))
            slots[r, : len(p)] = torch.tensor([self.slot(i, j) for j in range(len(p))])
        with torch.no_grad():
            hidden = self.model(ids, pos, self.caches, AttentionMetadata(is_prefill=True, slots=slots))
        assert hidden.shape == (b, s, self.model.hidden_size)
        self.prefill_hidden = hidden
        last = torch.tensor([len(self.prompts[i]) - 1 for i in rows])
        logits = self.model.compute_logits(hidden[torch.arange(n), last])
        for i, t in zip(rows, logits.argmax(-1).tolist(), strict=True):
            self.out[i].append(t)
        return logits

    def decode(self, rows=None) -> torch.Tensor:
        rows = list(range(len(self.prompts))) if rows is None else rows
        n = len(rows)
        b = n + self.pad_rows
        ids = torch.zeros(b, 1, dtype=torch.long)
        pos = torch.zeros(b, 1, dtype=torch.long)
        slots = torch.zeros(b, 1, dtype=torch.long)
        tables = torch.zeros(b, self.nb, dtype=torch.long)
        ctx = torch.zeros(b, dtype=torch.long)  # padded rows keep 0: must not give NaN
        for r, i in enumerate(rows):
            position = len(self.prompts[i]) + len(self.out[i]) - 1
            ids[r, 0], pos[r, 0], slots[r, 0] = self.out[i][-1], position, self.slot(i, position)
            tables[r, : len(self.tables[i])] = torch.tensor(self.tables[i])
            ctx[r] = position + 1
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_tables=tables, context_lens=ctx)
        with torch.no_grad():
            hidden = self.model(ids, pos, self.caches, meta)
        assert torch.isfinite(hidden).all()
        logits = self.model.compute_logits(hidden[:, 0])[:n]
        for i, t in zip(rows, logits.argmax(-1).tolist(), strict=True):
            self.out[i].append(t)
        return logits

    def generate(self, max_new: int):
        """Greedy, whole batch; returns (tokens per prompt, list of logits per step [n, vocab])."""
        steps = [self.prefill()]
        for _ in range(max_new - 1):
            steps.append(self.decode())
        return self.out, steps


def _hf_greedy(ref, prompt, max_new, eos) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=max_new, do_sample=False, pad_token_id=eos)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) >= 1
    return theirs


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=["gather", "in-place"])
def decode_attention(request):
    """The attention backend to decode with: over the gathered blocks (torch SDPA, every device) or reading
    the cache in place (the CPU's, with its C kernel)."""
    from gaudi_runtime.device.cpu_attention import CpuAttention
    from gaudi_runtime.device.cpu_paged_attention import kernel

    if request.param == "gather":
        return AttentionBackend()
    if kernel() is None:
        pytest.fail("the CPU paged attention kernel did not build: is there a C compiler (cc or $CC)?")
    return CpuAttention(kernel())


def _check_prefill(model, ref, prompts) -> None:
    runner = PagedRunner(model, prompts, MAX_NEW)
    runner.prefill()
    hidden = runner.prefill_hidden
    for i, p in enumerate(prompts):
        ours = model.compute_logits(hidden[i, : len(p)])
        with torch.no_grad():
            theirs = ref(torch.tensor([p])).logits[0].float()
        assert ours.dtype == torch.float32 and ours.shape == (len(p), model.vocab_size)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _check_greedy(model, ref, prompts, max_new=MAX_NEW, seed=7) -> None:
    ours, _ = PagedRunner(model, prompts, max_new, seed=seed).generate(max_new)
    for p, mine in zip(prompts, ours, strict=True):
        theirs = _hf_greedy(ref, p, max_new, model.eos_token_ids[0])
        # transformers stops at EOS; our loop does not, so compare up to (and including) its EOS.
        assert mine[: len(theirs)] == theirs, (mine, theirs)


def test_prefill_logits_match_transformers(tiny_model_dirs, family):
    d = tiny_model_dirs[family]
    model = load_model(d, torch.float32, torch.device("cpu"))
    _check_prefill(model, _reference(d), _prompts(model.vocab_size))


def test_greedy_generation_through_paged_cache_matches_transformers(tiny_model_dirs, family, decode_attention):
    d = tiny_model_dirs[family]
    model = load_model(d, torch.float32, torch.device("cpu"))
    use_attention(model, decode_attention)
    _check_greedy(model, _reference(d), _prompts(model.vocab_size, seed=1))


# Variants the tiny models do not cover. All weights are perturbed (tiny_model's biases are zero and its
# norms one), the checkpoint is split over several files with an index, and some configs are rewritten in
# the transformers 4 layout (rope_theta + rope_scaling with "type").
def _variant_config(name: str):
    import transformers

    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, initializer_range=0.1,
                  bos_token_id=0, eos_token_id=1)
    if name == "llama-bias-mha-linear":
        return transformers.LlamaConfig(**common, num_key_value_heads=4, head_dim=32, attention_bias=True,
                                        mlp_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 10000.0}), None
    if name == "llama-dynamic-legacy":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=1,
                                       rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 20000.0})
        return cfg, {"rope_theta": 20000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    if name == "llama3-legacy":
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16,
                                                        "rope_theta": 500000.0})
        return cfg, {"rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}}
    if name == "qwen2-random-bias":
        return transformers.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                        use_sliding_window=False, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1e6}), None
    if name == "mistral-window":
        return transformers.MistralConfig(**common, num_key_value_heads=2, sliding_window=64), None
    if name == "qwen2-yarn-legacy":  # long-context Qwen's yarn: cos/sin scaled by the attention factor
        cfg = transformers.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=False,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 32})
        return cfg, {"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32}}
    raise ValueError(name)


VARIANTS = ["llama-bias-mha-linear", "llama-dynamic-legacy", "llama3-legacy", "qwen2-random-bias",
            "mistral-window", "qwen2-yarn-legacy"]


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory):
    """``variant_dirs(name)`` builds (once) and returns the directory of a variant model."""
    import transformers

    built: dict[str, str] = {}

    def build(name: str) -> str:
        if name in built:
            return built[name]
        cfg, legacy_rope = _variant_config(name)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, max_shard_size="100KB")
        assert (d / "model.safetensors.index.json").is_file()
        if legacy_rope is not None:
            cfg_dict = json.loads((d / "config.json").read_text())
            cfg_dict.pop("rope_parameters", None)
            cfg_dict.update(legacy_rope)
            (d / "config.json").write_text(json.dumps(cfg_dict))
        built[name] = str(d)
        return built[name]

    return build


@pytest.mark.parametrize("name", VARIANTS)
def test_variants_match_transformers(variant_dirs, name):
    d = variant_dirs(name)
    model = load_model(d, torch.float32, torch.device("cpu"))
    ref = _reference(d)
    if name == "mistral-window":  # sliding window not implemented: served length capped at the window
        assert model.max_position_embeddings == 64
    prompts = _prompts(model.vocab_size, seed=11)
    _check_prefill(model, ref, prompts)
    _check_greedy(model, ref, prompts, max_new=10)


def test_continuous_batching_pattern_matches_transformers(tiny_model_dirs, family, decode_attention):
    """Sequences join and leave the decode batch, in changing row orders, with padded rows."""
    d = tiny_model_dirs[family]
    model = load_model(d, torch.float32, torch.device("cpu"))
    use_attention(model, decode_attention)
    ref = _reference(d)
    prompts = _prompts(model.vocab_size, lens=[5, 11, 2, 7], seed=3)
    runner = PagedRunner(model, prompts, MAX_NEW, pad_rows=2, seed=9)
    runner.prefill([1, 0])
    for _ in range(3):
        runner.decode([0, 1])
    runner.prefill([3, 2])  # a new prefill while 0 and 1 are mid-generation
    for _ in range(5):
        runner.decode([2, 0, 3, 1])
    for _ in range(MAX_NEW - 1 - 8):
        runner.decode([1, 0])  # 0 and 1 finish
    for _ in range(3):
        runner.decode([3, 2])
    for i, p in enumerate(prompts):
        mine = runner.out[i]
        theirs = _hf_greedy(ref, p, len(mine), model.eos_token_ids[0])
        assert mine[: len(theirs)] == theirs, (i, mine, theirs)


def test_decode_logits_match_full_recompute(tiny_model_dirs, decode_attention):
    """Every decode step's logits equal transformers' logits for the whole sequence so far."""
    d = tiny_model_dirs["llama31"]
    model = load_model(d, torch.float32, torch.device("cpu"))
    use_attention(model, decode_attention)
    ref = _reference(d)
    prompts = _prompts(model.vocab_size, seed=2)
    tokens, steps = PagedRunner(model, prompts, 6, seed=3).generate(6)
    for i, p in enumerate(prompts):
        seq = p + tokens[i][:-1]
        with torch.no_grad():
            full = ref(torch.tensor([seq])).logits[0, len(p) - 1:].float()
        ours = torch.stack([s[i] for s in steps])
        torch.testing.assert_close(ours, full, atol=1e-4, rtol=1e-4)


def test_unknown_architecture_raises(tiny_model_dirs, tmp_path):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dirs["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(str(d), torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES and arch in msg
    assert isinstance(e.value, ValueError)


def test_model_attributes(tiny_model_dirs, tmp_path):
    d = tmp_path / "multi_eos"
    shutil.copytree(tiny_model_dirs["qwen2"], d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 2]
    (d / "generation_config.json").write_text(json.dumps(gen))
    model = load_model(str(d), torch.float32, torch.device("cpu"))
    assert model.eos_token_ids == [1, 2]
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
    assert model.vocab_size == json.loads((d / "config.json").read_text())["vocab_size"]
    assert model.max_position_embeddings == 4096
    assert kv_bytes_per_block(2, 4, 2, 16, torch.bfloat16) == 2 * 2 * 4 * 2 * 16 * 2
    caches = allocate_kv_cache(2, 5, 4, 2, 16, torch.bfloat16, "cpu")
    assert len(caches) == 2 and caches[0][0].shape == (5, 4, 2, 16) and caches[0][1].dtype == torch.bfloat16


def test_bfloat16_load_runs(tiny_model_dirs):
    model = load_model(tiny_model_dirs["llama"], torch.bfloat16, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = _prompts(model.vocab_size)
    tokens, steps = PagedRunner(model, prompts, 3, dtype=torch.bfloat16).generate(3)
    assert all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in steps)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_inv_freq_matches_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 50000.0, "rope_type": "default", **(scaling or {})}
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=512,
                                   rope_parameters=params)
    cfg_dict = cfg.to_dict()
    theta, parsed = rope_params_from_config(cfg_dict)
    ours = compute_inv_freq(32, theta, parsed, 512)
    if scaling is None:
        theirs = 1.0 / (50000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=0)
    # legacy (transformers 4) layout: rope_theta + rope_scaling with "type"
    legacy = {"rope_theta": 50000.0}
    if scaling:
        legacy["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    theta2, parsed2 = rope_params_from_config(legacy)
    torch.testing.assert_close(compute_inv_freq(32, theta2, parsed2, 512), ours, atol=0, rtol=0)


# ---- tensor parallelism -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = load_model(model_dir, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=world)
        prompts = _prompts(model.vocab_size, seed=4)
        tokens, steps = PagedRunner(model, prompts, 5, seed=5).generate(5)
        if rank == 0:
            torch.save({"tokens": tokens, "steps": steps, "num_kv_heads": model.num_kv_heads}, out_path)
    finally:
        dist.destroy_process_group()


# llama-bias-mha-linear: 4 KV heads, biases on q/k/v/o and the MLP (added once after the all-reduce),
# vocab 101 padded to 102. qwen2-random-bias at tp=4: 2 KV heads replicated on 2 ranks each, q/k/v biases
# sliced with them, tied embeddings, vocab padded to 104.
@pytest.mark.parametrize("name,world", [("llama-bias-mha-linear", 2), ("qwen2-random-bias", 4)])
def test_tensor_parallel_matches_single_rank(variant_dirs, tmp_path, name, world):
    import torch.multiprocessing as mp

    d = variant_dirs(name)
    out = tmp_path / "tp.pt"
    mp.spawn(_tp_worker, args=(world, _free_port(), d, str(out)), nprocs=world, join=True)
    got = torch.load(out)
    model = load_model(d, torch.float32, torch.device("cpu"))
    prompts = _prompts(model.vocab_size, seed=4)
    tokens, steps = PagedRunner(model, prompts, 5, seed=5).generate(5)
    assert got["num_kv_heads"] == max(1, model.num_kv_heads // world)
    assert got["tokens"] == tokens
    for a, b in zip(got["steps"], steps, strict=True):
        assert a.shape == b.shape == (len(prompts), model.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lazy_weight_narrow_composes_like_tensor_narrow():
    from gaudi_runtime.layers.linear import LazyWeight

    t = torch.arange(6 * 8 * 3).reshape(6, 8, 3)
    lazy = LazyWeight(t, t.shape)
    got = lazy.narrow(1, 2, 5).narrow(0, 1, 4).narrow(1, 1, 3).narrow(-1, 1, 2)
    want = t.narrow(1, 2, 5).narrow(0, 1, 4).narrow(1, 1, 3).narrow(-1, 1, 2)
    assert got.shape == want.shape and got.dim() == 3 and got.size(1) == 3
    assert torch.equal(got.load(), want)
    with pytest.raises(ValueError):
        lazy.narrow(0, 4, 3)
