"""The shard's host copies of LoRA adapters, vLLM's CPU LoRA cache (--max-cpu-loras).

The device slots (--max-loras) hold the adapters a batch may use; the router has an adapter written
into a slot when a request needs it there (`LoadAdapter`). The weights come from a host copy when the
shard holds one, else from the adapter's files, read and checked again; the copy is then kept, and the
least recently used one dropped beyond the capacity. Keyed by the router's load id, so an adapter
reloaded (new files under the same name) is read again rather than served from an old copy.
"""

from __future__ import annotations

from collections import OrderedDict

from gaudi_runtime.models.lora import load_adapters


class HostAdapters:
    """At most `capacity` read adapters (`models/lora.read_adapter`'s parts) by load id, least recently
    used first; `hits` and `reads` count the writes served from a copy and those read from files."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._copies: OrderedDict[int, object] = OrderedDict()
        self.hits = 0
        self.reads = 0

    def get(self, load_id: int) -> object | None:
        """The copy of that load (now the most recently used, counted as a hit), or None (counted as a read:
        the caller reads the files)."""
        parts = self._copies.get(load_id)
        if parts is None:
            self.reads += 1
            return None
        self._copies.move_to_end(load_id)
        self.hits += 1
        return parts

    def put(self, load_id: int, parts: object) -> None:
        """Keep a copy of that load, dropping the least recently used ones beyond the capacity."""
        self._copies[load_id] = parts
        self._copies.move_to_end(load_id)
        while len(self._copies) > self.capacity:
            self._copies.popitem(last=False)

    def held(self) -> list[int]:
        """The load ids held, least recently used first."""
        return list(self._copies)


def load_with_host_copies(model, cfg, model_dir: str):
    """`models/lora.load_adapters` (`cfg`: the configuration's adapters part), and the host cache at start:
    copies of the adapters given, the first --max-cpu-loras of them, under the router's load ids for them
    (their place in the list, 1-based). None are kept when no adapter can ever leave its slot (every one
    given has a device slot and none can be loaded while serving): they would only take memory. Returns
    (the rows object or None, the cache)."""
    rows, read = load_adapters(model, cfg, model_dir)
    cache = HostAdapters(cfg.max_cpu_loras)
    if cfg.allow_runtime_lora_updating or len(read) > cfg.max_loras:
        for load_id, parts in enumerate(read[:cfg.max_cpu_loras], start=1):
            cache.put(load_id, parts)
    return rows, cache
