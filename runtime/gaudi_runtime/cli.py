"""`gaudi-serve` command line: launch, download, router, shard, tiny-model, benchmark, loadtest, calibrate,
build-kernels."""

from __future__ import annotations

import argparse
import os
import sys

from gaudi_runtime import logs
from gaudi_runtime.config import Config, ConfigError, add_arguments, resolve


def _internal_config() -> tuple[Config, str]:
    from gaudi_runtime.launcher import CONFIG_ENV, MODEL_DIR_ENV

    return Config.from_json(os.environ[CONFIG_ENV]), os.environ[MODEL_DIR_ENV]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gaudi-serve", description="LLM serving runtime for Intel Gaudi")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model: shards + router (TGI-compatible flags)")
    add_arguments(launch)
    sub.add_parser("router", help="(internal) the HTTP router, started by launch")
    shard = sub.add_parser("shard", help="(internal) one model shard, started by launch")
    shard.add_argument("--rank", type=int, required=True)
    shard.add_argument("--world-size", type=int, required=True)
    for name, text in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)  # each tool parses its own flags
    return parser


# Tools with their own argument parsers: `gaudi-serve NAME ...` hands them the rest of the line.
TOOLS = {
    "download": "fetch a model's serving files from the Hugging Face hub into the cache (resumable, checked)",
    "tiny-model": "write a tiny random model for demos and tests",
    "benchmark": "static-batching latency/throughput of the shards per batch size",
    "loadtest": "load generator for a TGI or OpenAI endpoint (TTFT, ITL, throughput)",
    "calibrate": "measure FP8 statistics (INC layout) for QUANT_CONFIG",
    "build-kernels": "compile the CPU kernels for each instruction-set level, so a server needs no compiler",
}


def _run_tool(name: str, argv: list[str]) -> int:
    if name == "download":
        from gaudi_runtime.download import main as tool
    elif name == "tiny-model":
        from gaudi_runtime.tools.tiny_model import main as tool
    elif name == "benchmark":
        from gaudi_runtime.bench.benchmark import main as tool
    elif name == "calibrate":
        from gaudi_runtime.quant.calibrate import main as tool
    elif name == "build-kernels":
        from gaudi_runtime.tools.build_kernels import main as tool
    else:
        from gaudi_runtime.bench.loadtest import main as tool
    return tool(argv) or 0


def _run_launch(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args)
        from gaudi_runtime.quant.config import check_quant_config

        check_quant_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.server.log_level, cfg.server.json_output, "launcher")
    from gaudi_runtime import launcher

    try:
        return launcher.main(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_shard(rank: int, world_size: int) -> int:
    cfg, model_dir = _internal_config()
    logs.setup(cfg.server.log_level, cfg.server.json_output, f"shard-{rank}")
    from gaudi_runtime.shard import server

    try:
        server.main(cfg, model_dir, rank, world_size)
    except ConfigError as e:  # found only once the model is built (e.g. QUANT_CONFIG naming no layer)
        print(f"error: shard {rank}: {e}", file=sys.stderr)
        return 2
    return 0


def _run_router() -> int:
    cfg, model_dir = _internal_config()
    logs.setup(cfg.server.log_level, cfg.server.json_output, "router")
    from gaudi_runtime.router import main as router_main

    return router_main.main(cfg, model_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in TOOLS:
        return _run_tool(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return _run_launch(args)
    if args.command == "shard":
        return _run_shard(args.rank, args.world_size)
    return _run_router()


if __name__ == "__main__":
    sys.exit(main())
