"""Which LoRA adapter a request names: TGI's `parameters.adapter_id`, or OpenAI's `model`.

The router's `AdapterTable` holds the adapters served now, each in a slot of the shards' stacked
adapter weights (`--max-cpu-loras` slots besides slot 0, the base model, which its name
(`--model-name`) and its id also select). At start slot i holds the i-th adapter of the
configuration; with `--allow-runtime-lora-updating` adapters come and go (router/adapter_updates.py).
An unknown name is a 422 on TGI's routes and OpenAI's 404 `model_not_found` on /v1.

A request keeps the slot it was given: an unloaded adapter's name goes at once, but its slot, and the
entry the prefix cache and the metrics read for it, stay until no request holds the slot any more
(`free_slot`), so a request in flight finishes with the adapter it started with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gaudi_runtime.adapters import AdapterSpec
from gaudi_runtime.config import AdaptersConfig, ServedModelConfig
from gaudi_runtime.router.errors import ModelNotFoundError, ValidationError


@dataclass(frozen=True)
class Served:
    """One adapter loaded into a slot. `load_id` is unique per load (vLLM's `lora_int_id`): a slot
    reused, or a name reloaded, never has the same one twice."""

    name: str
    source: str  # as the user gave it (the flag's path or hub id, or `lora_path`): /v1/models' `root`
    digest: str  # SHA-256 of its files: salts its prefix-cache chains
    load_id: int


class AdapterTable:
    """The adapters served now, by slot and by name."""

    def __init__(self, adapters: AdaptersConfig, model: ServedModelConfig):
        self.base_names = {model.model_name, model.model_id}
        # Without adapters and without runtime loading `model` is ignored, as TGI does.
        self.selects = bool(adapters.lora_adapters) or adapters.allow_runtime_lora_updating
        self.max_loras = adapters.max_loras
        self._ids = itertools.count(1)
        self.slots: list[Served | None] = [None] * (max(adapters.max_cpu_loras, len(adapters.lora_adapters)) + 1)
        self._named: dict[str, int] = {}
        for i, spec in enumerate(adapters.lora_adapters, start=1):
            self.put(i, spec)

    def slot(self, name: str | None) -> int | None:
        """The slot `name` selects: 0 for none or the base model; None if no adapter has that name."""
        if name is None or name in self.base_names:
            return 0
        return self._named.get(name)

    def entry(self, slot: int) -> Served | None:
        """What slot `slot` holds, or last held while requests still use it (None: slot 0, never used)."""
        return self.slots[slot] if 0 < slot < len(self.slots) else None

    def name(self, slot: int) -> str | None:
        entry = self.entry(slot)
        return entry.name if entry is not None else None

    def served(self) -> list[Served]:
        """The adapters served now, in the order they were loaded."""
        return sorted((self.slots[i] for i in self._named.values()), key=lambda s: s.load_id)

    def current(self, slot: int, load_id: int) -> bool:
        """Whether `slot` still serves the load `load_id` (slot 0 always does)."""
        entry = self.entry(slot)
        return slot == 0 or (entry is not None and entry.load_id == load_id and self._named.get(entry.name) == slot)

    def free_slot(self, busy: set[int]) -> int | None:
        """A slot no served adapter has and no request in `busy` (the slots of live requests) uses."""
        named = set(self._named.values())
        return next((i for i in range(1, len(self.slots)) if i not in named and i not in busy), None)

    def put(self, slot: int, spec: AdapterSpec) -> Served:
        """Serve the resolved adapter `spec` from `slot` (a name served already moves there: its old
        slot drains)."""
        self.slots[slot] = served = Served(spec.name, spec.source, spec.digest or "", next(self._ids))
        self._named[spec.name] = slot
        return served

    def remove(self, name: str) -> Served | None:
        """Stop serving `name` (its slot drains); None if it is not served."""
        slot = self._named.pop(name, None)
        return None if slot is None else self.slots[slot]


def tgi_slot(table: AdapterTable, adapter_id: str | None) -> tuple[int, int]:
    """TGI's `parameters.adapter_id` -> (slot, load id); ValidationError (422) when no adapter has that name."""
    found = table.slot(adapter_id)
    if found is None:
        served = ", ".join(a.name for a in table.served()) or "none"
        raise ValidationError(f"`adapter_id` {adapter_id!r} is not a served adapter (served: {served})")
    return found, _load_id(table, found)


def openai_slot(table: AdapterTable, model: str | None) -> tuple[int, int]:
    """OpenAI's `model` -> (slot, load id). Without adapters any name means the base model (TGI ignores
    `model`); with adapters it must name the base model or one of them (vLLM's 404 otherwise)."""
    if not table.selects:
        return 0, 0
    found = table.slot(model)
    if found is None:
        raise ModelNotFoundError(model or "")
    return found, _load_id(table, found)


def _load_id(table: AdapterTable, slot: int) -> int:
    entry = table.entry(slot)
    return entry.load_id if slot and entry is not None else 0
