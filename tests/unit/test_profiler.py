"""TGI-Gaudi's PROF_* profiler: the chosen ranks write a Chrome trace of the chosen decode steps."""

from __future__ import annotations

import json

import torch

from gaudi_runtime.config import resolve
from gaudi_runtime.shard.profiler import activities, make_profiler


def cfg(tmp_path, **env):
    return resolve(None, {"MODEL_ID": "/m", "PROF_PATH": str(tmp_path / "prof"), **{k: str(v) for k, v in env.items()}}).device


def test_off_by_default_and_for_ranks_not_listed(tmp_path):
    assert make_profiler(cfg(tmp_path), rank=0, device_activity=None) is None
    assert make_profiler(cfg(tmp_path, PROF_STEP=2, PROF_RANKS="1,2"), rank=0, device_activity=None) is None
    assert make_profiler(cfg(tmp_path, PROF_STEP=2, PROF_RANKS="1,2"), rank=2, device_activity=None) is not None


def test_records_the_active_steps_into_a_chrome_trace(tmp_path):
    prof = make_profiler(cfg(tmp_path, PROF_WAITSTEP=1, PROF_WARMUPSTEP=1, PROF_STEP=2, PROF_RECORD_SHAPES=1),
                         rank=0, device_activity=None)
    x = torch.randn(16, 16)
    for step in range(6):  # more steps than wait + warmup + active: the profiler stops by itself
        with torch.profiler.record_function(f"decode_step_{step}"):
            x = torch.tanh(x @ x)
        prof.step()
        assert (prof.written is None) == (step < 3), step
    assert prof.done
    written = list((tmp_path / "prof").iterdir())
    assert [p.name for p in written] == [prof.written.split("/")[-1]]
    assert written[0].name.startswith("trace_rank0_")
    trace = json.loads(written[0].read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # Only the active steps (after 1 wait + 1 warmup step) are in the trace, with the ops they ran.
    assert {"decode_step_2", "decode_step_3"} <= names
    assert not names & {"decode_step_0", "decode_step_1", "decode_step_4"}
    assert "aten::mm" in names
    shaped = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert any("Input Dims" in e.get("args", {}) for e in shaped)  # PROF_RECORD_SHAPES


def test_device_activities():
    from gaudi_runtime.device.cpu import CpuBackend
    from gaudi_runtime.device.cuda import CudaBackend
    from gaudi_runtime.device.hpu import HpuBackend

    kinds = torch.profiler.ProfilerActivity
    assert activities(CpuBackend.profiler_activity) == [kinds.CPU]
    assert activities(CudaBackend.profiler_activity) == [kinds.CPU, kinds.CUDA]
    assert activities(HpuBackend.profiler_activity)[0] == kinds.CPU  # plus HPU where the installed torch knows it
