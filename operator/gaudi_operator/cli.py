"""`gaudi-operator`: run the Kopf operator for InferenceServices."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import kopf

from . import handlers  # noqa: F401  (importing registers the handlers with Kopf)
from .config import OperatorConfig

LOG_FORMATS = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaudi-operator", description=__doc__)
    ns = p.add_mutually_exclusive_group()
    ns.add_argument("-n", "--namespace", action="append", default=None, metavar="NS",
                    help="Watch only this namespace (repeatable; globs allowed). [env: WATCH_NAMESPACES, comma-separated]")
    ns.add_argument("-A", "--all-namespaces", action="store_true", help="Watch the whole cluster (the default).")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="Log level. [env: LOG_LEVEL]")
    p.add_argument("--log-format", default=os.environ.get("LOG_FORMAT", "full"), choices=sorted(LOG_FORMATS),
                   help="Log line format. [env: LOG_FORMAT]")
    p.add_argument("--liveness", default=os.environ.get("LIVENESS_ENDPOINT"), metavar="URL",
                   help="Serve the operator's own liveness probe, e.g. http://0.0.0.0:8080/healthz. [env: LIVENESS_ENDPOINT]")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--standalone", action="store_true",
                      help="Run without peering (a single replica; the default).")
    peer.add_argument("--peering", metavar="NAME",
                      help="Use Kopf peering under this name for HA (needs the KopfPeering CRDs); "
                           "only the highest-priority operator is active.")
    p.add_argument("--priority", type=int, default=0, help="Peering priority of this operator.")
    p.add_argument("--resync-seconds", type=float, default=None,
                   help="Resync and warmup-poll interval. [env: GAUDI_OPERATOR_RESYNC_SECONDS, default 15]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = OperatorConfig.from_env()
    if args.resync_seconds is not None:
        config = dataclasses.replace(config, resync_seconds=args.resync_seconds)
    namespaces = args.namespace
    if not namespaces and not args.all_namespaces and os.environ.get("WATCH_NAMESPACES"):
        namespaces = [n.strip() for n in os.environ["WATCH_NAMESPACES"].split(",") if n.strip()]

    kopf.configure(debug=args.log_level == "debug", verbose=args.log_level == "debug",
                   log_format=LOG_FORMATS[args.log_format])
    logging.getLogger().setLevel(args.log_level.upper())

    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering,
        priority=args.priority,
        namespaces=namespaces or (),
        clusterwide=not namespaces,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(config=config),  # handlers.startup reads it
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
