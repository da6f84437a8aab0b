"""Where a LoRA adapter comes from, and whether it fits: the one path of the adapters given at start
(the launcher, before any shard starts) and of those loaded while serving (router/adapter_updates.py),
so both take the same sources and refuse the same adapters."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from gaudi_runtime.adapters import (
    AdapterError,
    AdapterNotFound,
    AdapterSpec,
    check_adapter,
    digest,
    is_hub_id,
)
from gaudi_runtime.download import fetch_adapter


def resolve_and_check(spec: AdapterSpec, model_dir: str | Path, max_rank: int, hub_cache: str | None,
                      reporter=None) -> AdapterSpec:
    """`spec` with its local directory and digest, once it fits the model and --max-lora-rank: the one
    path of both start-up adapters and adapters loaded while serving. A local directory is taken as is;
    anything else that may be a hub id is fetched as the model is (HF_TOKEN, HF_ENDPOINT,
    HF_HUB_OFFLINE, the hub cache). Raises AdapterNotFound, download.DownloadError (a fetch that
    failed, naming the adapter) or AdapterError (it does not fit)."""
    path = adapter_dir(spec, hub_cache, reporter)
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    check_adapter(spec.name, path, model_config, max_rank)
    try:
        return dataclasses.replace(spec, path=path, digest=digest(path))
    except OSError as e:
        raise AdapterError(f"adapter {spec.name!r}: {e}") from None


def adapter_dir(spec: AdapterSpec, hub_cache: str | None, reporter=None) -> str:
    """The adapter's local directory: `source` itself, or its hub snapshot, fetched into the cache."""
    if os.path.isdir(spec.source):
        return os.path.abspath(spec.source)
    if not is_hub_id(spec.source):
        raise AdapterNotFound(f"adapter {spec.name!r}: {spec.source} is no directory")
    return fetch_adapter(spec, hub_cache, reporter)
