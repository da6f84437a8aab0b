"""Fake habana_frameworks.torch: records what the runtime asks of the HPU bridge."""

# `events`: mark_steps and graph runs in the order they happened, so a test can see what the host did
# between launching a step on the device and waiting for it (filling a grammar's token mask).
RECORD = {"mark_step": 0, "captures": [], "replays": [], "wrapped": 0, "synchronize": 0, "recipe_compiles": 0,
          "recipe_hits": 0, "events": []}


def reset() -> None:
    RECORD.update(mark_step=0, captures=[], replays=[], wrapped=0, synchronize=0, recipe_compiles=0, recipe_hits=0,
                  events=[])
