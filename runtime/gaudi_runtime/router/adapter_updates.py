"""LoRA adapters loaded and unloaded while serving (vLLM's runtime LoRA updating, opt-in with
`--allow-runtime-lora-updating` / `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).

A load resolves `lora_path` (a local directory, or a hub id fetched into the hub cache as the model
is), checks it against the model and `--max-lora-rank` here (`adapters.check_adapter`: nothing
changes when it fails) and registers it under a free index (`AdapterTable.free_index`: no adapter
served there and no request holding it). The shards read it when a request first needs it in a device
slot (router/adapter_slots.py), as they read any adapter no longer in their host cache. Its digest
salts its prefix-cache root, so an adapter reloaded with other weights under the same name never
reads the old one's blocks.

An unload stops serving the name at once (a new request for it: 404 on /v1, 422 on TGI's routes);
requests that already have the adapter keep its index (and its device slot while they run) until
they end. Loads and unloads run one at a time.
"""

from __future__ import annotations

import asyncio
import logging

from gaudi_runtime.adapters import AdapterSpec
from gaudi_runtime.config import AdaptersConfig, ServedModelConfig
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.live_requests import Requests

log = logging.getLogger(__name__)


class UpdateError(Exception):
    """A load or unload refused: HTTP `status`, vLLM's error `kind` and a message saying why."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


def resolve(model: ServedModelConfig, adapters: AdaptersConfig, model_dir: str, name: str, lora_path: str) -> AdapterSpec:
    """`lora_path` found and checked as a start-up adapter is (`adapters.resolve_and_check`): 404
    NotFoundError when no directory or hub repository holds it, 400 saying what does not fit otherwise."""
    from gaudi_runtime.adapter_sources import resolve_and_check
    from gaudi_runtime.adapters import AdapterError, AdapterNotFound
    from gaudi_runtime.download import DownloadError

    try:
        return resolve_and_check(AdapterSpec(name, lora_path), model_dir, adapters.max_lora_rank,
                                 model.huggingface_hub_cache)
    except (AdapterNotFound, DownloadError) as e:
        raise UpdateError(404, "NotFoundError", f"No adapter found for {lora_path}: {e}") from None
    except (AdapterError, OSError) as e:
        raise UpdateError(400, "BadRequestError", f"Loading lora {name} failed: {e}") from None


class AdapterUpdates:
    """What /v1/load_lora_adapter and /v1/unload_lora_adapter do (router/lora_api.py answers)."""

    def __init__(self, model: ServedModelConfig, adapters: AdaptersConfig, model_dir: str, table: AdapterTable,
                 requests: Requests):
        self.model, self.adapters, self.model_dir = model, adapters, model_dir
        self.table, self.requests = table, requests
        self._one_at_a_time = asyncio.Lock()

    async def load(self, name: str, lora_path: str, inplace: bool = False) -> str:
        if not name or not lora_path:
            raise UpdateError(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.table.base_names:
            raise UpdateError(400, "InvalidUserInput",
                              f"The lora adapter name '{name}' conflicts with a served base model.")
        async with self._one_at_a_time:
            if self.table.index(name) is not None and not inplace:
                raise UpdateError(400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded. "
                                  "If you want to load the adapter in place, set 'load_inplace' to True.")
            spec = await asyncio.to_thread(resolve, self.model, self.adapters, self.model_dir, name, lora_path)
            index = self.table.free_index(self.requests.busy_adapters())
            served = self.table.put(index, spec)
            self.requests.report_load()
        log.info("Loaded new LoRA adapter: name '%s', path '%s' (load %d)", name, spec.path, served.load_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        if not name:
            raise UpdateError(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._one_at_a_time:
            removed = self.table.remove(name)
            if removed is None:
                raise UpdateError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
            self.requests.report_load()
        log.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
