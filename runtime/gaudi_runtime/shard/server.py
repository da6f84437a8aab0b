"""Process entry of one shard: join the process group, load the model, serve gRPC on a unix socket."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from datetime import timedelta

import grpc
import torch

from gaudi_runtime.config import Config
from gaudi_runtime.device import select_device
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.shard.servicer import ShardServicer

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = float(os.environ.get("GAUDI_SERVE_JOIN_TIMEOUT_S", "120"))


def uds_path(cfg: Config, rank: int) -> str:
    return f"{cfg.shard_uds_path}-{rank}"


def join_process_group(backend: str, rank: int, world_size: int):
    """Joins torch.distributed; a rank that cannot join fails with a clear message instead of hanging."""
    if world_size == 1:
        return None
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - any failure to join is fatal, with context
        raise SystemExit(
            f"shard {rank}/{world_size}: could not join the {backend} process group at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {JOIN_TIMEOUT_S:.0f}s: {e}"
        ) from e
    return dist.group.WORLD


async def serve(cfg: Config, model_dir: str, rank: int, world_size: int) -> None:
    backend = select_device(cfg.device, rank, world_size, graphs=cfg.enable_hpu_graph)
    group = join_process_group(backend.distributed_backend, rank, world_size)
    runner = ModelRunner(cfg, model_dir, backend, rank, world_size, group)
    urls = [f"unix://{uds_path(cfg, r)}" for r in range(world_size)]
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_TextGenerationServiceServicer_to_server(ShardServicer(runner, rank, world_size, urls), server)
    path = uds_path(cfg, rank)
    if os.path.exists(path):
        os.unlink(path)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    log.info("shard %d/%d serving on %s", rank, world_size, path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main(cfg: Config, model_dir: str, rank: int, world_size: int) -> None:
    torch.set_grad_enabled(False)
    asyncio.run(serve(cfg, model_dir, rank, world_size))
