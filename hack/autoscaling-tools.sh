#!/usr/bin/env bash
# Build (once per machine) and print the directory of what the end-to-end tests (tests/e2e) need
# for autoscaling, next to the control plane of hack/control-plane.sh:
#
#   bin/metrics-adapter   the upstream test adapter of sigs.k8s.io/custom-metrics-apiserver
#                         (package test-adapter/provider: custom.metrics.k8s.io served from values
#                         POSTed to it), behind a main that listens for those values on the
#                         address of --write-address instead of the upstream's fixed :8080; built
#                         on the Kubernetes modules of hack/control-plane.sh (the same go.mod pins
#                         of the staging modules), so it talks to the API server of its own version
#   keda-crds/*.yaml      KEDA's CustomResourceDefinitions (ScaledObject, ...), generated from
#                         KEDA's Go API types (github.com/kedacore/keda/v2, apis/keda/v1alpha1) by
#                         controller-gen at the sigs.k8s.io/controller-tools version KEDA's own
#                         go.mod pins, with the options of KEDA's `make manifests`
#
# Everything is compiled or generated from Go modules through the module proxy (no release
# download, nothing vendored) and cached outside the work tree, keyed by version, so later calls
# only print the path.
#
#   hack/autoscaling-tools.sh   -> prints ~/.cache/gaudi-serve/autoscaling-cma-v1.37.0-k8s-v1.37.2-keda-v2.21.0
#   GAUDI_SERVE_CACHE=/somewhere KEDA_VERSION=v2.21.1 hack/autoscaling-tools.sh
#
# Builds run at the lowest CPU priority (nice 19) into a temporary directory moved into place,
# with a stamp written last; GOFLAGS is honoured. Progress goes to stderr; stdout carries only
# the path.
set -euo pipefail

CMA_VERSION="${CMA_VERSION:-v1.37.0}"
KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/k8s-module.sh
. "$HERE/k8s-module.sh"
# The control plane's Kubernetes version (one place: hack/control-plane.sh).
K8S_VERSION="${K8S_VERSION:-$(sed -n 's/^K8S_VERSION="\${K8S_VERSION:-\(v[0-9.]*\)}"$/\1/p' "$HERE/control-plane.sh")}"
if [[ -z "$K8S_VERSION" ]]; then
    echo "hack/autoscaling-tools.sh: could not read K8S_VERSION from hack/control-plane.sh" >&2
    exit 1
fi
OUT_DIR="$CACHE_ROOT/autoscaling-cma-${CMA_VERSION}-k8s-${K8S_VERSION}-keda-${KEDA_VERSION}"
STAMP="$OUT_DIR/build-info"   # written last: its presence marks a complete build

complete() {
    [[ -f "$STAMP" && -x "$OUT_DIR/bin/metrics-adapter" && -f "$OUT_DIR/keda-crds/keda.sh_scaledobjects.yaml" ]]
}

if complete; then
    echo "$OUT_DIR"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    echo "hack/autoscaling-tools.sh: no 'go' toolchain on PATH; cannot build the autoscaling tools" >&2
    exit 1
fi

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/.autoscaling-build.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/out/bin" "$WORK/out/keda-crds" "$WORK/adapter"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath -mod=mod" GOWORK=off
GO="nice -n 19 go"
start=$(date +%s)

# --- the custom metrics test adapter ------------------------------------------------------------
# Upstream's test-adapter/main.go with one change: the address its value-writing endpoint listens
# on is a flag (the end-to-end tests keep every socket on 127.0.0.0/8).
echo "hack/autoscaling-tools.sh: building the test adapter of custom-metrics-apiserver $CMA_VERSION..." >&2
(
    cd "$WORK/adapter"
    go mod init gaudi-serve.local/metrics-adapter >/dev/null 2>&1
    require_kubernetes "$K8S_VERSION"  # the module graph of hack/control-plane.sh's build
    cat > main.go <<'EOF'
// Command metrics-adapter is the test adapter of sigs.k8s.io/custom-metrics-apiserver: it serves
// custom.metrics.k8s.io (and external.metrics.k8s.io) from values POSTed to
// /write-metrics/namespaces/{namespace}/{resource}/{name}/{metric} on --write-address.
package main

import (
	"context"
	"net/http"
	"os"
	"time"

	"github.com/emicklei/go-restful/v3"
	"k8s.io/component-base/logs"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/klog/v2"

	"sigs.k8s.io/custom-metrics-apiserver/pkg/apiserver/metrics"
	basecmd "sigs.k8s.io/custom-metrics-apiserver/pkg/cmd"
	fakeprov "sigs.k8s.io/custom-metrics-apiserver/test-adapter/provider"
)

func main() {
	logs.InitLogs()
	defer logs.FlushLogs()

	cmd := &basecmd.AdapterBase{Name: "metrics-adapter"}
	var writeAddress string
	cmd.Flags().StringVar(&writeAddress, "write-address", "127.0.0.1:8080", "where metric values are POSTed")
	logs.AddFlags(cmd.Flags())
	if err := cmd.Flags().Parse(os.Args); err != nil {
		klog.Fatalf("unable to parse flags: %v", err)
	}

	client, err := cmd.DynamicClient()
	if err != nil {
		klog.Fatalf("unable to construct dynamic client: %v", err)
	}
	mapper, err := cmd.RESTMapper()
	if err != nil {
		klog.Fatalf("unable to construct discovery REST mapper: %v", err)
	}
	provider, webService := fakeprov.NewFakeProvider(client, mapper)
	cmd.WithCustomMetrics(provider)
	cmd.WithExternalMetrics(provider)
	if err := metrics.RegisterMetrics(legacyregistry.Register); err != nil {
		klog.Fatalf("unable to register metrics: %v", err)
	}

	container := restful.NewContainer()
	container.Add(webService)
	go func() {
		server := &http.Server{Addr: writeAddress, Handler: container, ReadHeaderTimeout: 3 * time.Second}
		klog.Fatal(server.ListenAndServe())
	}()
	if err := cmd.Run(context.Background()); err != nil {
		klog.Fatalf("unable to run custom metrics adapter: %v", err)
	}
}
EOF
    go get "sigs.k8s.io/custom-metrics-apiserver@${CMA_VERSION}" >&2
    $GO build -ldflags "-s -w" -o "$WORK/out/bin/metrics-adapter" . >&2
)
echo "hack/autoscaling-tools.sh: test adapter built after $(( $(date +%s) - start ))s" >&2

# --- KEDA's CRDs ----------------------------------------------------------------------------------
# In a writable copy of KEDA's module, so that its go.mod (the controller-tools version, its
# replace directives) applies, as in KEDA's own `make manifests`.
echo "hack/autoscaling-tools.sh: generating KEDA $KEDA_VERSION's CRDs with controller-gen..." >&2
KEDA_MOD="$(cd "$WORK" && go mod download -json "github.com/kedacore/keda/v2@${KEDA_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
cp -r "$KEDA_MOD" "$WORK/keda"
chmod -R u+w "$WORK/keda"
(
    cd "$WORK/keda"
    $GO build -o "$WORK/controller-gen" sigs.k8s.io/controller-tools/cmd/controller-gen >&2
    nice -n 19 "$WORK/controller-gen" crd:crdVersions=v1,generateEmbeddedObjectMeta=true \
        paths="./apis/keda/..." output:crd:artifacts:config="$WORK/out/keda-crds" >&2
    # As KEDA's Makefile does: withtriggers is a duck type for deepcopy only, not an API.
    rm -f "$WORK/out/keda-crds/keda.sh_withtriggers.yaml"
)
CG_VERSION="$(cd "$WORK/keda" && go list -m -f '{{.Version}}' sigs.k8s.io/controller-tools)"
echo "hack/autoscaling-tools.sh: KEDA CRDs generated after $(( $(date +%s) - start ))s" >&2

rm -rf "$OUT_DIR"
mv "$WORK/out" "$OUT_DIR"
echo "custom-metrics-apiserver=${CMA_VERSION} kubernetes-modules=${K8S_VERSION} keda=${KEDA_VERSION}" \
     "controller-tools=${CG_VERSION}" \
     "go=$(go env GOVERSION) built_in=$(( $(date +%s) - start ))s" > "$STAMP"
echo "hack/autoscaling-tools.sh: built in $(( $(date +%s) - start ))s ($(du -sh "$OUT_DIR" | cut -f1))" >&2
echo "$OUT_DIR"
