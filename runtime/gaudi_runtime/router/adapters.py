"""Which LoRA adapter a request names: TGI's `parameters.adapter_id`, or OpenAI's `model`.

The router's `AdapterTable` holds the adapters registered now, each under an index (a request's
`adapter`; index 0 is the base model, which its name (`--model-name`) and its id also select). At start
index i holds the i-th adapter of the configuration; with `--allow-runtime-lora-updating` adapters come
and go (router/adapter_updates.py). Registered adapters are not bounded by the shards' device slots
(--max-loras): the batching loop has an adapter written into a slot when a request needs it there
(router/adapter_slots.py). An unknown name is a 422 on TGI's routes and OpenAI's 404
`model_not_found` on /v1.

A request keeps the index it was given: an unloaded adapter's name goes at once, but its entry, which
the prefix cache, the metrics and a slot write read, stays until no request holds the index any more
(`free_index`), so a request in flight finishes with the adapter it started with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gaudi_runtime.adapters import AdapterSpec
from gaudi_runtime.config import AdaptersConfig, ServedModelConfig
from gaudi_runtime.router.errors import ModelNotFoundError, ValidationError


@dataclass(frozen=True)
class Served:
    """One adapter registered under an index. `load_id` is unique per load (vLLM's `lora_int_id`): an
    index reused, or a name reloaded, never has the same one twice."""

    name: str
    source: str  # as the user gave it (the flag's path or hub id, or `lora_path`): /v1/models' `root`
    digest: str  # SHA-256 of its files: salts its prefix-cache chains
    load_id: int
    path: str = ""  # the local directory the shards read it from


class AdapterTable:
    """The adapters registered now, by index and by name."""

    def __init__(self, adapters: AdaptersConfig, model: ServedModelConfig):
        self.base_names = {model.model_name, model.model_id}
        # Without adapters and without runtime loading `model` is ignored, as TGI does.
        self.selects = bool(adapters.lora_adapters) or adapters.allow_runtime_lora_updating
        self.max_loras = adapters.max_loras
        self._ids = itertools.count(1)
        self.entries: list[Served | None] = [None] * (len(adapters.lora_adapters) + 1)
        self._named: dict[str, int] = {}
        for i, spec in enumerate(adapters.lora_adapters, start=1):
            self.put(i, spec)

    def index(self, name: str | None) -> int | None:
        """The index `name` selects: 0 for none or the base model; None if no adapter has that name."""
        if name is None or name in self.base_names:
            return 0
        return self._named.get(name)

    def entry(self, index: int) -> Served | None:
        """What `index` holds, or last held while requests still use it (None: index 0, never used)."""
        return self.entries[index] if 0 < index < len(self.entries) else None

    def name(self, index: int) -> str | None:
        entry = self.entry(index)
        return entry.name if entry is not None else None

    def served(self) -> list[Served]:
        """The adapters served now, in the order they were loaded."""
        return sorted((self.entries[i] for i in self._named.values()), key=lambda s: s.load_id)

    def current(self, index: int, load_id: int) -> bool:
        """Whether `index` still serves the load `load_id` (index 0 always does)."""
        entry = self.entry(index)
        return index == 0 or (entry is not None and entry.load_id == load_id and self._named.get(entry.name) == index)

    def free_index(self, busy: set[int]) -> int:
        """An index no served adapter has and no request in `busy` (the indices of live requests) uses; a
        new one when there is none."""
        named = set(self._named.values())
        free = next((i for i in range(1, len(self.entries)) if i not in named and i not in busy), None)
        if free is None:
            self.entries.append(None)
            free = len(self.entries) - 1
        return free

    def put(self, index: int, spec: AdapterSpec) -> Served:
        """Serve the resolved adapter `spec` under `index` (a name served already moves there: its old
        index drains)."""
        self.entries[index] = served = Served(spec.name, spec.source, spec.digest or "", next(self._ids),
                                              spec.path or spec.source)
        self._named[spec.name] = index
        return served

    def remove(self, name: str) -> Served | None:
        """Stop serving `name` (its index drains); None if it is not served."""
        index = self._named.pop(name, None)
        return None if index is None else self.entries[index]


def tgi_adapter(table: AdapterTable, adapter_id: str | None) -> tuple[int, int]:
    """TGI's `parameters.adapter_id` -> (index, load id); ValidationError (422) when no adapter has that name."""
    found = table.index(adapter_id)
    if found is None:
        served = ", ".join(a.name for a in table.served()) or "none"
        raise ValidationError(f"`adapter_id` {adapter_id!r} is not a served adapter (served: {served})")
    return found, _load_id(table, found)


def openai_adapter(table: AdapterTable, model: str | None) -> tuple[int, int]:
    """OpenAI's `model` -> (index, load id). Without adapters any name means the base model (TGI ignores
    `model`); with adapters it must name the base model or one of them (vLLM's 404 otherwise)."""
    if not table.selects:
        return 0, 0
    found = table.index(model)
    if found is None:
        raise ModelNotFoundError(model or "")
    return found, _load_id(table, found)


def _load_id(table: AdapterTable, index: int) -> int:
    entry = table.entry(index)
    return entry.load_id if index and entry is not None else 0
