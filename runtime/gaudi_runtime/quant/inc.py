"""Gaudi: Intel Neural Compressor's FP8 flow, imported lazily (the package exists only where Gaudi software is).

The QUANT_CONFIG file is handed to INC as is (`FP8Config.from_json_file`).
MEASURE: `prepare` installs INC's observers, the caller runs the calibration
prompts, then `finalize_calibration` writes the statistics. QUANTIZE: `convert`
reads them and swaps the layers for INC's FP8 ones. INC names a rank's files
after `LOCAL_RANK`/`WORLD_SIZE` (`<dump_stats_path>_hooks_maxabs_<rank>_<world>`),
so a sharded run sets them for each shard before INC reads its configuration.
"""

from __future__ import annotations

import os

from torch import nn

from gaudi_runtime.quant.config import QuantConfig

# A bare `--quantize fp8` on Gaudi has no measurements: INC's unit scales are the setting that needs none.
NO_STATS_CONFIG = {"method": "HOOKS", "mode": "QUANTIZE", "observer": "maxabs", "scale_method": "unit_scale"}


def _fp8_config(qc: QuantConfig):
    from neural_compressor.torch.quantization import FP8Config

    if qc.source:
        return FP8Config.from_json_file(qc.source)
    return FP8Config(**(qc.raw or NO_STATS_CONFIG))


def _rank_env(rank: int, world_size: int) -> None:
    if world_size > 1:
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)


def prepare_measure(model: nn.Module, qc: QuantConfig, rank: int = 0, world_size: int = 1) -> nn.Module:
    from neural_compressor.torch.quantization import prepare

    _rank_env(rank, world_size)
    return prepare(model, _fp8_config(qc))


def finish_measure(model: nn.Module) -> None:
    from neural_compressor.torch.quantization import finalize_calibration

    finalize_calibration(model)


def convert_quantize(model: nn.Module, qc: QuantConfig, rank: int = 0, world_size: int = 1) -> nn.Module:
    from neural_compressor.torch.quantization import convert

    _rank_env(rank, world_size)
    return convert(model, _fp8_config(qc))
