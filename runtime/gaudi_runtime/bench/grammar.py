"""What a grammar costs on a shard: compiling a JSON schema (the first time, then asked again under
its id), what a prefill row carries of it (its id, against the schema's text that only CompileGrammar
carries), filling the token masks of a batch for one step, and a whole decode step of a batch whose every
request has the schema against one with none.

    python -m gaudi_runtime.bench.grammar --model-dir DIR [--properties 20] [--batch 16] [--device cpu] [--threads N]

Runs the shard's own code (`shard/grammar.py`, `ModelRunner`) in process. The decode steps of the two
batches alternate, round after round, so that a machine whose load drifts slows both alike.
"""

from __future__ import annotations

import argparse
import json
import time


def measure(model_dir: str, properties: int, batch: int, steps: int = 50) -> dict:
    from transformers import AutoConfig

    from gaudi_runtime.bench.online import string_properties_schema
    from gaudi_runtime.proto import generate_pb2 as pb
    from gaudi_runtime.shard.grammar import GrammarCache, GrammarRows

    config = AutoConfig.from_pretrained(model_dir)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    cache = GrammarCache(model_dir, config.vocab_size, eos)
    cache.prepare()  # the engine and the vocabulary are loaded once per shard, at warmup: not a compile
    schema = json.dumps(string_properties_schema(properties))
    t0 = time.perf_counter()
    cache.compile(1, "json", schema)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.compile(1, "json", schema)
    cached = time.perf_counter() - t0
    rows = GrammarRows(cache, [cache.matcher(1) for _ in range(batch)])
    prefix = '{"field_0": "'  # fill inside a string, the common state of a long output
    for m in rows.matchers:
        m.accept_string(prefix)
    t0 = time.perf_counter()
    for _ in range(steps):
        rows.fill(batch)
    fill = (time.perf_counter() - t0) / steps
    return {"properties": properties, "vocab_size": config.vocab_size, "compile_first_ms": first * 1e3,
            "compile_cached_us": cached * 1e6, "schema_bytes": len(schema.encode()),
            "prefill_row_grammar_bytes": pb.Grammar(id=1).ByteSize(), "batch": batch,
            "mask_fill_per_step_us": fill * 1e6}


def decode_steps(model_dir: str, properties: int, batch: int, device: str, rounds: int = 12,
                 steps: int = 8) -> dict:
    """Median decode-step time (sampling on) of `batch` requests, each with the JSON schema or none."""
    import random
    import statistics

    from gaudi_runtime.bench.online import string_properties_schema
    from gaudi_runtime.config import resolve
    from gaudi_runtime.device import select_device
    from gaudi_runtime.params import SamplingParameters
    from gaudi_runtime.shard.runner import ModelRunner, PrefillInput

    cfg = resolve(None, {"MODEL_ID": model_dir, "DEVICE": device, "MAX_TOTAL_TOKENS": "256",
                         "MAX_BATCH_SIZE": str(batch), "BLOCK_SIZE": "16"})
    runner = ModelRunner(cfg, model_dir, select_device(device))
    runner.grammars.prepare()
    schema = json.dumps(string_properties_schema(properties))
    runner.grammars.compile(1, "json", schema)  # CompileGrammar's work: the prefills name id 1
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(64)] for _ in range(batch)]
    times: dict[str, list[float]] = {"none": [], "json": []}
    for r in range(rounds):
        for mode in ("none", "json") if r % 2 == 0 else ("json", "none"):
            reqs = [PrefillInput(i, p, SamplingParameters(do_sample=True, seed=i), 0,
                                 list(range(1 + 6 * i, 7 + 6 * i)), False,
                                 grammar=1 if mode == "json" else None)
                    for i, p in enumerate(prompts)]
            runner.prefill(1, reqs)
            ids = list(range(batch))
            for _ in range(steps):
                t0 = time.perf_counter()
                runner.decode([(1, ids)])
                times[mode].append(time.perf_counter() - t0)
            runner.clear(None)
    none, constrained = statistics.median(times["none"]), statistics.median(times["json"])
    return {"step_ms_none": none * 1e3, "step_ms_json": constrained * 1e3, "throughput_ratio": none / constrained}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--properties", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    r = {**measure(a.model_dir, a.properties, a.batch),
         **decode_steps(a.model_dir, a.properties, a.batch, a.device)}
    print("RESULT " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
