"""What a grammar costs on a shard: compiling a JSON schema (the first time, then from the cache)
and filling the token masks of a batch for one step.

    python -m gaudi_runtime.bench.grammar --model-dir DIR [--properties 20] [--batch 16]

Runs the shard's own code (`shard/grammar.py`) in process against the model's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time


def measure(model_dir: str, properties: int, batch: int, steps: int = 50) -> dict:
    from transformers import AutoConfig

    from gaudi_runtime.bench.online import string_properties_schema
    from gaudi_runtime.shard.grammar import GrammarCache, GrammarRows

    config = AutoConfig.from_pretrained(model_dir)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    cache = GrammarCache(model_dir, config.vocab_size, eos)
    cache.prepare()  # the engine and the vocabulary are loaded once per shard, at warmup: not a compile
    schema = json.dumps(string_properties_schema(properties))
    t0 = time.perf_counter()
    cache.compile("json", schema)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.compile("json", schema)
    cached = time.perf_counter() - t0
    rows = GrammarRows(cache, [cache.matcher("json", schema) for _ in range(batch)])
    prefix = '{"field_0": "'  # fill inside a string, the common state of a long output
    for m in rows.matchers:
        m.accept_string(prefix)
    t0 = time.perf_counter()
    for _ in range(steps):
        rows.fill(batch)
    fill = (time.perf_counter() - t0) / steps
    return {"properties": properties, "vocab_size": config.vocab_size, "compile_first_ms": first * 1e3,
            "compile_cached_us": cached * 1e6, "batch": batch, "mask_fill_per_step_us": fill * 1e6}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--properties", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args(argv)
    r = measure(a.model_dir, a.properties, a.batch)
    print("RESULT " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
