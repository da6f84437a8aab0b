"""TGI-Gaudi's step profiler: PROF_WAITSTEP / PROF_WARMUPSTEP / PROF_STEP decode steps of a
`torch.profiler` trace, written as a Chrome trace under PROF_PATH by the ranks in PROF_RANKS.

Off (PROF_STEP=0, or a rank not listed) it is `None` and the runner pays nothing.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import torch

from gaudi_runtime.config import DeviceConfig

log = logging.getLogger(__name__)


def activities(device_activity: str | None) -> list:
    """What to record: the host, and the device's own work (`device_activity`, ``Backend.profiler_activity``:
    HPU on Gaudi where the installed torch knows it, CUDA kernels on NVIDIA, None on a CPU)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device_activity is not None and hasattr(torch.profiler.ProfilerActivity, device_activity):
        acts.append(getattr(torch.profiler.ProfilerActivity, device_activity))
    return acts


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trace_rank{rank}_{int(time.time() * 1000)}.json")


class StepProfiler:
    """A `torch.profiler.profile` advanced once per decode step; writes one trace, then stops."""

    def __init__(self, cfg: DeviceConfig, rank: int, device_activity: str | None):
        self.directory = cfg.prof_path
        self.rank = rank
        self.total = cfg.prof_waitstep + cfg.prof_warmupstep + cfg.prof_step
        self.steps = 0
        self.written: str | None = None
        os.makedirs(self.directory, exist_ok=True)
        with warnings.catch_warnings():  # PROF_WARMUPSTEP=0 is TGI-Gaudi's default, not worth a warning
            warnings.filterwarnings("ignore", message=".*won't be using warmup.*")
            schedule = torch.profiler.schedule(wait=cfg.prof_waitstep, warmup=cfg.prof_warmupstep,
                                               active=cfg.prof_step, repeat=1)
        self._prof = torch.profiler.profile(
            activities=activities(device_activity),
            schedule=schedule,
            on_trace_ready=self._write,
            record_shapes=cfg.prof_record_shapes,
        )
        self._prof.start()
        log.info("profiler on for rank %d: wait %d, warmup %d, record %d decode steps into %s", rank,
                 cfg.prof_waitstep, cfg.prof_warmupstep, cfg.prof_step, self.directory)

    def _write(self, prof) -> None:
        self.written = trace_path(self.directory, self.rank)
        prof.export_chrome_trace(self.written)
        log.info("profiler trace written to %s", self.written)

    @property
    def done(self) -> bool:
        return self.steps >= self.total

    def step(self) -> None:
        """After a decode step. The trace is written when the active steps end."""
        if self.done:
            return
        self.steps += 1
        self._prof.step()
        if self.done:
            self._prof.stop()


def make_profiler(cfg: DeviceConfig, rank: int, device_activity: str | None) -> StepProfiler | None:
    """The profiler this rank runs, or None when profiling is off for it (`device_activity`: see `activities`)."""
    if cfg.prof_step <= 0 or rank not in cfg.prof_ranks:
        return None
    return StepProfiler(cfg, rank, device_activity)
