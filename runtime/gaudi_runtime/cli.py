"""`gaudi-serve` command line: launch, router, shard, tiny-model, benchmark, loadtest, calibrate."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gaudi_runtime import logs
from gaudi_runtime.config import Config, ConfigError, add_arguments, resolve


def _internal_config() -> tuple[Config, str]:
    from gaudi_runtime.launcher import CONFIG_ENV, MODEL_DIR_ENV

    return Config(**json.loads(os.environ[CONFIG_ENV])), os.environ[MODEL_DIR_ENV]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gaudi-serve", description="LLM serving runtime for Intel Gaudi")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model: shards + router (TGI-compatible flags)")
    add_arguments(launch)
    sub.add_parser("router", help="(internal) the HTTP router, started by launch")
    shard = sub.add_parser("shard", help="(internal) one model shard, started by launch")
    shard.add_argument("--rank", type=int, required=True)
    shard.add_argument("--world-size", type=int, required=True)
    sub.add_parser("tiny-model", help="write a tiny random model for demos and tests", add_help=False)
    sub.add_parser("benchmark", help="static-batching latency/throughput of the shards per batch size",
                   add_help=False)
    sub.add_parser("loadtest", help="load generator for a TGI or OpenAI endpoint (TTFT, ITL, throughput)",
                   add_help=False)
    sub.add_parser("calibrate", help="measure FP8 statistics (INC layout) for QUANT_CONFIG", add_help=False)

    if argv[:1] == ["tiny-model"]:
        from gaudi_runtime.tools.tiny_model import main as tiny

        tiny(argv[1:])
        return 0
    if argv[:1] == ["benchmark"]:
        from gaudi_runtime.bench.benchmark import main as benchmark

        return benchmark(argv[1:])
    if argv[:1] == ["calibrate"]:
        from gaudi_runtime.quant.calibrate import main as calibrate

        return calibrate(argv[1:])
    if argv[:1] == ["loadtest"]:
        from gaudi_runtime.bench.loadtest import main as loadtest

        return loadtest(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "launch":
        try:
            cfg = resolve(args)
            from gaudi_runtime.quant.config import check_quant_config

            check_quant_config(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        logs.setup(cfg.log_level, cfg.json_output, "launcher")
        from gaudi_runtime import launcher

        try:
            return launcher.main(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cfg, model_dir = _internal_config()
    if args.command == "shard":
        logs.setup(cfg.log_level, cfg.json_output, f"shard-{args.rank}")
        from gaudi_runtime.shard import server

        try:
            server.main(cfg, model_dir, args.rank, args.world_size)
        except ConfigError as e:  # found only once the model is built (e.g. QUANT_CONFIG naming no layer)
            print(f"error: shard {args.rank}: {e}", file=sys.stderr)
            return 2
        return 0
    logs.setup(cfg.log_level, cfg.json_output, "router")
    from gaudi_runtime.router import main as router_main

    return router_main.main(cfg, model_dir)


if __name__ == "__main__":
    sys.exit(main())
