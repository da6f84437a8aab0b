#!/usr/bin/env bash
# Fetch (once per machine) and print the directory of the Gateway API's CRDs that the end-to-end
# tests (tests/e2e) install: HTTPRoute, Gateway and GatewayClass of the standard channel, taken
# from the sigs.k8s.io/gateway-api Go module (config/crd/standard/) through the module proxy, as
# `go mod download` serves it: no release download, nothing vendored.
#
#   hack/gateway-crds.sh   -> prints ~/.cache/gaudi-serve/gateway-api-v1.6.3
#   GAUDI_SERVE_CACHE=/somewhere GATEWAY_API_VERSION=v1.6.2 hack/gateway-crds.sh
#
# v1.6.3: the newest release whose go.mod this machine's Go (1.26) accepts (v1.7.0 asks for 1.27).
# The InferencePool's CRD is not here: the inference extension's module is not served by the proxy;
# tests/e2e/crds/inferencepool-v1.yaml stands in for it (docs/e2e.md).
# Progress goes to stderr; stdout carries only the path.
set -euo pipefail

GATEWAY_API_VERSION="${GATEWAY_API_VERSION:-v1.6.3}"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
OUT_DIR="$CACHE_ROOT/gateway-api-${GATEWAY_API_VERSION}"
STAMP="$OUT_DIR/build-info"   # written last: its presence marks a complete copy
KINDS=(httproutes gateways gatewayclasses)

if [[ -f "$STAMP" ]]; then
    echo "$OUT_DIR"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    echo "hack/gateway-crds.sh: no 'go' toolchain on PATH; cannot fetch the Gateway API's CRDs" >&2
    exit 1
fi

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/.gateway-api.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
echo "hack/gateway-crds.sh: fetching sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION..." >&2
# Outside any module: `go mod download` only fetches and unpacks the module into the module cache.
dir="$(cd "$WORK" && GOFLAGS=-mod=mod GOWORK=off nice -n 19 go mod download -json \
    "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
if [[ -z "$dir" || ! -d "$dir/config/crd/standard" ]]; then
    echo "hack/gateway-crds.sh: the module sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION has no config/crd/standard" >&2
    exit 1
fi
mkdir -p "$WORK/out/crds"
for kind in "${KINDS[@]}"; do
    cp "$dir/config/crd/standard/gateway.networking.k8s.io_${kind}.yaml" "$WORK/out/crds/"
done
chmod -R u+w "$WORK/out"
printf 'sigs.k8s.io/gateway-api %s\nconfig/crd/standard: %s\n' "$GATEWAY_API_VERSION" "${KINDS[*]}" > "$WORK/out/build-info"
rm -rf "$OUT_DIR"
mv "$WORK/out" "$OUT_DIR"
echo "$OUT_DIR"
