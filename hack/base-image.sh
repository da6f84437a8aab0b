#!/usr/bin/env bash
# Make (once per machine) a Python 3.11 base image for the two Dockerfiles when no registry is
# reachable, load it into the container engine, and print its name: a stand-in for
# docker.io/library/python:3.11-slim-bookworm with the same layout where the Dockerfiles
# depend on it (`python` and `pip` on PATH, installing into a prefix of their own; CA
# certificates; groupadd/useradd).
#
#   hack/base-image.sh                -> localhost/gaudi-serve/python-base:bookworm-<recipe>
#   hack/base-image.sh --rootfs       -> the cache directory (rootfs.tar, Containerfile, build-info)
#   ENGINE=podman DEBIAN_MIRROR=http://mirror.example/debian hack/base-image.sh
#
# The root filesystem is Debian's, from `debootstrap --variant=minbase` (python3, python3-venv,
# ca-certificates, passwd: no compiler, which only the runtime image's kernel stage installs, from
# the same mirror) with a venv at /opt/python put first on PATH (Debian's own python3
# refuses `pip install` outside a venv). It is built as root into a temporary directory, then
# moved into place under ~/.cache/gaudi-serve (GAUDI_SERVE_CACHE moves it), keyed by the
# suite and this recipe, with a stamp written last: an interrupted build is redone, never
# half-used. Loading into the engine is a two-line build (FROM scratch, ADD rootfs.tar) that
# the engine skips when the image is already there.
#
# For building where no registry is reachable (CI); a production image starts from the
# registry's python image, which gets Debian's security updates.
set -euo pipefail

SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-venv,ca-certificates,passwd"
VENV=/opt/python
RECIPE_VERSION=1   # bump when the steps below change what the root filesystem holds
KEY="$(printf '%s\n' "$SUITE" "$PACKAGES" "$VENV" "$RECIPE_VERSION" | sha256sum | cut -c1-12)"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
DIR="$CACHE_ROOT/python-base-debian-$SUITE-$KEY"
STAMP="$DIR/build-info"   # written last: its presence marks a complete build
IMAGE="localhost/gaudi-serve/python-base:$SUITE-$KEY"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

build_rootfs() {
    if [[ "$(id -u)" != 0 ]]; then
        echo "hack/base-image.sh: debootstrap needs root (or use a registry's python image: PYTHON_IMAGE=...)" >&2
        exit 1
    fi
    command -v debootstrap >/dev/null 2>&1 || {
        echo "hack/base-image.sh: no debootstrap on PATH (Debian: apt-get install debootstrap)" >&2; exit 1; }
    mkdir -p "$CACHE_ROOT"
    WORK="$(mktemp -d "$CACHE_ROOT/.python-base-build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    local start root="$WORK/rootfs" out="$WORK/out"
    start=$(date +%s)
    echo "hack/base-image.sh: debootstrap $SUITE from $MIRROR (once per machine, about a minute)..." >&2
    nice -n 19 debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >&2
    chroot "$root" /usr/bin/python3 -m venv "$VENV"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/etc/resolv.conf \
        "$root"/etc/hostname
    mkdir -p "$out"
    tar -C "$root" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf "$out/rootfs.tar" .
    cat > "$out/Containerfile" <<EOF
# Debian $SUITE minbase + $PACKAGES, a venv at $VENV (made by hack/base-image.sh)
FROM scratch
ADD rootfs.tar /
ENV PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LANG=C.UTF-8
CMD ["python"]
EOF
    local python
    python="$(chroot "$root" "$VENV/bin/python" -c 'import platform; print(platform.python_version())')"
    rm -rf "$DIR"
    mv "$out" "$DIR"
    echo "suite=$SUITE mirror=$MIRROR packages=$PACKAGES python=$python built_in=$(( $(date +%s) - start ))s" > "$STAMP"
    echo "hack/base-image.sh: built in $(( $(date +%s) - start ))s ($(du -sh "$DIR/rootfs.tar" | cut -f1), python $python)" >&2
}

[[ -f "$STAMP" && -f "$DIR/rootfs.tar" ]] || build_rootfs
if [[ "${1:-}" == "--rootfs" ]]; then
    echo "$DIR"
    exit 0
fi

ENGINE="${ENGINE:-$("$HERE/container-engine.sh")}"
case "$ENGINE" in
    buildah) have() { buildah inspect --type image "$1" >/dev/null 2>&1; }; build=(buildah bud) ;;
    *)       have() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }; build=("$ENGINE" build) ;;
esac
if ! have "$IMAGE"; then
    echo "hack/base-image.sh: loading $IMAGE into $ENGINE..." >&2
    "${build[@]}" -q -t "$IMAGE" -f "$DIR/Containerfile" "$DIR" >&2
fi
echo "$IMAGE"
