"""Warmup: every bucket's step run once before serving, so that no request waits for a graph compile.

The shapes come from `gaudi_runtime.buckets`, one list per phase (prefill, prefill with cached blocks,
decode); each step function runs on zeros of its bucket's shape (block 0, the padding block, takes the
writes). Progress is a generator of (done, total, phase) that the servicer streams to the router.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.device.base import Backend
from gaudi_runtime.recipe_cache import RecipeCache

log = logging.getLogger(__name__)

# The least time between two progress reports the servicer streams (a phase's first and last, and the
# end, always go): a tiny model on a CPU warms hundreds of shapes a second, faster than a router starved of
# CPU reads them, and the router then shows a warmup far behind the shard's.
REPORT_INTERVAL_S = 0.05


def spaced(progress: Iterator[tuple[int, int, str]], interval_s: float = REPORT_INTERVAL_S,
           clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[int, int, str]]:
    """The reports of `progress` worth streaming: a phase's first and last, the end, and any other
    `interval_s` after the last one sent."""
    sent_at, last, pending = float("-inf"), None, False
    for step in progress:
        new_phase = last is None or step[2] != last[2]
        if new_phase and pending:
            yield last  # the previous phase's last count
        now = clock()
        pending = not (new_phase or step[2] == "done" or now - sent_at >= interval_s)
        if not pending:
            sent_at = now
            yield step
        last = step
    if pending:
        yield last


class WarmupError(RuntimeError):
    """A bucket could not run; the message names the setting to lower."""


def shapes(cfg: Config, flat_decode: bool) -> dict[str, list[tuple[int, ...]]]:
    """The buckets of each phase, in the order warmup runs them (the plan the operator counts too)."""
    return dict(buckets.warmup_plan(cfg, flat_decode))


def largest_context_shape(shapes: list[tuple[int, int, int]], block_size: int) -> tuple[int, int, int] | None:
    """The prefill-with-cached-blocks shape whose attention is the largest (rows x new x all tokens)."""
    return max(shapes, key=lambda s: s[0] * s[1] * (s[1] + s[2] * block_size), default=None)


def zero_inputs(phase: str, shape: tuple[int, ...], flat_decode: bool, block_size: int,
                device: torch.device) -> tuple:
    """The step function's arguments for a bucket, all zeros (context lengths of 1 on the gathered decode):
    every token on block 0, row 0, unmasked, no adapter (the adapters' shapes do not depend on which)."""
    def zeros(*s: int) -> torch.Tensor:
        return torch.zeros(*s, dtype=torch.long, device=device)

    if phase == "prefill":
        rows, seq = shape
        return zeros(rows, seq), zeros(rows, seq), zeros(rows, seq), zeros(rows), zeros(rows)
    if phase == "prefill_context":
        rows, seq, blocks = shape
        return (zeros(rows, seq), zeros(rows, seq), zeros(rows, seq), zeros(rows), zeros(rows, blocks), zeros(rows),
                zeros(rows))
    if phase == "verify":
        rows, width, blocks = shape
        return zeros(rows, width), zeros(rows, width), zeros(rows, width), zeros(rows, blocks), zeros(rows), zeros(rows)
    rows, n = shape
    if flat_decode:  # n: blocks in all
        return (zeros(rows), zeros(rows), zeros(rows), zeros(n), zeros(n), torch.zeros(n, block_size, device=device),
                zeros(rows))
    return (zeros(rows), zeros(rows), zeros(rows), zeros(rows, n), torch.ones(rows, dtype=torch.long, device=device),
            zeros(rows))


def describe(phase: str, shape: tuple[int, ...], flat_decode: bool) -> tuple[str, str]:
    """(the bucket in words, the setting that makes it smaller) for an out-of-memory message."""
    if phase == "prefill":
        return f"prefill bucket (batch {shape[0]}, sequence {shape[1]})", "--max-batch-prefill-tokens"
    if phase == "prefill_context":
        return (f"prefill bucket (batch {shape[0]}, sequence {shape[1]}, {shape[2]} cached blocks)",
                "--max-batch-prefill-tokens or --max-input-tokens (or --prefix-caching false)")
    if phase == "verify":
        return (f"speculative step (batch {shape[0]}, {shape[1]} tokens each, {shape[2]} cached blocks)",
                "--speculate or --max-total-tokens")
    blocks = f"{shape[1]} blocks in all" if flat_decode else f"{shape[1]} blocks"
    return f"decode bucket (batch {shape[0]}, {blocks})", "--max-batch-size or --max-total-tokens"


def run_step(what: str, setting: str, backend: Backend, fn: Callable, args: tuple) -> None:
    """Run one bucket's step; running out of memory becomes a WarmupError naming the setting to lower."""
    try:
        fn(*args)
        backend.mark_step()
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise WarmupError(f"out of memory warming up the {what}: lower {setting} "
                          f"(or --max-batch-total-tokens / --memory-fraction): {e}") from e
    except RuntimeError as e:
        if "out of memory" in str(e).lower():
            raise WarmupError(f"out of memory warming up the {what}: lower {setting}: {e}") from e
        raise


class Warmup:
    """One warmup of a runner's step functions (`steps`: phase -> function). After it, `warmed` holds
    (phase, *shape) of every shape it ran and `summary` what /info reports; both are set before the
    final progress, (total, total, "done")."""

    def __init__(self, cfg: Config, backend: Backend, steps: dict[str, Callable], flat_decode: bool,
                 recipe_cache: RecipeCache | None = None):
        self.cfg, self.backend, self.steps, self.flat_decode = cfg, backend, steps, flat_decode
        self.recipe_cache = recipe_cache
        self.warmed: set[tuple] | None = None
        self.summary: dict | None = None

    def progress(self) -> Iterator[tuple[int, int, str]]:
        if not self.cfg.device.warmup_enabled:
            log.warning("WARMUP_ENABLED=false: no shape is compiled ahead; the first requests will be slow")
            self.summary = {"enabled": False}
            yield 0, 0, "done"
            return
        phases = shapes(self.cfg, self.flat_decode)
        total = sum(len(s) for s in phases.values())
        warmed: set[tuple] = set()
        t0 = time.perf_counter()
        log.info("warmup: %s shapes", ", ".join(f"{len(s)} {phase}" for phase, s in phases.items()))
        for phase, phase_shapes in phases.items():
            started = time.perf_counter()
            for shape in self._run_phase(phase, phase_shapes):
                warmed.add((phase, *shape))
                yield len(warmed), total, phase
            log.info("warmup: %s done in %.1fs", phase, time.perf_counter() - started)
        self.backend.synchronize()
        seconds = time.perf_counter() - t0
        log.info("warmup: %d shapes in %.1fs", total, seconds)
        self.warmed = warmed
        self.summary = {"enabled": True, **{f"{phase}_shapes": len(s) for phase, s in phases.items()},
                        "seconds": round(seconds, 3), "graphs": self.backend.graph_stats(),
                        "from_cache": self.recipe_cache.from_cache if self.recipe_cache is not None else None}
        if self.recipe_cache is not None:
            self.recipe_cache.mark_warm()  # every bucket's recipe is now on the volume for the next start
        yield total, total, "done"

    def _run_phase(self, phase: str, phase_shapes: list[tuple[int, ...]]) -> Iterator[tuple[int, ...]]:
        """Run each shape's step, yielding the shape once it counts as warmed. Without padding (CPU, CUDA
        without graphs) nothing is compiled per shape: of the many prefill shapes with cached blocks, only
        the one with the largest attention runs (as for speculative steps, also over cached blocks), to meet
        running out of memory at start rather than under traffic; the others count as warmed."""
        over_context = phase in ("prefill_context", "verify")
        largest = largest_context_shape(phase_shapes, self.cfg.device.block_size) if over_context else None
        for shape in phase_shapes:
            if self.backend.pads_to_buckets or not over_context or shape == largest:
                what, setting = describe(phase, shape, self.flat_decode)
                args = zero_inputs(phase, shape, self.flat_decode, self.cfg.device.block_size, self.backend.torch_device)
                run_step(what, setting, self.backend, self.steps[phase], args)
            yield shape
