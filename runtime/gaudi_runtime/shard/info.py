"""What a shard tells the router about itself (the Info call), as the typed protocol message."""

from __future__ import annotations

from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.shard.warmup import shapes


def warmup_summary(summary: dict | None) -> pb.WarmupSummary | None:
    """The warmup's summary (`shard.warmup.Warmup.summary`), None until warmup is over."""
    if summary is None:
        return None
    msg = pb.WarmupSummary(enabled=summary["enabled"], seconds=summary.get("seconds", 0.0),
                           from_cache=summary.get("from_cache"))
    for key, count in summary.items():
        if key.endswith("_shapes"):
            msg.shapes[key.removesuffix("_shapes")] = count
    for name, stats in (summary.get("graphs") or {}).items():
        msg.graphs[name].CopyFrom(pb.GraphStats(**stats))
    return msg


def startup_seconds(runner: ModelRunner) -> pb.StartupSeconds:
    warmup = (runner.warmup_summary or {}).get("seconds")
    return pb.StartupSeconds(download=None if runner.download_seconds is None else round(runner.download_seconds, 3),
                             load=round(runner.load_seconds, 3), warmup=warmup)


def kv_tiers_info(tiers) -> pb.KvTiers | None:
    if tiers is None:
        return None
    return pb.KvTiers(block_bytes=tiers.block_bytes, host_slots=tiers.host_slots, disk_dir=tiers.disk_dir or "")


def info_response(runner: ModelRunner, world_size: int, tiers=None) -> pb.InfoResponse:
    cfg, m, cache = runner.cfg, runner.model, runner.recipe_cache
    return pb.InfoResponse(
        dtype=cfg.model.dtype, device_type=runner.device.type, block_size=cfg.device.block_size,
        num_blocks=runner.num_blocks - 1,  # block 0 is the padding block
        vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids,
        max_position_embeddings=m.max_position_embeddings, world_size=world_size,
        architecture=type(m).__name__, quantization=getattr(m, "quantization", None) or cfg.model.quantize or "",
        kv_cache_dtype=cfg.model.kv_cache_dtype or cfg.model.dtype, prefix_caching=cfg.scheduling.prefix_caching,
        attention=runner.attention_name,
        recipe_cache=None if cache is None else pb.RecipeCacheInfo(dir=str(cache.directory), key=cache.key,
                                                                   from_cache=bool(cache.from_cache)),
        startup_seconds=startup_seconds(runner), weight_bytes=runner.weight_bytes,
        warmup=warmup_summary(runner.warmup_summary), unwarmed_shapes=runner.unwarmed_shapes,
        buckets={phase: len(s) for phase, s in shapes(cfg, runner.flat_decode).items()},
        exponential_bucketing=cfg.device.exponential_bucketing, speculate=cfg.scheduling.speculate,
        kv_tiers=kv_tiers_info(tiers),
    )
