#!/usr/bin/env bash
# bench/compare_vllm.sh for two commits of gaudi-serve, workload by workload, the two runs of each
# workload back to back: a machine whose speed drifts over half an hour then moves both alike, and each
# ours/vLLM ratio has its own vLLM figure from minutes before.
#
#   bench/before_after.sh 533510e              # that commit against HEAD
#   DTYPE=float32 WORKLOADS="overhead online long multiturn mixed" bench/before_after.sh 533510e main
#
# Each commit runs from a detached worktree under $OUT with this checkout's virtual environment
# (PYTHONPATH puts the commit's runtime first); the load generators are this checkout's for both.
# Every variable of compare_vllm.sh (DTYPE, OURS_ARGS, ...) applies to both runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
before=${1:?usage: bench/before_after.sh BEFORE_COMMIT [AFTER_COMMIT]}
after=${2:-HEAD}
out=${OUT:-$(mktemp -d)}
workloads=${WORKLOADS:-overhead online long multiturn mixed}

checkout() {  # $1: label; $2: commit -> a bin directory whose gaudi-serve and python run that commit
  local tree=$out/$1-tree bin=$out/$1-bin
  git -C "$root" worktree add --detach "$tree" "$2" >/dev/null 2>&1
  mkdir -p "$bin"
  printf '#!/bin/sh\nPYTHONPATH=%s/runtime exec %s/.venv/bin/python -m gaudi_runtime.cli "$@"\n' \
    "$tree" "$root" >"$bin/gaudi-serve"
  printf '#!/bin/sh\nexec %s/.venv/bin/python "$@"\n' "$root" >"$bin/python"
  chmod +x "$bin/gaudi-serve" "$bin/python"
  echo "$bin"
}
cleanup() { git -C "$root" worktree remove --force "$out/before-tree" 2>/dev/null || true
            git -C "$root" worktree remove --force "$out/after-tree" 2>/dev/null || true; }
trap cleanup EXIT

before_bin=$(checkout before "$before")
after_bin=$(checkout after "$after")
for w in $workloads; do
  for side in before after; do
    bin=$before_bin; [ "$side" = before ] || bin=$after_bin
    echo "== $w, $side" >&2
    OURS_BIN=$bin OUT=$out/$w-$side WORKLOADS=$w "$root/bench/compare_vllm.sh" >"$out/$w-$side.txt"
  done
done
for w in $workloads; do
  for side in before after; do
    echo "### $w, $side ($([ "$side" = before ] && echo "$before" || echo "$after"))"
    grep -v '^logs:' "$out/$w-$side.txt"
  done
done
echo "logs: $out"
