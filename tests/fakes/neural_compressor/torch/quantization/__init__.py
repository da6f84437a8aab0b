"""`neural_compressor.torch.quantization`'s FP8 flow, recorded: FP8Config, prepare, convert, finalize_calibration.

Like INC, the statistics files of a rank are named after LOCAL_RANK and
WORLD_SIZE when more than one rank runs; `finalize_calibration` writes them
(in INC's JSON layout) and `convert` in QUANTIZE mode refuses to run without them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RECORD: list[tuple] = []


def reset() -> None:
    RECORD.clear()


def _rank_suffix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"_{int(os.environ.get('LOCAL_RANK', '0'))}_{world}" if world > 1 else ""


def stats_path(dump_stats_path: str) -> str:
    return f"{dump_stats_path}_hooks_maxabs{_rank_suffix()}.json"


class FP8Config:
    def __init__(self, **kwargs):
        self.cfg = dict(kwargs)
        RECORD.append(("FP8Config", dict(kwargs)))

    @classmethod
    def from_json_file(cls, path: str) -> FP8Config:
        RECORD.append(("from_json_file", str(path)))
        return cls(**json.loads(Path(path).read_text()))

    @property
    def mode(self) -> str:
        return self.cfg.get("mode", "AUTO")


def prepare(model, config: FP8Config):
    if config.mode != "MEASURE":
        raise ValueError(f"prepare is for MEASURE, got {config.mode}")
    model._inc_config = config
    model._inc_calls = 0
    model._inc_hook = model.register_forward_hook(lambda m, a, o: setattr(m, "_inc_calls", m._inc_calls + 1))
    RECORD.append(("prepare", config.mode, stats_path(config.cfg["dump_stats_path"])))
    return model


def finalize_calibration(model) -> None:
    config = model._inc_config
    path = stats_path(config.cfg["dump_stats_path"])
    model._inc_hook.remove()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["LOCAL_RANK"]) if _rank_suffix() else None
    Path(path).write_text(json.dumps({"GlobalRank": rank, "LocalRank": rank, "Mode": "DynamicRange",
                                      "Nodes": {"lm_head": {"inputs": [[[1.0]]], "outputs": [[1.0]],
                                                            "params": {"weight": [[1.0]]}}}}))
    RECORD.append(("finalize_calibration", path, model._inc_calls))


def convert(model, config: FP8Config):
    if config.mode != "QUANTIZE":
        raise ValueError(f"convert is for QUANTIZE, got {config.mode}")
    path = None
    if config.cfg.get("dump_stats_path"):
        path = stats_path(config.cfg["dump_stats_path"])
        if not Path(path).is_file():
            raise FileNotFoundError(f"Failed to load file {path}")
    model._inc_converted = True
    RECORD.append(("convert", config.mode, path))
    return model
