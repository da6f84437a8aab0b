"""Joining and leaving torch.distributed, for the shards and for calibration ranks.

Kept apart from the shard's gRPC server so that a process that only computes (a calibration
rank) loads neither gRPC nor the server.
"""

from __future__ import annotations

import os
from datetime import timedelta

JOIN_TIMEOUT_S = float(os.environ.get("GAUDI_SERVE_JOIN_TIMEOUT_S", "120"))


def join_process_group(backend: str, rank: int, world_size: int):
    """Joins torch.distributed; a rank that cannot join fails with a clear message instead of hanging."""
    if world_size == 1:
        return None
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - any failure to join is fatal, with context
        # c10d appends a C++ stack trace to its messages: the first line is the one that says why.
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(
            f"shard {rank}/{world_size}: could not join the {backend} process group at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {JOIN_TIMEOUT_S:.0f}s "
            f"(GAUDI_SERVE_JOIN_TIMEOUT_S): {why}"
        ) from e
    return dist.group.WORLD


def leave_process_group(group) -> None:
    """Leave torch.distributed before the process exits: a process group left for interpreter
    shutdown to tear down may abort the process ("terminate called without an active exception")."""
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
