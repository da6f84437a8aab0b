#!/usr/bin/env bash
# Build the operator image (Dockerfile.operator) and the runtime image (Dockerfile.runtime, its
# cpu variant unless VARIANT=hpu) with whichever container engine is here (docker, podman or
# buildah: hack/container-engine.sh). What `make images` runs; every setting is an environment
# variable (or a make variable of the same name):
#
#   REGISTRY         ghcr.io/gaudi-serve          where the images are named (and pushed)
#   TAG              pyproject.toml's version     image tag; the cpu runtime gets TAG-cpu
#   VARIANT          cpu                          runtime variant: cpu or hpu
#   OPERATOR_IMAGE   $REGISTRY/operator:$TAG      full names, overriding REGISTRY and TAG
#   RUNTIME_IMAGE    $REGISTRY/runtime:$TAG[-cpu]
#   IMAGES           operator runtime             which to build
#   PYTHON_IMAGE     python:3.11-slim-bookworm    Python base of the operator and the cpu runtime;
#                                                 when it cannot be pulled (no registry reachable),
#                                                 hack/base-image.sh makes one from Debian's packages
#   TORCH_CPU_INDEX  (Dockerfile's)               index the cpu runtime takes torch from (CPU-only
#                                                 wheels); when it cannot be reached,
#                                                 https://pypi.org/simple (torch with CUDA: 6 GB)
#   HPU_BASE_IMAGE   (Dockerfile's)               Intel Gaudi PyTorch image of the hpu runtime
#   ENGINE           hack/container-engine.sh     docker, podman or buildah
#   ISOLATION        chroot                       podman/buildah: how RUN steps run (chroot or oci)
#   BUILD_FLAGS                                   more flags for every build (e.g. --no-cache)
#
# With podman and buildah, pip inside the build uses this machine's pip settings: its index,
# trusted hosts and CA bundle (a TLS-inspecting proxy's, a private index's) are mounted
# read-only into each RUN step (/etc/pip.conf, /etc/ssl/certs/ca-certificates.crt), never
# copied into a layer; the empty mount point /etc/pip.conf stays in the image. RUN steps run
# in a chroot rather than an OCI container by default: nothing to set up for cgroups or
# resource limits, which some machines (VMs without CAP_SYS_RESOURCE, hybrid cgroup
# hierarchies) refuse. Docker builds see none of this: BuildKit has its own settings.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ENGINE="${ENGINE:-$(hack/container-engine.sh)}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)"
REGISTRY="${REGISTRY:-ghcr.io/gaudi-serve}"
TAG="${TAG:-$VERSION}"
VARIANT="${VARIANT:-cpu}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-$REGISTRY/operator:$TAG}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-$REGISTRY/runtime:$TAG$([[ "$VARIANT" == cpu ]] && echo -cpu || true)}"
IMAGES="${IMAGES:-operator runtime}"
DEFAULT_PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
ISOLATION="${ISOLATION:-chroot}"
read -r -a EXTRA <<< "${BUILD_FLAGS:-}"

case "$ENGINE" in
    docker)  BUILD=(docker build); have() { docker image inspect "$1" >/dev/null 2>&1; } ;;
    podman)  BUILD=(podman build --layers --network host --isolation "$ISOLATION")
             have() { podman image inspect "$1" >/dev/null 2>&1; } ;;
    buildah) BUILD=(buildah bud --layers --network host --isolation "$ISOLATION")
             have() { buildah inspect --type image "$1" >/dev/null 2>&1; } ;;
    *) echo "hack/build-images.sh: unknown engine '$ENGINE' (docker, podman or buildah)" >&2; exit 1 ;;
esac

python_image() {
    if [[ -n "${PYTHON_IMAGE:-}" ]]; then
        echo "$PYTHON_IMAGE"
    elif have "$DEFAULT_PYTHON_IMAGE" || "$ENGINE" pull -q "$DEFAULT_PYTHON_IMAGE" >/dev/null 2>&1; then
        echo "$DEFAULT_PYTHON_IMAGE"
    else
        echo "hack/build-images.sh: $DEFAULT_PYTHON_IMAGE cannot be pulled; using the offline base (hack/base-image.sh)" >&2
        ENGINE="$ENGINE" hack/base-image.sh
    fi
}

# -v flags that give pip inside the build this machine's pip settings (podman, buildah).
PIP_CONF=""
MOUNTS=()
pip_mounts() {
    local python cert
    python="$(command -v "${PYTHON:-python3}" || true)"
    [[ -n "$python" ]] && "$python" -m pip --version >/dev/null 2>&1 || return 0
    PIP_CONF="$(mktemp)"
    # `pip config list` holds the files' and the PIP_* variables' settings; the CA bundle is
    # mounted at Debian's path, where the python images keep theirs.
    cert="$("$python" -m pip config list 2>/dev/null | "$python" -c '
import ast, os, sys
keep = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries", "proxy"}
settings, cert = {}, ""
for line in sys.stdin:
    name, _, value = line.strip().partition("=")
    key = name.rpartition(".")[2]
    value = ast.literal_eval(value) if value else ""
    if key == "cert":
        cert = value
    elif key in keep:
        settings[key] = value
cert = cert or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or ""
if os.path.isfile(cert):
    settings["cert"] = "/etc/ssl/certs/ca-certificates.crt"
with open(sys.argv[1], "w") as out:
    out.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
print(cert if os.path.isfile(cert) else "")
' "$PIP_CONF")"
    MOUNTS+=(-v "$PIP_CONF:/etc/pip.conf:ro")
    [[ -z "$cert" ]] || MOUNTS+=(-v "$cert:/etc/ssl/certs/ca-certificates.crt:ro")
}
trap '[[ -z "$PIP_CONF" ]] || rm -f "$PIP_CONF"' EXIT

[[ "$ENGINE" == docker ]] || pip_mounts
BASE="$(python_image)"

build() {  # build <image> <Dockerfile> <build-arg>...
    local image="$1" file="$2" start
    shift 2
    start=$(date +%s)
    echo "hack/build-images.sh: building $image ($file, $ENGINE)..." >&2
    "${BUILD[@]}" "${MOUNTS[@]}" "${EXTRA[@]}" -f "$file" -t "$image" "${@/#/--build-arg=}" . >&2
    echo "hack/build-images.sh: $image built in $(( $(date +%s) - start ))s" >&2
    echo "$image"
}

# The CPU-only torch index, or PyPI's when that one cannot be reached (pip would retry it for
# every package, then fail).
torch_index() {
    local index
    index="${TORCH_CPU_INDEX:-$(sed -n 's/^ARG TORCH_CPU_INDEX=//p' Dockerfile.runtime)}"
    if [[ -z "${TORCH_CPU_INDEX:-}" ]] && ! python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
            "$index/" >/dev/null 2>&1; then
        echo "hack/build-images.sh: $index cannot be reached; torch comes from PyPI (with its CUDA libraries)" >&2
        index=https://pypi.org/simple
    fi
    echo "$index"
}

for what in $IMAGES; do
    case "$what" in
        operator) build "$OPERATOR_IMAGE" Dockerfile.operator "PYTHON_IMAGE=$BASE" ;;
        runtime)
            args=("VARIANT=$VARIANT" "CPU_BASE_IMAGE=$BASE")
            [[ "$VARIANT" != cpu ]] || args+=("TORCH_CPU_INDEX=$(torch_index)")
            [[ -z "${HPU_BASE_IMAGE:-}" ]] || args+=("HPU_BASE_IMAGE=$HPU_BASE_IMAGE")
            build "$RUNTIME_IMAGE" Dockerfile.runtime "${args[@]}" ;;
        *) echo "hack/build-images.sh: unknown image '$what' (operator, runtime)" >&2; exit 1 ;;
    esac
done
