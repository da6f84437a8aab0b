"""Process entry of one shard: join the process group, load the model, serve gRPC on a unix socket."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
import torch

from gaudi_runtime import progress, recipe_cache
from gaudi_runtime.config import Config
from gaudi_runtime.device import select_device
from gaudi_runtime.device.cpu_threads import adaptive_threads
from gaudi_runtime.distributed import join_process_group, leave_process_group
from gaudi_runtime.download import DOWNLOAD_SECONDS_ENV
from gaudi_runtime.proto import generate_pb2_grpc as pb_grpc
from gaudi_runtime.recipe_cache import RecipeCache
from gaudi_runtime.shard.runner import ModelRunner
from gaudi_runtime.shard.servicer import ShardServicer

log = logging.getLogger(__name__)


def cpu_threads(world_size: int, environ=None) -> int | None:
    """Intra-op threads for one of `world_size` shards sharing this machine's cores (None: leave torch's).

    The shards of one pod run on the same CPUs; each taking every core oversubscribes them (collectives
    then wait on descheduled peers). The router gets no core of its own: on a quiet machine the forward
    passes gain more from every core than the router's streams lose (docs/performance.md, "Threads").
    While other processes (the router's streams among them) need a share of the cores, the shard runs
    one thread fewer (`device/cpu_threads.py`). OMP_NUM_THREADS, when set, is the operator's choice and
    wins, and then stays.
    """
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, len(allowed_cpus()) // max(1, world_size))


def allowed_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


def plan_recipe_cache(cfg: Config, model_dir: str, rank: int) -> RecipeCache | None:
    """This shard's recipe cache when --recipe-cache-dir is set and the device may be Gaudi."""
    if not cfg.device.recipe_cache_dir or not cfg.device.may_be_gaudi:
        return None
    from gaudi_runtime.device import hpu

    if not hpu.installed():
        return None
    cache = recipe_cache.plan(cfg, model_dir, rank, hpu.software_versions())
    try:
        cache.prepare()
    except OSError as e:
        log.warning("shard %d: recipe cache %s unusable (%s); compiling without it", rank, cache.directory, e)
        return None
    log.info("shard %d: recipe cache %s (%s)", rank, cache.directory,
             "warm from a previous start" if cache.from_cache else "empty: this start compiles every graph")
    return cache


def download_seconds(environ=None) -> float | None:
    """How long the launcher spent getting the model (None: a local directory, or not started by it)."""
    raw = (os.environ if environ is None else environ).get(DOWNLOAD_SECONDS_ENV)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


# A call gRPC has received but not yet handed to the servicer waits at most this long before gRPC
# cancels it (CANCELLED, the servicer never sees it); its default is 30 s.
UNHANDLED_CALL_WAIT_S = 7 * 24 * 3600


def grpc_server(unhandled_call_wait_s: int = UNHANDLED_CALL_WAIT_S) -> grpc.aio.Server:
    """The shard's gRPC server. Steps run on its event loop, which then hands no new call to the servicer:
    the router's next call (queued while a step runs, router/batching.py) waits as long as the step takes,
    a minute or more for a first step or a prefill of many prompts on a loaded machine. So gRPC must keep
    such a call, not cancel it after its default 30 s; the router's call timeout
    (GAUDI_SERVE_SHARD_TIMEOUT_S) is what decides that a shard hangs."""
    return grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                    ("grpc.max_send_message_length", 64 << 20),
                                    ("grpc.server_max_unrequested_time_in_server", unhandled_call_wait_s)])


# At shutdown, how long the KV disk tier may take to write the blocks still queued: within the
# launcher's wait for a stopping shard (launcher.STOP_GRACE_S) after gRPC's one second of grace.
DISK_FLUSH_S = 8.0


async def serve(cfg: Config, model_dir: str, rank: int, world_size: int) -> None:
    # Each step of the load is a step of the pod's start (progress.py); the weights report one per tensor.
    progress.start_reporting(f"shard-{rank}")
    progress.report("loading")
    recipes = plan_recipe_cache(cfg, model_dir, rank)
    backend = select_device(cfg.device.device, rank, world_size, graphs=cfg.device.enable_hpu_graph,
                            recipe_cache=recipes)
    if not backend.caches_compiled_graphs:
        recipes = None
    threads = cpu_threads(world_size) if backend.computes_on_host else None
    adaptive = None
    if threads is not None:
        torch.set_num_threads(threads)
        log.info("shard %d/%d: %d torch threads", rank, world_size, threads)
        adaptive = adaptive_threads(threads, world_size, allowed_cpus(), torch.set_num_threads)
    group = join_process_group(backend.distributed_backend, rank, world_size)
    progress.report("loading")
    runner = ModelRunner(cfg, model_dir, backend, rank, world_size, group, recipe_cache=recipes,
                         download_seconds=download_seconds())
    server = grpc_server()
    servicer = ShardServicer(runner, rank, world_size, threads=adaptive)
    pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    path = cfg.server.shard_socket(rank)
    if os.path.exists(path):
        os.unlink(path)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    progress.report("loading")
    log.info("shard %d/%d serving on %s", rank, world_size, path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    servicer.close(DISK_FLUSH_S)
    leave_process_group(group)


def main(cfg: Config, model_dir: str, rank: int, world_size: int) -> None:
    torch.set_grad_enabled(False)
    asyncio.run(serve(cfg, model_dir, rank, world_size))
