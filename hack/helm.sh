#!/usr/bin/env bash
# Build (once per machine) and print the path of a pinned Helm binary.
#
# There is no release download here: Helm is compiled from its Go module
# through the Go module proxy and cached outside the work tree, keyed by
# version, so later calls only print the path.
#
#   hack/helm.sh            -> prints /root/.cache/gaudi-serve/helm-v3.21.4/helm
#   HELM_VERSION=v3.22.0 hack/helm.sh
#   GAUDI_SERVE_CACHE=/somewhere hack/helm.sh
#
# Progress goes to stderr; stdout carries only the path.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.21.4}"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
BIN_DIR="$CACHE_ROOT/helm-$HELM_VERSION"
HELM="$BIN_DIR/helm"
STAMP="$BIN_DIR/build-info"   # written last: its presence marks a complete build of this script's recipe

if [[ -x "$HELM" && -f "$STAMP" ]] && "$HELM" version --short 2>/dev/null | grep -q "^${HELM_VERSION}"; then
    echo "$HELM"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "hack/helm.sh: no 'go' toolchain on PATH; cannot build helm $HELM_VERSION" >&2
    exit 1
fi

mkdir -p "$BIN_DIR"
# Build into a temporary directory first so an interrupted build never leaves
# a half-written binary at the cached path.
TMP_BIN="$(mktemp -d "$CACHE_ROOT/.helm-build.XXXXXX")"
trap 'rm -rf "$TMP_BIN"' EXIT

echo "hack/helm.sh: building helm $HELM_VERSION from helm.sh/helm/v3 (once per machine)..." >&2
start=$(date +%s)
# Stamp the version, and the Kubernetes version that 'helm template' and 'helm lint' assume
# (from the client-go Helm is built with), the way Helm's own Makefile does; without it a
# 'go install' build claims Kubernetes 1.20.
MOD_DIR="$(cd "$TMP_BIN" && go mod download -json "helm.sh/helm/v3@${HELM_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
CLIENT_GO="$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$MOD_DIR/go.mod")"
if [[ -z "$CLIENT_GO" ]]; then
    echo "hack/helm.sh: could not read the k8s.io/client-go version from $MOD_DIR/go.mod" >&2
    exit 1
fi
LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
for pkg in pkg/lint/rules pkg/chartutil; do
    LDFLAGS+=" -X helm.sh/helm/v3/${pkg}.k8sVersionMajor=1 -X helm.sh/helm/v3/${pkg}.k8sVersionMinor=${CLIENT_GO}"
done
# CGO off: a static binary that needs nothing from the host.
CGO_ENABLED=0 GOBIN="$TMP_BIN" GOFLAGS="${GOFLAGS:-} -trimpath" go install -ldflags "$LDFLAGS" \
    "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2
mv "$TMP_BIN/helm" "$HELM"
echo "helm=${HELM_VERSION} kubernetes=1.${CLIENT_GO} go=$(go env GOVERSION)" > "$STAMP"
echo "hack/helm.sh: built in $(( $(date +%s) - start ))s" >&2
echo "$HELM"
