#!/usr/bin/env bash
# Our server from two source trees, alternating, on compare_vllm.sh's traffic (ours only, no vLLM): what a
# change costs or gains, workload by workload, with the drift between runs of one tree beside it.
#
#   bench/trees.sh BEFORE_TREE AFTER_TREE       # e.g. a `git worktree` at the base commit, and this repo
#   ORDER="a b b a" bench/trees.sh A B          # the run order (default: a b b a, so that each tree runs
#                                               # once early and once late)
#   WORKLOADS="online overhead" bench/trees.sh A B   # some of them (default: online overhead long lora mixed)
#   DTYPE=float32 WORKLOADS=lora bench/trees.sh A B  # the servers in float32 (default bfloat16)
#
# Each tree's server runs from its own `runtime/` (PYTHONPATH) with this repo's venv (OURS_BIN); the clients
# are this repo's. Workloads, as in compare_vllm.sh: online (64 requests at c16 and C1_REQUESTS at c1, 128
# in / 128 out), overhead (the no-cost model, OV_REQUESTS at c48), long (16 prompts of 1,536 tokens at
# c4), lora (4 rank-16 adapters mixed at c16, then a server without adapters on the same traffic for the
# base model: lora-nolora), mixed (8 chat streams among long prompts, MIXED_SECONDS). Prints each
# workload's figure per run and the mean ratio after/before; the spread of a tree's two runs is the
# drift to read it against.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# = 2 ] || { sed -n 2,9p "$0" >&2; exit 2; }
declare -A trees=([a]="$(cd "$1" && pwd)" [b]="$(cd "$2" && pwd)")
peer=${PEER_BENCH:-$root/../shared/bench}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${MODEL:-$cache/model-small}
overhead_model=$cache/model-overhead
lora_dir=$cache/lora-$(basename "$model")-r16
ours=${OURS_BIN:-$root/.venv/bin}
order=${ORDER:-a b b a}
workloads=${WORKLOADS:-online overhead long lora mixed}
c1_requests=${C1_REQUESTS:-8}
ov_requests=${OV_REQUESTS:-576}
mixed_seconds=${MIXED_SECONDS:-45}
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
args=(--max-input-tokens 1024 --max-total-tokens 2048 --max-batch-size 64)
long_args=(--max-input-tokens 2048 --max-total-tokens 2304 --max-batch-size 16)
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
[ -f "$model/config.json" ] && [ -f "$overhead_model/config.json" ] \
  || { echo "run bench/compare_vllm.sh once first (it builds $model and $overhead_model)" >&2; exit 2; }
"$ours/python" -m gaudi_runtime.bench.lora_adapters "$model" "$lora_dir" --count 4 --rank 16 >/dev/null

# shellcheck source=bench/server.sh
source "$root/bench/server.sh"
: >"$out/results.txt"

start() {  # $1: tree label; $2: log name; $3: model; $4...: launch arguments
  EXPONENTIAL_BUCKETING=true PYTHONPATH="${trees[$1]}/runtime:${trees[$1]}/operator:$root" setsid \
    "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" --model-id "$3" --dtype "${DTYPE:-bfloat16}" \
    --hostname 127.0.0.1 --port "$port" "${@:4}" >"$out/$2.log" 2>&1 &
  server=$!
  wait_ready /health "$out/$2.log"
}

record() {  # $1: tree; $2: run; $3: workload; stdin: RESULT lines
  sed "s/^RESULT /RESULT tree=$1 run=$2 workload=$3 /" | grep '^RESULT' | tee -a "$out/results.txt"
}

workload() {  # $1: tree; $2: run; $3: workload
  local t=$1 r=$2 names=a1,a2,a3,a4 modules=()
  case $3 in
    online) start "$t" "$t$r-online" "$model" "${args[@]}"
      "$ours/python" "$peer/online_load.py" "$url" "$model" 64 16 128 128 | record "$t" "$r" c16
      "$ours/python" "$peer/online_load.py" "$url" "$model" "$c1_requests" 1 128 128 | record "$t" "$r" c1 ;;
    overhead) start "$t" "$t$r-overhead" "$overhead_model" "${args[@]}"
      "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile constant --users 48 --requests 96 \
        --prompt-tokens 128 --output-tokens 16 --ignore-eos --seed 1 --tokenizer "$overhead_model" \
        --model "$overhead_model" --no-progress >/dev/null
      "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile constant --users 48 --requests "$ov_requests" \
        --prompt-tokens 128 --output-tokens 128 --ignore-eos --seed 48 --tokenizer "$overhead_model" \
        --model "$overhead_model" --no-progress --json "$out/$t$r-overhead.json" >/dev/null
      "$ours/python" -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("RESULT tok/s=%.1f" % d["steps"][0]["throughput"]["output_tokens_per_s"])' "$out/$t$r-overhead.json" | record "$t" "$r" overhead ;;
    long) start "$t" "$t$r-long" "$model" "${long_args[@]}"
      "$ours/python" "$peer/online_load.py" "$url" "$model" 16 4 1536 128 | record "$t" "$r" long ;;
    lora) for i in 1 2 3 4; do modules+=("a$i=$lora_dir/a$i"); done
      start "$t" "$t$r-lora" "$model" "${args[@]}" --lora-modules "${modules[@]}" --max-loras 4 --max-lora-rank 16
      "$ours/python" -m gaudi_runtime.bench.online --url "$url" --model-dir "$model" --requests 64 \
        --concurrency 16 --input-len 128 --output-len 128 --models "$names" | record "$t" "$r" lora-mixed
      stop_server
      start "$t" "$t$r-nolora" "$model" "${args[@]}"
      "$ours/python" -m gaudi_runtime.bench.online --url "$url" --model-dir "$model" --requests 64 \
        --concurrency 16 --input-len 128 --output-len 128 | record "$t" "$r" lora-nolora ;;
    mixed) start "$t" "$t$r-mixed" "$model" "${long_args[@]}"
      "$ours/python" -m gaudi_runtime.bench.mixed --url "$url" --model "$model" --tokenizer "$model" \
        --chat-streams 8 --long-prompt 1536 --long-every 1.5 --duration "$mixed_seconds" | record "$t" "$r" mixed ;;
  esac
  stop_server
}

run=0
for t in $order; do
  run=$((run + 1))
  for w in $workloads; do
    echo "== run $run: tree $t (${trees[$t]}), $w" >&2
    workload "$t" "$run" "$w"
  done
done

# Per workload and metric: each tree's runs, and the mean ratio b/a (higher is better for tok/s).
"$ours/python" - "$out/results.txt" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    for metric in ("tok/s", "ttft_p50_ms", "itl_p50_ms", "chat_tokens_per_s", "chat_gap_p99_ms", "chat_gap_max_ms",
                   "long_ttft_p50_ms"):
        if metric in f:
            runs[(f["workload"], metric, f["tree"])].append(float(f[metric]))
print(f"{'workload':<11} {'metric':<17} {'tree a runs':>22} {'tree b runs':>22} {'b/a':>6}")
for w, m in sorted({(w, m) for w, m, _ in runs}):
    a, b = runs.get((w, m, "a"), []), runs.get((w, m, "b"), [])
    ratio = statistics.mean(b) / statistics.mean(a) if a and b and statistics.mean(a) else float("nan")
    print(f"{w:<11} {m:<17} {' '.join(f'{v:.1f}' for v in a):>22} {' '.join(f'{v:.1f}' for v in b):>22} {ratio:6.2f}")
EOF
echo "logs and results: $out" >&2
