"""Habana's recipe cache on a volume, driven through the recording fake of habana_frameworks: configured
before the bridge loads, and a second start with the same key warming up from it without compiling."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from gaudi_runtime.config import resolve
from gaudi_runtime.device import select_device
from gaudi_runtime.router.shard_info import details
from gaudi_runtime.shard.info import info_response
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.shard.server import plan_recipe_cache
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.fake_modules import forget, importable_fake

SMALL = {"DTYPE": "float32", "MAX_INPUT_TOKENS": "48", "MAX_TOTAL_TOKENS": "96", "MAX_BATCH_SIZE": "8",
         "MAX_BATCH_PREFILL_TOKENS": "96", "BLOCK_SIZE": "4", "PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
         "BATCH_BUCKET_SIZE": "4", "PREFILL_BATCH_BUCKET_SIZE": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def hpu_fake(monkeypatch):
    """The fake bridge importable, not imported: the code under test makes the first import."""
    monkeypatch.delenv("PT_HPU_RECIPE_CACHE_CONFIG", raising=False)  # restored after the test
    yield from importable_fake(monkeypatch, "habana_frameworks")


def config(model_dir, cache_dir, **env: str):
    # One card, counted without loading the bridge (the launcher counts them, in another process).
    return resolve(None, {"MODEL_ID": str(model_dir), "RECIPE_CACHE_DIR": str(cache_dir), **SMALL, **env},
                   device_count=lambda device: 1)


def start(cfg, model_dir) -> ModelRunner:
    """A shard's start as `shard.server.serve` makes it, in a fresh process (the bridge not yet loaded)."""
    forget("habana_frameworks")
    recipes = plan_recipe_cache(cfg, str(model_dir), rank=0)
    backend = select_device("hpu", recipe_cache=recipes)
    backend.torch_device = torch.device("cpu")  # the fake bridge computes on the CPU
    return ModelRunner(cfg, str(model_dir), backend, recipe_cache=recipes)


def router_view(runner: ModelRunner) -> dict:
    """What the router's /info shows of this shard, through the Info message."""
    return details(info_response(runner, 1))


def record():
    return sys.modules["habana_frameworks.torch"].RECORD


def test_the_recipe_cache_is_configured_before_the_bridge_loads(hpu_fake, model_dir, tmp_path):
    recipes = plan_recipe_cache(config(model_dir, tmp_path), str(model_dir), rank=0)
    assert "habana_frameworks" not in sys.modules
    backend = select_device("hpu", recipe_cache=recipes)
    import habana_frameworks

    assert backend.name == "hpu"
    assert habana_frameworks.RECIPE_CACHE_CONFIG_AT_IMPORT == f"{tmp_path / recipes.key / 'rank-0'},false,16384"
    assert recipes.inputs["versions"]["habana"] == "1.99.0"  # the fake bridge's distribution
    assert json.loads((tmp_path / recipes.key / "key.json").read_text()) == recipes.inputs


def test_a_second_start_with_the_same_key_warms_up_from_the_cache(hpu_fake, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path)
    first = start(cfg, model_dir)
    assert router_view(first)["warmup_from_cache"] is False
    list(first.warmup())
    assert record()["recipe_compiles"] == len(record()["captures"]) > 0 and record()["recipe_hits"] == 0

    second = start(cfg, model_dir)
    assert second.recipe_cache.key == first.recipe_cache.key and router_view(second)["warmup_from_cache"] is True
    list(second.warmup())
    assert record()["recipe_hits"] == len(record()["captures"]) > 0 and record()["recipe_compiles"] == 0
    assert second.warmup_summary["from_cache"] is True
    assert router_view(second)["recipe_cache"] == {"dir": str(tmp_path / second.recipe_cache.key / "rank-0"),
                                             "key": second.recipe_cache.key, "from_cache": True}

    changed = start(config(model_dir, tmp_path, MAX_BATCH_SIZE="16"), model_dir)
    assert changed.recipe_cache.key != first.recipe_cache.key and router_view(changed)["warmup_from_cache"] is False


def test_a_warmup_that_did_not_finish_leaves_the_cache_cold(hpu_fake, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path)
    warmup = start(cfg, model_dir).warmup()
    next(warmup)  # the pod dies during warmup
    warmup.close()
    assert router_view(start(cfg, model_dir))["warmup_from_cache"] is False


def test_no_recipe_cache_without_habana_or_without_the_setting(model_dir, tmp_path):
    forget("habana_frameworks")
    assert plan_recipe_cache(config(model_dir, tmp_path), str(model_dir), 0) is None  # no bridge installed
    assert not any(tmp_path.iterdir())
    cfg = resolve(None, {"MODEL_ID": str(model_dir), **SMALL})
    assert plan_recipe_cache(cfg, str(model_dir), 0) is None
