#!/usr/bin/env bash
# Regenerates the router <-> shard gRPC stubs from proto/generate.proto.
set -euo pipefail
cd "$(dirname "$0")/../runtime"
python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. gaudi_runtime/proto/generate.proto
