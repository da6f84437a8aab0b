"""spec.kvCache.offload -> the runtime's settings, the disk tier's volume, the pod's resources, the status (pure).

The runtime keeps prefix-cache blocks evicted from the card in host memory (KV_OFFLOADING_SIZE, GiB; vLLM's
--kv-offloading-size) and, under that, in a directory (KV_OFFLOADING_DISK_PATH) bounded in bytes
(KV_OFFLOADING_DISK_SIZE, GiB). The operator passes them as environment variables, as it passes the batching
settings, so that spec.env can override them and the container's arguments stay those of the serving limits.

The host tier is memory the container holds for the pod's whole life: it is added to the container's memory
request (and to its limit when spec.resources sets one), so that the scheduler places the pod on a node that
has it and the kubelet never kills the pod for using what it was told to use. The disk tier is either an
emptyDir of the pod (its sizeLimit a little above the runtime's bound, for the file being written; counted in
the ephemeral-storage request) or a directory on the model cache volume, where a replaced pod finds the blocks
its predecessor wrote.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from .quantity import GIB, add, bytes_of, format_bytes, gib_text
from .spec import InferenceServiceSpec, KVOffload

__all__ = ["DISK_DIR", "DISK_VOLUME", "disk_volume", "kv_cache_status", "offload_env", "offload_resources"]

# Where the disk tier is mounted in the container, whichever volume holds it.
DISK_DIR = "/kv-cache"
DISK_VOLUME = "kv-offload"
# An emptyDir over its sizeLimit gets the pod evicted: room above the runtime's bound for the block file being
# written and the directory's own entries.
_HEADROOM_FRACTION = Decimal("0.05")
_HEADROOM_MIN = GIB


def offload_env(spec: InferenceServiceSpec) -> list[dict[str, str]]:
    """The runtime's KV_OFFLOADING_* settings for spec.kvCache.offload (none without it)."""
    offload = spec.offload
    if offload is None:
        return []
    env = [{"name": "KV_OFFLOADING_SIZE", "value": gib_text(bytes_of(offload.host_memory))}]
    if offload.disk is not None:
        env += [{"name": "KV_OFFLOADING_DISK_PATH", "value": DISK_DIR},
                {"name": "KV_OFFLOADING_DISK_SIZE", "value": gib_text(bytes_of(offload.disk.size))}]
    return env


def empty_dir_limit(offload: KVOffload) -> str:
    """The emptyDir's sizeLimit: the runtime's bound and some headroom, in whole MiB."""
    assert offload.disk is not None
    size = bytes_of(offload.disk.size)
    room = max(size * _HEADROOM_FRACTION, Decimal(_HEADROOM_MIN))
    mib = -(-(size + room) // 2**20)
    return format_bytes(mib * 2**20)


def disk_volume(spec: InferenceServiceSpec, cache_volume: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the disk tier: an emptyDir of its own, or a writable subPath of the model cache
    volume named `cache_volume` (its directory is made by the kubelet on first mount)."""
    offload = spec.offload
    if offload is None or offload.disk is None:
        return [], []
    if offload.disk.volume == "modelCache":
        return [], [{"name": cache_volume, "mountPath": DISK_DIR, "subPath": offload.disk.directory}]
    return ([{"name": DISK_VOLUME, "emptyDir": {"sizeLimit": empty_dir_limit(offload)}}],
            [{"name": DISK_VOLUME, "mountPath": DISK_DIR}])


def _grow(requests: dict[str, Any], limits: dict[str, Any], resource: str, extra: Decimal) -> None:
    """Add `extra` to a resource's request and, when one is set, its limit. A request left unset with a limit
    set is the limit (the API server's rule), so it grows from there."""
    base = requests.get(resource, limits.get(resource, 0))
    requests[resource] = add(base, extra)
    if resource in limits:
        limits[resource] = add(limits[resource], extra)


def offload_resources(spec: InferenceServiceSpec, requests: dict[str, Any], limits: dict[str, Any]) -> None:
    """Count the host tier in the memory request (and limit), an emptyDir disk tier in ephemeral-storage."""
    offload = spec.offload
    if offload is None:
        return
    _grow(requests, limits, "memory", bytes_of(offload.host_memory))
    if offload.disk is not None and offload.disk.volume == "emptyDir":
        _grow(requests, limits, "ephemeral-storage", bytes_of(empty_dir_limit(offload)))


def kv_cache_status(spec: InferenceServiceSpec, claim: str | None) -> dict[str, Any] | None:
    """status.kvCache: where the prefix cache's blocks live (`claim`: the model cache claim's name, if any)."""
    offload = spec.offload
    if offload is None:
        return None
    out: dict[str, Any] = {"tiers": ["device", "host"], "hostMemory": offload.host_memory}
    disk = offload.disk
    if disk is not None:
        out["tiers"].append("disk")
        out["disk"] = {"volume": disk.volume, "size": disk.size, "path": DISK_DIR}
        if disk.volume == "modelCache":
            out["disk"]["subPath"] = disk.directory
            if claim:
                out["disk"]["claim"] = claim
    return out
