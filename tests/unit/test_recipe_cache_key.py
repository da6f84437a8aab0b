"""The recipe cache's key: it changes with everything that changes compiled graphs, and only with that.
(The cache itself, with the fake Habana bridge: tests/runtime/test_recipe_cache.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gaudi_runtime import buckets
from gaudi_runtime.config import resolve
from gaudi_runtime.recipe_cache import BUCKET_SETTINGS, GRAPH_SETTINGS, cache_key, key_inputs, model_identity

BASE = {"MODEL_ID": "/m", "DTYPE": "bfloat16", "MAX_INPUT_TOKENS": "1024", "MAX_TOTAL_TOKENS": "2048",
        "MAX_BATCH_SIZE": "32", "MAX_BATCH_PREFILL_TOKENS": "4096"}
MODEL = {"revision": "a" * 40}
VERSIONS = {"runtime": "0.1.0", "torch": "2.6.0", "habana": "1.21.0.555", "device_type": "GAUDI2"}
CHANGES = {
    "DTYPE": "float16", "QUANTIZE": "fp8", "KV_CACHE_DTYPE": "fp8_e4m3fn", "NUM_SHARD": "2",
    "MAX_INPUT_TOKENS": "512", "MAX_TOTAL_TOKENS": "4096", "MAX_BATCH_SIZE": "64", "MAX_BATCH_PREFILL_TOKENS": "8192",
    "MAX_BATCH_TOTAL_TOKENS": "65536", "MEMORY_FRACTION": "0.8", "BLOCK_SIZE": "64", "BATCH_BUCKET_SIZE": "16",
    "PREFILL_BATCH_BUCKET_SIZE": "2", "PAD_SEQUENCE_TO_MULTIPLE_OF": "256", "EXPONENTIAL_BUCKETING": "true",
    "ENABLE_HPU_GRAPH": "false", "LIMIT_HPU_GRAPH": "true", "USE_FLASH_ATTENTION": "false",
    "FLASH_ATTENTION_RECOMPUTE": "true", "ROPE_SCALING": "dynamic", "PREFIX_CACHING": "false", "SPECULATE": "3",
}


def key(model=MODEL, versions=VERSIONS, **env: str) -> str:
    cfg = resolve(None, {**BASE, **env}, device_count=lambda device: 1)
    return cache_key(key_inputs(cfg, model, versions))


@pytest.mark.parametrize("name, value", sorted(CHANGES.items()))
def test_each_setting_that_changes_graphs_changes_the_key(name, value):
    assert key(**{name: value}) != key()


@pytest.mark.parametrize("name, value", [("PORT", "9000"), ("API_KEY", "k"), ("LOG_LEVEL", "debug"),
                                         ("MAX_CONCURRENT_REQUESTS", "64"), ("DECODE_STEPS", "8"),
                                         ("WARMUP_ENABLED", "false"), ("RECIPE_CACHE_DIR", "/elsewhere")])
def test_settings_that_leave_graphs_alone_keep_the_key(name, value):
    assert key(**{name: value}) == key()


@pytest.mark.parametrize("part, value", [("runtime", "0.2.0"), ("torch", "2.7.0"), ("habana", "1.22.0.100"),
                                         ("device_type", "GAUDI3")])
def test_each_software_version_and_the_card_type_change_the_key(part, value):
    assert key(versions={**VERSIONS, part: value}) != key()


def test_the_model_revision_and_the_quant_config_file_change_the_key(tmp_path):
    assert key(model={"revision": "b" * 40}) != key()
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text('{"mode": "QUANTIZE", "allowlist": {"names": ["mlp"]}}')
    two.write_text('{"mode": "QUANTIZE", "allowlist": {"names": ["attn"]}}')
    assert key(QUANT_CONFIG=str(one)) != key(QUANT_CONFIG=str(two))


def test_every_setting_the_buckets_read_is_in_the_key():
    tree = ast.parse(Path(buckets.__file__).read_text())
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "cfg"}  # cfg.<part>.<setting>
    assert read and read <= set(BUCKET_SETTINGS)
    covered = {name.lower() for name in CHANGES}
    assert set(BUCKET_SETTINGS) | set(GRAPH_SETTINGS) - {"rope_factor"} <= covered


def test_model_identity_is_the_commit_or_what_decides_a_local_models_graphs(tmp_path):
    snapshot = tmp_path / "models--org--m" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    assert model_identity(snapshot) == {"revision": "c" * 40}
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text('{"num_hidden_layers": 2}')
    (local / "model.safetensors").write_bytes(b"x" * 100)
    first = model_identity(local)
    (local / "model.safetensors").write_bytes(b"y" * 100)  # new weights, same shapes: same graphs
    assert model_identity(local) == first and re.fullmatch(r"[0-9a-f]{64}", first["files_sha256"])
    (local / "config.json").write_text('{"num_hidden_layers": 4}')
    assert model_identity(local) != first
