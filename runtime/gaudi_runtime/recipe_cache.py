"""Habana's graph recipe cache on a volume, one directory per key of everything that changes compiled graphs.

Compiling each bucket's graph is most of a Gaudi pod's first start. Habana's bridge keeps what it
compiled ("recipes") in the directory that PT_HPU_RECIPE_CACHE_CONFIG names (`<dir>,<delete on
start>,<max MB>`), read once when the bridge loads: `device.hpu.use_recipe_cache` sets it before a
shard's first `habana_frameworks` import. The directory is `<--recipe-cache-dir>/<key>/rank-<r>`.

The key hashes what the compiled graphs depend on: the model (its hub commit, or for a local directory
its config.json, weights index and weight file sizes), the dtype and quantization (FP8, KV-cache dtype,
the QUANT_CONFIG file), the number of shards, every bucket and graph setting, and the versions of the
runtime, torch and Habana's software, and the card type. So replicas with the same key share recipes,
a changed setting never meets stale ones, and `<key>/key.json` records what the key stands for.

A shard whose warmup completed leaves `<key>/rank-<r>.warm` (beside Habana's directory, not in it): a
later start that finds it reports its warmup as coming from the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path

from gaudi_runtime.config import Config
from gaudi_runtime.version import __version__

log = logging.getLogger(__name__)

# Every setting that changes the shapes warmup compiles (buckets.py reads all of these but the KV-cache
# sizing, which sets the cache tensors' shape, an input of every graph).
BUCKET_SETTINGS = ("max_input_tokens", "max_total_tokens", "max_batch_size", "max_batch_prefill_tokens",
                   "max_batch_total_tokens", "memory_fraction", "block_size", "batch_bucket_size",
                   "prefill_batch_bucket_size", "pad_sequence_to_multiple_of", "exponential_bucketing",
                   "prefix_caching", "speculate")
# Settings that change what a graph computes.
GRAPH_SETTINGS = ("enable_hpu_graph", "limit_hpu_graph", "use_flash_attention", "flash_attention_recompute",
                  "rope_scaling", "rope_factor")
WEIGHTS_INDEX = "model.safetensors.index.json"
KEY_LENGTH = 16


def model_identity(model_dir: str | Path) -> dict:
    """The hub commit of a cache snapshot directory; for any other directory, a hash of what decides the
    model's graphs (config.json, the weights index, the weight files' names and sizes)."""
    path = Path(model_dir)
    if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name):
        return {"revision": path.name}
    h = hashlib.sha256()
    for name in ("config.json", WEIGHTS_INDEX):
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}\0".encode())
    return {"files_sha256": h.hexdigest()}


def _file_sha256(path: str | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and Path(path).is_file() else None


def key_inputs(cfg: Config, model: dict, versions: dict) -> dict:
    """Everything the key stands for (pure): `model` from model_identity, `versions` of the software and card."""
    return {
        "model": model,
        "dtype": cfg.model.dtype,
        "quantize": cfg.model.quantize,
        "kv_cache_dtype": cfg.model.kv_cache_dtype,
        "quant_config_sha256": _file_sha256(cfg.model.quant_config),
        "num_shard": cfg.device.num_shard,
        "buckets": {name: cfg.setting(name) for name in BUCKET_SETTINGS},
        "graphs": {name: cfg.setting(name) for name in GRAPH_SETTINGS},
        "versions": versions,
    }


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:KEY_LENGTH]


@dataclasses.dataclass(frozen=True)
class RecipeCache:
    """One shard's recipe directory under --recipe-cache-dir."""

    root: Path
    key: str
    rank: int
    size_mb: int
    inputs: dict
    from_cache: bool  # a previous start with this key completed its warmup

    @property
    def directory(self) -> Path:
        return self.root / self.key / f"rank-{self.rank}"

    @property
    def warm_marker(self) -> Path:
        return self.root / self.key / f"rank-{self.rank}.warm"

    @property
    def env_value(self) -> str:
        """PT_HPU_RECIPE_CACHE_CONFIG: Habana's `<path>,<delete on start>,<max size MB>`; kept across starts."""
        return f"{self.directory},false,{self.size_mb}"

    def prepare(self) -> None:
        """Create the directory and record what the key stands for (OSError where the volume is not writable)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.root / self.key / "key.json"
        if not path.exists():
            path.write_text(json.dumps(self.inputs, indent=1, sort_keys=True))

    def mark_warm(self) -> None:
        try:
            self.warm_marker.touch()
        except OSError as e:  # the next start compiles again, nothing worse
            log.warning("cannot mark the recipe cache %s warm: %s", self.directory, e)


def plan(cfg: Config, model_dir: str, rank: int, device_versions: dict) -> RecipeCache:
    """The recipe directory of shard `rank` (nothing is written); `device_versions` from
    `device.hpu.software_versions()`, read without loading Habana's bridge."""
    import torch

    versions = {"runtime": __version__, "torch": torch.__version__, **device_versions}
    inputs = key_inputs(cfg, model_identity(model_dir), versions)
    key = cache_key(inputs)
    cache = RecipeCache(root=Path(cfg.device.recipe_cache_dir), key=key, rank=rank,
                        size_mb=cfg.device.recipe_cache_size_mb,
                        inputs=inputs, from_cache=False)
    return dataclasses.replace(cache, from_cache=cache.warm_marker.exists())
