"""Process entry of the router: HTTP first (so /health answers during warmup), then the shards.

SIGTERM or SIGINT starts a graceful shutdown (router/drain.py): running requests get up to
--shutdown-grace-seconds to finish; a second signal ends them at once (with an error each).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from pathlib import Path

from aiohttp import web

from gaudi_runtime import progress
from gaudi_runtime.config import Config, ServedModelConfig, ServerConfig, StructuredOutputConfig
from gaudi_runtime.router.adapter_updates import AdapterUpdates
from gaudi_runtime.router.client import ShardClient
from gaudi_runtime.router.drain import DRAIN, shut_down
from gaudi_runtime.router.engine import BatchingEngine
from gaudi_runtime.router.images import ImagePrompter
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.prefix_cache import longrope_original_length
from gaudi_runtime.router.server import build_app
from gaudi_runtime.router.state import STATE
from gaudi_runtime.router.tokenizer import RouterTokenizer, keep_torch_out
from gaudi_runtime.router.tool_calls import PROMPTED_FORMAT, detect_format, renders_tools
from gaudi_runtime.router.tracing import make_tracer
from gaudi_runtime.start_http import LISTEN_FD_ENV

log = logging.getLogger(__name__)

FAIL_EXIT_DELAY_S = float(os.environ.get("GAUDI_SERVE_FAIL_EXIT_DELAY_S", "2"))


def _site(runner: web.AppRunner, server: ServerConfig) -> web.BaseSite:
    """The launcher's listening socket when it passed one (probes queued on it meanwhile are answered
    now), else the configured address."""
    fd = os.environ.get(LISTEN_FD_ENV)
    if fd:
        return web.SockSite(runner, socket.socket(fileno=int(fd)))
    return web.TCPSite(runner, server.hostname, server.port)


def load_tokenizer(model: ServedModelConfig, model_dir: str) -> RouterTokenizer:
    """The router's tokenizer, loaded in a process that keeps torch out (the router runs no model)."""
    keep_torch_out()
    return RouterTokenizer.load(model_dir, model)


async def serve(cfg: Config, model_dir: str) -> int:
    progress.start_reporting("router")
    progress.report("loading")
    tokenizer = load_tokenizer(cfg.model, model_dir)
    client = ShardClient([cfg.server.shard_socket(r) for r in range(cfg.device.num_shard)])
    metrics = Metrics(cfg.model.model_name)
    engine = BatchingEngine(cfg, client, tokenizer, metrics)
    engine.requests.prefix.long_rope_from = longrope_original_length(
        json.loads((Path(model_dir) / "config.json").read_text()), cfg.model.rope_scaling)
    app = build_app(cfg, engine, tokenizer, metrics=metrics, images=ImagePrompter.load(model_dir, cfg.limits))
    app[STATE].tracer = tracer = make_tracer(cfg.server)
    if cfg.adapters.allow_runtime_lora_updating:
        app[STATE].adapter_updates = AdapterUpdates(cfg.model, cfg.adapters, model_dir, engine.adapters,
                                                    engine.requests)
    log_tool_format(cfg.structured_output, tokenizer)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await _site(runner, cfg.server).start()
    log.info("router listening on http://%s:%d", cfg.server.hostname, cfg.server.port)

    stop, hurry = _signals()
    code = 0
    try:
        starting = asyncio.create_task(engine.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and starting.exception() is not None:
            log.error("could not start: %s", starting.exception())
            return 1
        failed = asyncio.create_task(engine.failed.wait())
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done() and not stop.is_set():
            # A shard died or hung: /health answers 503 for a moment (in-flight requests get their
            # error responses), then the router exits non-zero so the launcher stops every process.
            log.error("engine failed (%s); exiting in %.1fs", engine.failure, FAIL_EXIT_DELAY_S)
            await asyncio.wait({stopped}, timeout=FAIL_EXIT_DELAY_S)
            code = 1
        failed.cancel()
    finally:
        if stop.is_set() and code == 0:
            await shut_down(app[DRAIN], engine, cfg.server.shutdown_grace_seconds, hurry)
        await engine.stop()
        await runner.cleanup()
        if tracer is not None:
            tracer.shutdown()
        _ignore_late_signals()
    return code


def log_tool_format(structured: StructuredOutputConfig, tokenizer: RouterTokenizer) -> None:
    template = tokenizer.chat_template
    fmt = detect_format(template, structured.tool_call_parser)
    if not renders_tools(template):
        log.info("tool calls: the chat template does not render tools; they are given in a prompt appended "
                 "to the last message, calls in %s format", fmt or PROMPTED_FORMAT)
    elif fmt is not None:
        log.info("tool calls: %s format", fmt)
    else:
        log.warning("tool calls: the chat template renders tools in a format this server does not parse; "
                    "requests with tools get a 422 unless --tool-call-parser names the format")


def _signals() -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, hurry): the first SIGTERM/SIGINT sets stop (drain), a second one sets hurry (end now)."""
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop, hurry


def _ignore_late_signals() -> None:
    # Closing the loop would reset its handlers to the default, and a signal arriving during exit
    # (the launcher passing one on) would turn a clean exit into a death by SIGTERM.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


def main(cfg: Config, model_dir: str) -> int:
    return asyncio.run(serve(cfg, model_dir))
