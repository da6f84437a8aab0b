#!/usr/bin/env bash
# Build (once per machine) and print the directory of a pinned Kubernetes
# control plane for the end-to-end tests (tests/e2e):
#
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#       from k8s.io/kubernetes (a small go.mod pins every k8s.io staging module)
#   etcd   from go.etcd.io/etcd/server/v3 (a one-line main calling etcdmain)
#   kwok   from sigs.k8s.io/kwok (simulated nodes and pod lifecycle)
#   helm   via hack/helm.sh (its own cache entry)
#
# There is no release download and no Docker here: everything is compiled from
# Go modules through the module proxy and cached outside the work tree, keyed
# by version, so later calls only print the path.
#
#   hack/control-plane.sh     -> prints ~/.cache/gaudi-serve/control-plane-k8s-v1.37.2-etcd-v3.7.3-kwok-v0.8.0
#   GAUDI_SERVE_CACHE=/somewhere K8S_VERSION=v1.37.3 hack/control-plane.sh
#
# Builds run at the lowest CPU priority (nice 19); GOFLAGS is honoured, e.g.
# GOFLAGS=-p=2. Progress goes to stderr; stdout carries only the path.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.7.3}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
BIN_DIR="$CACHE_ROOT/control-plane-k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-kwok-${KWOK_VERSION}"
STAMP="$BIN_DIR/build-info"   # written last: its presence marks a complete build
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/k8s-module.sh
. "$HERE/k8s-module.sh"

complete() {
    [[ -f "$STAMP" ]] || return 1
    for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
    "$BIN_DIR/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes ${K8S_VERSION}"
}

if complete; then
    "$HERE/helm.sh" >/dev/null
    echo "$BIN_DIR"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "hack/control-plane.sh: no 'go' toolchain on PATH; cannot build the control plane" >&2
    exit 1
fi

mkdir -p "$CACHE_ROOT"
# Build into a temporary directory so an interrupted build never leaves a
# half-written binary (or a stamp) at the cached path.
WORK="$(mktemp -d "$CACHE_ROOT/.control-plane-build.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin" "$WORK/k8s" "$WORK/etcd" "$WORK/kwok"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath -mod=mod" GOWORK=off
GO="nice -n 19 go"
start=$(date +%s)

# --- Kubernetes -------------------------------------------------------------
echo "hack/control-plane.sh: building kubernetes $K8S_VERSION (once per machine; tens of minutes cold)..." >&2
K8S_MINOR="${K8S_VERSION#v1.}"; K8S_MINOR="${K8S_MINOR%%.*}"
(
    cd "$WORK/k8s"
    go mod init gaudi-serve.local/control-plane >/dev/null 2>&1
    require_kubernetes "$K8S_VERSION"
)
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LDFLAGS+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${K8S_MINOR}"
    LDFLAGS+=" -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
done
(
    cd "$WORK/k8s"
    for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
        go get "k8s.io/kubernetes/cmd/${cmd}@${K8S_VERSION}" >&2
    done
    $GO build -ldflags "$LDFLAGS" -o "$WORK/bin/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
)
echo "hack/control-plane.sh: kubernetes built after $(( $(date +%s) - start ))s" >&2

# --- etcd -------------------------------------------------------------------
# The server module's go.mod has relative replaces, so 'go install' refuses it;
# a one-line main in our own module calls the same entry point.
(
    cd "$WORK/etcd"
    go mod init gaudi-serve.local/etcd >/dev/null 2>&1
    cat > main.go <<'EOF'
// Command etcd is etcd's own entry point, built outside etcd's repository.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
    go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2
    go mod tidy >&2
    $GO build -ldflags "-s -w" -o "$WORK/bin/etcd" . >&2
)
echo "hack/control-plane.sh: etcd built after $(( $(date +%s) - start ))s" >&2

# --- kwok -------------------------------------------------------------------
(
    cd "$WORK/kwok"
    GOBIN="$WORK/bin" $GO install -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" \
        "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}" >&2
)
echo "hack/control-plane.sh: kwok built after $(( $(date +%s) - start ))s" >&2

mkdir -p "$BIN_DIR"
for b in "${BINARIES[@]}"; do mv -f "$WORK/bin/$b" "$BIN_DIR/$b"; done
"$HERE/helm.sh" >/dev/null
echo "kubernetes=${K8S_VERSION} etcd=${ETCD_VERSION} kwok=${KWOK_VERSION} go=$(go env GOVERSION) built_in=$(( $(date +%s) - start ))s" > "$STAMP"
echo "hack/control-plane.sh: built in $(( $(date +%s) - start ))s ($(du -sh "$BIN_DIR" | cut -f1))" >&2
echo "$BIN_DIR"
