"""`QUANT_CONFIG`: Intel Neural Compressor's FP8 JSON, read once and checked at start.

The same file drives INC on Gaudi and our own float8 path elsewhere:

    {"method": "HOOKS", "mode": "QUANTIZE", "observer": "maxabs", "scale_method": "maxabs_hw",
     "allowlist": {"types": [], "names": []}, "blocklist": {"types": [], "names": ["lm_head"]},
     "dump_stats_path": "./hqt_output/measure"}

MEASURE records statistics (`gaudi-serve calibrate`); QUANTIZE serves in FP8,
with static activation scales when `dump_stats_path` holds statistics.
Anything wrong fails here with a `ConfigError` that names the file and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from gaudi_runtime.config import ConfigError

MODES = ("MEASURE", "QUANTIZE")
FP8_FORMATS = ("E4M3",)


@dataclass(frozen=True)
class LayerFilter:
    """INC's allowlist/blocklist: layer type names and (substrings of) layer names."""

    types: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.types or self.names)


@dataclass(frozen=True)
class QuantConfig:
    mode: str = "QUANTIZE"
    method: str = "HOOKS"
    observer: str = "maxabs"
    scale_method: str = "maxabs_hw"
    fp8_format: str = "E4M3"
    allowlist: LayerFilter = field(default_factory=LayerFilter)
    blocklist: LayerFilter = field(default_factory=LayerFilter)
    dump_stats_path: str | None = None  # prefix of the measurement files (INC's name)
    source: str | None = None  # the JSON file it came from (INC reads it again on Gaudi)
    raw: dict = field(default_factory=dict)  # the JSON as given, for INC's FP8Config


def _filter(path: str, key: str, value) -> LayerFilter:
    if value is None:
        return LayerFilter()
    if not isinstance(value, dict) or set(value) - {"types", "names"}:
        raise ConfigError(f"QUANT_CONFIG {path}: {key} must be an object with 'types' and 'names' lists")
    parts = {}
    for k in ("types", "names"):
        items = value.get(k, [])
        if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
            raise ConfigError(f"QUANT_CONFIG {path}: {key}.{k} must be a list of non-empty strings")
        parts[k] = tuple(items)
    return LayerFilter(**parts)


def parse_quant_config(raw: object, path: str = "<dict>") -> QuantConfig:
    """The checked view of an INC FP8 JSON object (unknown INC keys are kept for INC, ignored by us)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"QUANT_CONFIG {path}: expected a JSON object, got {type(raw).__name__}")
    mode = str(raw.get("mode", "QUANTIZE")).upper()
    if mode not in MODES:
        raise ConfigError(f"QUANT_CONFIG {path}: mode {raw.get('mode')!r} is not one of {', '.join(MODES)}")
    method = str(raw.get("method", "HOOKS")).upper()
    if method != "HOOKS":
        raise ConfigError(f"QUANT_CONFIG {path}: method {raw.get('method')!r} is not supported (use HOOKS)")
    observer = str(raw.get("observer", "maxabs"))
    if observer != "maxabs":
        raise ConfigError(f"QUANT_CONFIG {path}: observer {observer!r} is not supported (use maxabs)")
    fmt = str(raw.get("fp8_config", "E4M3")).upper()
    if fmt not in FP8_FORMATS:
        raise ConfigError(f"QUANT_CONFIG {path}: fp8_config {raw.get('fp8_config')!r} is not supported (use E4M3)")
    dump = raw.get("dump_stats_path")
    if dump is not None and (not isinstance(dump, str) or not dump):
        raise ConfigError(f"QUANT_CONFIG {path}: dump_stats_path must be a non-empty string")
    if mode == "MEASURE" and not dump:
        raise ConfigError(f"QUANT_CONFIG {path}: MEASURE needs dump_stats_path (where statistics are written)")
    return QuantConfig(mode=mode, method=method, observer=observer,
                       scale_method=str(raw.get("scale_method", "maxabs_hw")), fp8_format=fmt,
                       allowlist=_filter(path, "allowlist", raw.get("allowlist")),
                       blocklist=_filter(path, "blocklist", raw.get("blocklist")),
                       dump_stats_path=_resolve_dump_path(dump) if dump else None,
                       source=None if path == "<dict>" else str(path), raw=dict(raw))


def _resolve_dump_path(dump: str) -> str:
    # INC joins a relative dump path to INC_MEASUREMENT_DUMP_PATH_PREFIX when set, else to the working dir.
    prefix = os.environ.get("INC_MEASUREMENT_DUMP_PATH_PREFIX")
    if prefix and not os.path.isabs(dump):
        dump = os.path.join(prefix, dump)
    return os.path.abspath(dump)


def load_quant_config(path: str) -> QuantConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"QUANT_CONFIG {path}: no such file")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"QUANT_CONFIG {path}: not valid JSON: {e}") from None
    return parse_quant_config(raw, str(p))


def check_stats_exist(qc: QuantConfig, world_size: int) -> None:
    """A QUANTIZE config that points at statistics must find one file per rank."""
    from gaudi_runtime.quant.stats import stats_file

    if qc.mode != "QUANTIZE" or not qc.dump_stats_path:
        return
    for rank in range(world_size):
        path = stats_file(qc.dump_stats_path, rank, world_size)
        if not path.is_file():
            raise ConfigError(
                f"QUANT_CONFIG {qc.source}: QUANTIZE reads statistics from {path}, which does not exist "
                f"(dump_stats_path {qc.dump_stats_path!r}, {world_size} shard(s)); run `gaudi-serve calibrate` "
                f"with a MEASURE config first")


def check_quant_config(cfg) -> QuantConfig | None:
    """What `launch` checks before starting any process: the file parses, is for serving, has its statistics."""
    if not cfg.model.quant_config:
        return None
    qc = load_quant_config(cfg.model.quant_config)
    if qc.mode == "MEASURE":
        raise ConfigError(f"QUANT_CONFIG {cfg.model.quant_config}: mode MEASURE is for `gaudi-serve calibrate`; "
                          "serve with a QUANTIZE config")
    check_stats_exist(qc, cfg.device.num_shard)
    return qc
