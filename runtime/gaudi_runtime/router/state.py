"""What every handler needs, stored on the aiohttp app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from gaudi_runtime.config import Config
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.metrics import Metrics
from gaudi_runtime.router.reasoning import ThinkingTokens
from gaudi_runtime.router.tokenizer import RouterTokenizer
from gaudi_runtime.router.types import Engine


@dataclass
class AppState:
    config: Config
    engine: Engine
    tokenizer: RouterTokenizer
    metrics: Metrics
    started: float = field(default_factory=time.time)
    images: object | None = None  # router.images.ImagePrompter of a vision model, else None
    tracer: object | None = None  # router.tracing.RequestTracer with --otlp-endpoint, else None
    adapters: AdapterTable | None = None  # the LoRA adapters served now (the engine's; build_app sets it)
    thinking: ThinkingTokens | None = None  # the reasoning format, with --reasoning-parser (build_app sets it)
    adapter_updates: object | None = None  # router.adapter_updates.AdapterUpdates with runtime LoRA updating


STATE = web.AppKey("gaudi_serve_state", AppState)


def get_state(request: web.Request) -> AppState:
    return request.app[STATE]
