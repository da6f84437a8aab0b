"""Each adapter a prefill's requests use, in a device slot of the shards before the prefill runs.

The batching loop takes requests only while the distinct adapters of the running and new requests fit
the --max-loras device slots (scheduler.select_prefill); here those not in a slot yet get one
(router/adapter_slots.py: no running request uses it, empty or least recently used first), and every
shard writes the adapter there (`ShardClient.load_adapter`, numbered like the batch calls, so the
write lands after the calls already made and before this prefill), from its host copy or its files
(shard/adapter_cache.py). A request a shard cannot write the adapter for (its files changed or went
away since it was checked) ends with the shard's reason; the others go on.
"""

from __future__ import annotations

import logging

from gaudi_runtime.router.adapter_slots import DeviceSlots
from gaudi_runtime.router.client import ShardClient, ShardError
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.live_requests import Requests, RequestState
from gaudi_runtime.router.types import GenerationError

log = logging.getLogger(__name__)


class AdapterPlacement:
    def __init__(self, max_loras: int, client: ShardClient, requests: Requests, metrics: EngineMetrics):
        self.client, self.requests, self.metrics = client, requests, metrics
        table = requests.adapters
        given = [entry.load_id for entry in table.entries[1:] if entry is not None]  # as at start, in order
        self.slots = DeviceSlots(max_loras, given)

    async def place(self, taken: list[RequestState]) -> list[RequestState]:
        """Give each of the `taken` requests (just taken for a prefill) its adapter's device slot, the
        shards writing those not there yet; the requests that go on (not ended meanwhile or refused)."""
        loads = {s.req.adapter_load: s.req.adapter for s in taken if s.req.adapter}
        if not loads:
            return taken
        plan = self.slots.plan(list(loads), self.requests.pinned_slots())
        if plan is None:  # the admission rule keeps this from happening: they wait for a slot
            log.error("adapters of %d requests do not fit the device slots now; they wait", len(taken))
            self.requests.requeue(taken)
            return []
        at, writes = plan
        refused = {}
        for slot, load in writes:
            reason = await self._write(slot, load, loads[load])
            if reason is not None:
                refused[load] = reason
        for state in taken:
            if state.req.adapter_load in refused:
                self.requests.end(state, GenerationError(refused[state.req.adapter_load]))
            elif state.req.adapter:
                state.device_slot = at[state.req.adapter_load]
        self.slots.used(sorted(set(at.values())))
        return [s for s in taken if not s.ended]

    async def _write(self, slot: int, load: int, index: int) -> str | None:
        """Every shard writes the adapter of that load into `slot`; None, or why a shard refused it."""
        entry = self.requests.adapters.entry(index)
        try:
            answer = await self.client.load_adapter(slot, entry.name, entry.path, load)
        except ShardError as e:
            cause = e.__cause__
            if cause is None or cause.code().name != "INVALID_ARGUMENT":
                raise
            self.slots.written(slot, 0)
            log.error("LoRA adapter %r could not be written into device slot %d: %s", entry.name, slot, cause.details())
            return f"the LoRA adapter {entry.name!r} could not be loaded: {cause.details()}"
        self.slots.written(slot, load)
        self.metrics.lora_slot_write(answer.host_hit)
        return None
