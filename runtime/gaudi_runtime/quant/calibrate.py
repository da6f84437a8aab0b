"""`gaudi-serve calibrate`: run prompts through the model in MEASURE mode and write INC-layout statistics.

    gaudi-serve calibrate --model-id DIR --dataset prompts.jsonl --quant-config measure.json --output hqt_output/

The dataset is JSON lines, each a string or an object with `inputs` (TGI),
`prompt` or `text`. The statistics go to `<output>/<name>_hooks_maxabs[_<rank>_<world>].json`
(`<name>`: the last part of the config's `dump_stats_path`, default `measure`),
next to `maxabs_measure.json` (the MEASURE config as run) and `maxabs_quant.json`:
a QUANTIZE config pointing at them, ready for `QUANT_CONFIG=`. On Gaudi the
measuring is INC's (`prepare` ... `finalize_calibration`); elsewhere our observer.
With `--num-shard N` every rank measures its own slice and writes its own file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

import torch

from gaudi_runtime.config import ConfigError
from gaudi_runtime.quant.config import QuantConfig, load_quant_config, parse_quant_config

log = logging.getLogger(__name__)


def read_prompts(path: str, limit: int | None = None) -> list[str]:
    """Prompts of a JSON-lines file; a bad line fails naming its number."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--dataset {path}: no such file")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--dataset {path}:{n}: not valid JSON: {e}") from None
        if isinstance(item, dict):
            item = next((item[k] for k in ("inputs", "prompt", "text") if k in item), None)
        if not isinstance(item, str) or not item:
            raise ConfigError(f"--dataset {path}:{n}: expected a string or an object with inputs/prompt/text")
        prompts.append(item)
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"--dataset {path}: no prompts")
    return prompts


def write_configs(qc: QuantConfig, output: Path) -> tuple[Path, Path, str]:
    """The MEASURE config as run and its QUANTIZE twin, both pointing at `output`; returns them and the prefix."""
    name = Path(qc.dump_stats_path or "measure").name or "measure"
    prefix = str((output / name).resolve())
    output.mkdir(parents=True, exist_ok=True)
    measure = {**qc.raw, "mode": "MEASURE", "dump_stats_path": prefix}
    quant = {**qc.raw, "mode": "QUANTIZE", "dump_stats_path": prefix}
    quant.setdefault("scale_method", "maxabs_hw")
    mpath, qpath = output / "maxabs_measure.json", output / "maxabs_quant.json"
    mpath.write_text(json.dumps(measure, indent=2) + "\n")
    qpath.write_text(json.dumps(quant, indent=2) + "\n")
    return mpath, qpath, prefix


@torch.inference_mode()
def run_prompts(model, token_ids: list[list[int]], device) -> None:
    from gaudi_runtime.layers.attention import AttentionMetadata

    for ids in token_ids:
        x = torch.tensor([ids], device=device)
        s = x.shape[1]
        meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(1, s, dtype=torch.long, device=device))
        hidden = model(x, torch.arange(s, device=device)[None], None, meta)
        model.compute_logits(hidden[0])  # every position, so the LM head sees a representative range


def measure(model, token_ids: list[list[int]], qc: QuantConfig, with_inc: bool, device, rank: int = 0,
            world_size: int = 1) -> Path | None:
    """MEASURE on one rank: INC where the device quantizes with it (`with_inc`: Gaudi; INC writes the files),
    our observer elsewhere; returns our file."""
    if with_inc:
        from gaudi_runtime.quant import inc

        model = inc.prepare_measure(model, qc, rank, world_size)
        run_prompts(model, token_ids, device)
        inc.finish_measure(model)
        return None
    from gaudi_runtime.quant.measure import Observer
    from gaudi_runtime.quant.stats import write_stats

    obs = Observer(model)
    try:
        run_prompts(model, token_ids, device)
    finally:
        obs.remove()
    return write_stats(qc.dump_stats_path, obs.nodes, rank, world_size)


def _rank_main(rank: int, a: argparse.Namespace, measure_path: str, token_ids: list[list[int]],
               rendezvous: dict[str, str] | None = None) -> None:
    from gaudi_runtime.device import select_device
    from gaudi_runtime.distributed import join_process_group, leave_process_group
    from gaudi_runtime.models import load_model

    world = a.num_shard
    if rendezvous:  # a spawned rank: its own environment, so the caller's is left as it was
        os.environ.update(rendezvous)
    backend = select_device(a.device, rank, world, graphs=False)
    if backend.computes_on_host and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = join_process_group(backend.distributed_backend, rank, world)
    try:
        model = load_model(a.model_id, getattr(torch, a.dtype), backend.torch_device, rank, world, group)
        path = measure(model, token_ids, load_quant_config(measure_path), backend.quantizes_with_inc,
                       backend.torch_device, rank, world)
    finally:
        leave_process_group(group)
    if path is not None:
        log.info("rank %d/%d: statistics written to %s", rank, world, path)
    if rendezvous:
        # A spawned rank whose work is written leaves without interpreter teardown: on CPU that
        # teardown aborted about one rank in four ("terminate called without an active exception",
        # from a thread torch leaves behind), which failed the whole run after the work was done.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(a: argparse.Namespace) -> Path:
    """Run MEASURE for every rank; return the QUANTIZE config written."""
    qc = load_quant_config(a.quant_config)
    if qc.mode != "MEASURE":
        raise ConfigError(f"--quant-config {a.quant_config}: mode is {qc.mode}; calibrate needs a MEASURE config")
    if a.dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {a.dtype!r}: choose bfloat16, float16 or float32")
    if a.num_shard < 1:
        raise ConfigError("--num-shard must be positive")
    if not (Path(a.model_id) / "config.json").is_file():
        raise ConfigError(f"--model-id {a.model_id}: no config.json there (calibrate needs a local model directory)")
    prompts = read_prompts(a.dataset, a.max_samples)
    output = Path(a.output) if a.output else Path(qc.dump_stats_path).parent
    mpath, qpath, _ = write_configs(qc, output)
    parse_quant_config(json.loads(qpath.read_text()), str(qpath))  # what we wrote must read back

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_id)
    token_ids = [tok(p).input_ids[: a.max_input_tokens] for p in prompts]
    if a.num_shard == 1:
        _rank_main(0, a, str(mpath), token_ids)
    else:
        import torch.multiprocessing as mp

        # A fresh port per run (never one left in the environment by an earlier run in this process).
        rendezvous = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": str(_free_port())}
        mp.start_processes(_rank_main, args=(a, str(mpath), token_ids, rendezvous), nprocs=a.num_shard,
                           start_method="spawn")
    log.info("calibrated on %d prompts; serve with QUANT_CONFIG=%s", len(prompts), qpath)
    return qpath


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gaudi-serve calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", required=True, help="local model directory")
    p.add_argument("--dataset", required=True, help="JSON lines of prompts")
    p.add_argument("--quant-config", required=True, help="INC FP8 JSON in MEASURE mode")
    p.add_argument("--output", default=None, help="directory for the statistics (default: dump_stats_path's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", choices=["auto", "hpu", "cuda", "cpu"])
    p.add_argument("--num-shard", type=int, default=1, help="tensor-parallel ranks, as the model will be served")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-input-tokens", type=int, default=1024, help="prompts are cut to this many tokens")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        qpath = calibrate(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(qpath)
    return 0
