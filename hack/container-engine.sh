#!/usr/bin/env bash
# Print the container engine this machine has: docker (when its daemon answers), podman or
# buildah, in that order; CONTAINER_ENGINE=<name> chooses one.
#
#   hack/container-engine.sh                  -> docker | podman | buildah
#   hack/container-engine.sh --install-podman -> podman
#
# --install-podman is for the image tests (tests/images, tests/e2e): they need podman, which
# both builds and runs images (read-only root filesystem, host network), runc (podman's default
# runtime, crun, refuses some machines' cgroup layout) and debootstrap, which makes the offline
# base (hack/base-image.sh). Whatever is missing is installed from Debian's packages (with
# fuse-overlayfs, for overlay storage without root) when this runs as root on a Debian or
# Ubuntu machine; otherwise it says what to install.
set -euo pipefail

if [[ "${1:-}" == "--install-podman" ]]; then
    missing=()
    command -v podman >/dev/null 2>&1 || missing+=(podman fuse-overlayfs)
    command -v runc >/dev/null 2>&1 || missing+=(runc)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if (( ${#missing[@]} )); then
        if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
            echo "hack/container-engine.sh: the image tests need ${missing[*]}; install them (Debian: apt-get install ${missing[*]})" >&2
            exit 1
        fi
        echo "hack/container-engine.sh: installing ${missing[*]} (Debian packages, once per machine)..." >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >&2
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
    echo podman
    exit 0
fi

if [[ -n "${CONTAINER_ENGINE:-}" ]]; then
    command -v "$CONTAINER_ENGINE" >/dev/null 2>&1 || { echo "hack/container-engine.sh: CONTAINER_ENGINE=$CONTAINER_ENGINE is not on PATH" >&2; exit 1; }
    echo "$CONTAINER_ENGINE"
    exit 0
fi
# A docker client without a daemon (or without the rights to its socket) cannot build.
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo docker
elif command -v podman >/dev/null 2>&1; then
    echo podman
elif command -v buildah >/dev/null 2>&1; then
    echo buildah
else
    echo "hack/container-engine.sh: no container engine: install docker, podman or buildah (Debian: apt-get install podman)" >&2
    exit 1
fi
