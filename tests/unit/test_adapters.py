"""LoRA adapters: the flags' syntax, the start-up checks, per-row selection, scheduling and the prefix
cache's roots, and the model's output with several adapters in one batch against peft's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gaudi_runtime.adapter_sources import resolve_and_check
from gaudi_runtime.adapters import (
    AdapterError,
    AdapterNotFound,
    AdapterSpec,
    check_adapter,
    digest,
    is_hub_id,
    parse_specs,
)
from gaudi_runtime.config import ConfigError, resolve
from gaudi_runtime.router import adapters as router_adapters
from gaudi_runtime.router.errors import ModelNotFoundError, ValidationError
from gaudi_runtime.router.prefix_cache import PrefixCache, root_hash
from gaudi_runtime.router.scheduler import Waiting, select_prefill
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.lora_adapters import make_adapter

BASE = {"MODEL_ID": "/m", "MAX_TOTAL_TOKENS": "64", "MAX_BATCH_SIZE": "8"}


def config(**env: str):
    return resolve(None, {**BASE, **env}, device_count=lambda d: 1)


def parts(cfg):
    """What the router's adapter table reads: the adapters and the base model's names."""
    return cfg.adapters, cfg.model


# --- the flags ----------------------------------------------------------------------------------

def test_tgi_and_vllm_spellings_give_one_list_in_order():
    got = parse_specs("org/sql@v2, me=/tmp/y,plain", "a=/x b=/z")
    assert got == [AdapterSpec("org/sql", "org/sql", "v2"), AdapterSpec("me", "/tmp/y"), AdapterSpec("plain", "plain"),
                   AdapterSpec("a", "/x"), AdapterSpec("b", "/z")]


@pytest.mark.parametrize("adapters, modules, message", [("a=/x,a=/y", None, "given twice"),
                                                         (None, "noequals", "name=path"), ("=/x", None, "empty")])
def test_bad_specs_are_refused(adapters, modules, message):
    with pytest.raises(AdapterError, match=message):
        parse_specs(adapters, modules)


def test_config_reads_the_flags_and_derives_max_loras():
    cfg = config(LORA_ADAPTERS="a=/x,b=/y", LORA_MODULES="c=/z")
    assert [a.name for a in cfg.adapters.lora_adapters] == ["a", "b", "c"]
    assert cfg.adapters.max_loras == 3 and cfg.adapters.max_lora_rank == 16
    assert config(LORA_ADAPTERS="a=/x", MAX_LORAS="1", MAX_LORA_RANK="64").adapters.max_lora_rank == 64
    assert config().adapters.lora_adapters == () and config().adapters.max_loras == 0


@pytest.mark.parametrize("env, message", [
    ({"LORA_ADAPTERS": "a=/x", "QUANTIZE": "fp8"}, "fp8 cannot be combined"),
    ({"LORA_ADAPTERS": "/m=/x"}, "base model's name"),
    ({"LORA_ADAPTERS": "a=/x", "MAX_LORAS": "0"}, "--max-loras"),
    ({"MAX_LORA_RANK": "0"}, "--max-lora-rank"),
])
def test_config_refuses_what_cannot_be_served(env, message):
    with pytest.raises(ConfigError, match=message):
        config(**env)


# --- the start-up checks against the base model ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    adapter = make_adapter(model_dir, tmp_path_factory.mktemp("sql"), seed=1, rank=8)
    return model_dir, adapter, json.loads((Path(model_dir) / "config.json").read_text())


def test_a_good_adapter_passes_with_its_rank_and_scale(tiny):
    _, adapter, model_config = tiny
    facts = check_adapter("sql", adapter, model_config, max_rank=16)
    assert facts.rank == 8 and facts.scale == 1.0  # lora_alpha 8 / rank 8
    assert len(facts.modules) == 7 * model_config["num_hidden_layers"]


def test_one_resolution_serves_start_up_and_runtime_loads(tiny, tmp_path):
    """`resolve_and_check` is what the launcher and a load request both run: the spec comes back with its
    directory and digest, or with the error kind each caller maps (not found -> 404, does not fit -> 400)."""
    model_dir, adapter, _ = tiny
    spec = resolve_and_check(AdapterSpec("sql", str(adapter)), model_dir, max_rank=16, hub_cache=str(tmp_path))
    assert spec.path == str(Path(adapter).resolve()) and spec.digest == digest(adapter) and spec.name == "sql"
    with pytest.raises(AdapterNotFound, match="is no directory"):
        resolve_and_check(AdapterSpec("x", str(tmp_path / "absent")), model_dir, 16, str(tmp_path))
    with pytest.raises(AdapterError, match="above --max-lora-rank 4") as e:
        resolve_and_check(AdapterSpec("sql", str(adapter)), model_dir, max_rank=4, hub_cache=str(tmp_path))
    assert not isinstance(e.value, AdapterNotFound)


@pytest.mark.parametrize("source, hub", [("org/name", True), ("name", True), ("./rel", False), ("/abs/dir", False),
                                         ("a/b/c", False)])
def test_what_may_name_a_hub_adapter(source, hub):
    assert is_hub_id(source) is hub


def _copy(adapter: Path, to: Path) -> Path:
    to.mkdir()
    for f in adapter.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_each_bad_adapter_gets_its_own_reason(tiny, tmp_path):
    model_dir, adapter, model_config = tiny
    with pytest.raises(AdapterError, match="rank 8, above --max-lora-rank 4"):
        check_adapter("sql", adapter, model_config, max_rank=4)
    other = dict(model_config, hidden_size=model_config["hidden_size"] * 2)
    with pytest.raises(AdapterError, match="another base model"):
        check_adapter("sql", adapter, other, max_rank=16)
    with pytest.raises(AdapterError, match="LoRA adapters are served for"):
        check_adapter("sql", adapter, dict(model_config, architectures=["FalconForCausalLM"]), max_rank=16)
    fewer = dict(model_config, num_hidden_layers=1)
    with pytest.raises(AdapterError, match="which the model does not have"):
        check_adapter("sql", adapter, fewer, max_rank=16)
    targets = _copy(adapter, tmp_path / "targets")
    cfg = json.loads((targets / "adapter_config.json").read_text())
    (targets / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "c_attn"]}))
    with pytest.raises(AdapterError, match="targets c_attn, which the model does not have"):
        check_adapter("t", targets, model_config, max_rank=16)
    (targets / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(AdapterError, match="LM head are not supported"):
        check_adapter("t", targets, model_config, max_rank=16)
    corrupt = _copy(adapter, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        check_adapter("c", corrupt, model_config, max_rank=16)
    missing = _copy(adapter, tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        check_adapter("m", missing, model_config, max_rank=16)
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        check_adapter("d", tmp_path, model_config, max_rank=16)


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["gathered-bmm", "cpu-kernels"])
def test_one_batch_mixes_the_base_model_and_adapters_as_peft_computes_them(tiny, tmp_path, cpu_kernels):
    """Rows with no adapter, each adapter, and one adapter twice, in one forward pass: through the gathered
    bmm every device has, and through the CPU backend's kernels (device/cpu_lora.py among them)."""
    import transformers
    from peft import PeftModel

    from gaudi_runtime.layers.attention import AttentionMetadata
    from gaudi_runtime.models import load_model
    from gaudi_runtime.models.lora import attach_adapters

    model_dir, sql, model_config = tiny
    attn = make_adapter(model_dir, tmp_path / "attn", seed=2, rank=2, targets=["q_proj", "v_proj"], rslora=True)
    ours = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    rows = attach_adapters(ours, [("sql", str(sql)), ("attn", str(attn))], model_config, max_rank=16)
    if cpu_kernels:
        from gaudi_runtime.device.cpu import CpuBackend

        CpuBackend().prepare_model(ours)
        assert all(m.lora.kernel is not None for m in ours.modules() if getattr(m, "lora", None) is not None)
    slots = [0, 1, 2, 1]
    ids = torch.randint(0, ours.vocab_size, (len(slots), 7), generator=torch.Generator().manual_seed(0))
    rows.index = torch.tensor(slots)
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(ids.shape, dtype=torch.long))
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(7).expand(ids.shape), None, meta))
    for i, slot in enumerate(slots):
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if slot:
            ref = PeftModel.from_pretrained(ref, str((sql, attn)[slot - 1]))
        with torch.no_grad():
            want = ref(ids[i:i + 1]).logits[0].float()
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)


# --- selection, scheduling, prefix cache ----------------------------------------------------------

def test_requests_select_adapters_by_name():
    table = router_adapters.AdapterTable(*parts(config(LORA_ADAPTERS="a=/x,b=/y", MODEL_NAME="base")))
    assert [router_adapters.tgi_adapter(table, n)[0] for n in (None, "base", "/m", "a", "b")] == [0, 0, 0, 1, 2]
    assert router_adapters.openai_adapter(table, "b") == (2, 2) and table.name(2) == "b"
    with pytest.raises(ValidationError, match="not a served adapter"):
        router_adapters.tgi_adapter(table, "c")
    with pytest.raises(ModelNotFoundError):
        router_adapters.openai_adapter(table, "c")
    # No adapters: `model` is ignored, as TGI does; unless adapters may be loaded while serving.
    assert router_adapters.openai_adapter(router_adapters.AdapterTable(*parts(config())), "anything") == (0, 0)
    runtime = router_adapters.AdapterTable(*parts(config(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")))
    with pytest.raises(ModelNotFoundError):
        router_adapters.openai_adapter(runtime, "anything")


def test_an_unloaded_adapters_index_waits_for_its_requests_and_a_reload_is_a_new_load():
    table = router_adapters.AdapterTable(*parts(config(LORA_ADAPTERS="a=/x", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
                                                MAX_LORAS="1")))
    assert table.free_index(busy=set()) == 2  # registered adapters are not bounded by the device slots
    first = table.index("a"), table.entry(1).load_id
    assert table.remove("a").name == "a" and table.index("a") is None
    assert table.free_index(busy={1}) == 2  # a request still runs with `a`: its index is not reused
    assert table.name(1) == "a" and not table.current(*first)  # ... and still names it; new requests 404
    table.put(2, AdapterSpec("b", "/y", digest="d"))
    assert table.free_index(busy={1}) == 3 and table.free_index(busy=set()) == 1
    table.put(1, AdapterSpec("b", "/y2", digest="d2"))  # `b` reloaded in place: index 1 now, index 2 drains
    assert table.index("b") == 1 and [a.source for a in table.served()] == ["/y2"]
    assert table.free_index(busy={2}) == 3 and table.free_index(busy=set()) == 2


@pytest.mark.parametrize("env, cached, max_loras", [
    ({}, 1, 1), ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, 5, 5),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "MAX_LORAS": "8"}, 8, 8),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "MAX_CPU_LORAS": "2", "MAX_LORAS": "1"}, 2, 1)])
def test_adapter_slots_are_fixed_at_start(env, cached, max_loras):
    cfg = config(LORA_ADAPTERS="a=/x", **env)
    assert (cfg.adapters.max_cpu_loras, cfg.adapters.max_loras) == (cached, max_loras)


def test_more_adapters_than_device_slots_are_kept_in_host_memory_by_default(caplog):
    three = "a=/x,b=/y,c=/z"
    assert (config(LORA_ADAPTERS=three, MAX_LORAS="1").adapters.max_cpu_loras, caplog.text) == (3, "")
    # --max-cpu-loras alone (its meaning before: the device slots) keeps that many device slots, saying so once.
    old = config(LORA_ADAPTERS=three, MAX_CPU_LORAS="2").adapters
    assert (old.max_loras, old.max_cpu_loras) == (2, 2)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "--max-cpu-loras 2 without --max-loras: 2 device slots" in caplog.text


@pytest.mark.parametrize("env, message", [({"MAX_CPU_LORAS": "0"}, "--max-cpu-loras must be positive"),
                                          ({"MAX_CPU_LORAS": "2", "MAX_LORAS": "3"},
                                           r"^--max-cpu-loras \(2\) must be >= --max-loras \(3\)$")])
def test_bad_slot_counts_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        config(LORA_ADAPTERS="a=/x", **env)


def test_max_loras_bounds_the_distinct_adapters_in_a_batch():
    cfg = config(LORA_ADAPTERS="a=/x,b=/y,c=/z", MAX_LORAS="2", PAD_SEQUENCE_TO_MULTIPLE_OF="4")
    waiting = [Waiting(4, 4, adapter=a) for a in (1, 0, 2, 1, 3, 2)]
    assert select_prefill(waiting, 0, 100, cfg) == 4  # a third adapter (slot 3) waits
    assert select_prefill(waiting, 1, 100, cfg, running_adapters=frozenset({3, 0})) == 2  # 3 running: only 1 more


def test_each_adapter_roots_its_own_block_hashes():
    cfg = config(LORA_ADAPTERS="a=/x,b=/y")
    cfg = cfg.replace(lora_adapters=tuple(dataclasses.replace(a, digest=f"d{i}")
                                          for i, a in enumerate(cfg.adapters.lora_adapters, start=1)))
    table = router_adapters.AdapterTable(cfg.adapters, cfg.model)
    cache = PrefixCache(cfg, None, table)
    roots = [cache.slot_root(i) for i in range(3)]
    assert roots[0] == root_hash(cfg) and len(set(roots)) == 3
    table.put(1, AdapterSpec("a", "/x", digest="changed"))
    assert cache.slot_root(1) != roots[1]  # new weights under the same name: new blocks
