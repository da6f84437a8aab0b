"""Fake habana_frameworks.torch: records what the runtime asks of the HPU bridge."""

RECORD = {"mark_step": 0, "captures": [], "replays": [], "wrapped": 0, "synchronize": 0, "recipe_compiles": 0,
          "recipe_hits": 0}


def reset() -> None:
    RECORD.update(mark_step=0, captures=[], replays=[], wrapped=0, synchronize=0, recipe_compiles=0, recipe_hits=0)
