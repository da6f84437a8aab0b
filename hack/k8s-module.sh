# Sourced by hack/control-plane.sh and hack/autoscaling-tools.sh.
#
# require_kubernetes VERSION: make the Go module in the current directory require
# k8s.io/kubernetes@VERSION. Kubernetes replaces each of its staging modules with a relative path,
# which a dependent module cannot use: each one is pinned to its published v0.<minor>.<patch>, the
# list read from kubernetes' own go.mod, not from a hand-written copy.
require_kubernetes() {
    local version=$1 gomod
    gomod="$(go mod download -json "k8s.io/kubernetes@${version}" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
    go mod edit -require "k8s.io/kubernetes@${version}"
    go mod edit -json "$gomod" | python3 -c '
import json, sys
for r in json.load(sys.stdin).get("Replace") or []:
    if r["New"]["Path"].startswith("./staging/"):
        print(r["Old"]["Path"])' \
    | while read -r module; do
        go mod edit -replace "${module}=${module}@v0.${version#v1.}"
    done
}
