"""Which adapter each device slot of the shards holds: the router's view of the stacked LoRA weights.

The shards hold --max-loras device slots (besides slot 0, no adapter), fixed at start so that shapes
never change; more adapters may be registered (router/adapters.py). A request runs with its adapter in
a device slot: the batching loop takes a request only while the distinct adapters of the running and
new requests fit the slots (scheduler.select_prefill), then `plan` keeps each adapter where it is and
puts the others into slots no running request uses, empty ones first, then the least recently used;
the shards write those (`LoadAdapter`) before the prefill naming them. Slots hold loads (`Served.load_id`,
unique per load), so a reloaded adapter is written again.
"""

from __future__ import annotations

import itertools


def choose_slots(held: list[int], last_used: list[int], wanted: list[int], pinned: set[int]) -> dict[int, int] | None:
    """A device slot for each of the distinct loads `wanted`: the slot holding it already, else one outside
    `pinned` (those running requests use) and not kept for another wanted load, empty slots first, then
    the least recently used. `held[s]`: the load in slot s (0: none; slot 0 is the base model's);
    `last_used[s]`: when slot s was last given to a request. None when the loads do not fit."""
    placed = {load: held.index(load) for load in wanted if load in held[1:]}
    kept = set(placed.values()) | pinned
    free = sorted((s for s in range(1, len(held)) if s not in kept), key=lambda s: (held[s] != 0, last_used[s]))
    missing = [load for load in wanted if load not in placed]
    if len(missing) > len(free):
        return None
    placed.update(zip(missing, free))
    return placed


class DeviceSlots:
    """The load each device slot holds and when it was last given to a request."""

    def __init__(self, count: int, start: list[int]):
        """`count` slots besides slot 0; `start`: the loads of the adapters given at start, the i-th in slot i
        up to `count` (the shards write them there at start)."""
        self.held = [0] + [start[i] if i < len(start) else 0 for i in range(count)]
        self.last_used = [0] * (count + 1)
        self._clock = itertools.count(1)

    def plan(self, wanted: list[int], pinned: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]] | None:
        """Each wanted load's slot, and the (slot, load) writes that puts the missing ones there; None when
        they do not fit (the admission rule keeps that from happening)."""
        at = choose_slots(self.held, self.last_used, wanted, pinned)
        if at is None:
            return None
        return at, [(slot, load) for load, slot in at.items() if self.held[slot] != load]

    def written(self, slot: int, load: int) -> None:
        """Every shard wrote `load` into `slot` (0: the write failed, the slot holds nothing usable)."""
        self.held[slot] = load

    def used(self, slots: list[int]) -> None:
        """Requests were just given these slots: they are now the most recently used."""
        for slot in slots:
            self.last_used[slot] = next(self._clock)
