"""The shards' Info answer (`pb.InfoResponse`, rank 0's) read into what /health and /info show."""

from __future__ import annotations

from gaudi_runtime.proto import generate_pb2 as pb


def warmup_from_cache(info: pb.InfoResponse) -> bool | None:
    """Whether warmup finds every bucket's compiled graph in the recipe cache (None: no recipe cache)."""
    return info.recipe_cache.from_cache if info.HasField("recipe_cache") else None


def startup_seconds(info: pb.InfoResponse) -> dict:
    s = info.startup_seconds
    return {"download": s.download if s.HasField("download") else None, "load": s.load,
            "warmup": s.warmup if s.HasField("warmup") else None}


def warmup_summary(info: pb.InfoResponse) -> dict | None:
    if not info.HasField("warmup"):
        return None
    w = info.warmup
    if not w.enabled:
        return {"enabled": False}
    graphs = {name: {"graphs": g.graphs, "captures": g.captures, "replays": g.replays}
              for name, g in w.graphs.items()}
    return {"enabled": True, **{f"{phase}_shapes": n for phase, n in w.shapes.items()}, "seconds": w.seconds,
            "graphs": graphs, "from_cache": w.from_cache if w.HasField("from_cache") else None}


def details(info: pb.InfoResponse) -> dict:
    """The /info fields that come from the shards beyond the model's shape."""
    cache = info.recipe_cache
    return {
        "warmup": warmup_summary(info),
        "weight_bytes_per_shard": info.weight_bytes,  # rank 0's; every rank holds about 1/N
        "quantization": info.quantization or None,
        "kv_cache_dtype": info.kv_cache_dtype,
        "attention": info.attention,
        "warmup_from_cache": warmup_from_cache(info),
        "recipe_cache": ({"dir": cache.dir, "key": cache.key, "from_cache": cache.from_cache}
                         if info.HasField("recipe_cache") else None),
        "startup_seconds": startup_seconds(info),
        "speculate": info.speculate,
    }
