#!/usr/bin/env bash
# N-gram speculation (--speculate) against plain decoding, on the same server settings, model and
# traffic, one after the other; prints tokens/s of each and the ratio, and the drafts' acceptance.
#
#   bench/speculation.sh                  # bfloat16; DTYPE=float32 on a CPU without avx512_bf16
#   SPECULATE=3 C1_REQUESTS=8 C16_REQUESTS=64 bench/speculation.sh
#
# Traffic: streaming /v1/completions (../shared/bench/online_load.py: random-token prompts of IN tokens,
# OUT new tokens, EOS ignored, greedy), C1_REQUESTS at concurrency 1, then C16_REQUESTS at concurrency 16.
# The reference `small` model has random weights: its greedy output falls into loops after a few dozen
# tokens, output that repeats itself, which is what n-gram drafts predict (the acceptance printed says
# how well). Targets (issue 38): >= 1.5x tokens/s at concurrency 1, >= 0.95x at concurrency 16.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=${PEER_BENCH:-$root/../shared/bench}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gaudi-serve-bench
model=${MODEL:-$cache/model-small}
dtype=${DTYPE:-bfloat16}
speculate=${SPECULATE:-3}
c1_requests=${C1_REQUESTS:-8}
c16_requests=${C16_REQUESTS:-64}
in_tokens=${IN:-128}
out_tokens=${OUT_TOKENS:-256}
ours=${OURS_BIN:-$root/.venv/bin}
out=${OUT:-$(mktemp -d)}
port=${PORT:-18080}
url=http://127.0.0.1:$port
mkdir -p "$out"
ours_args=${OURS_ARGS:---max-input-tokens 1024 --max-total-tokens 2048 --max-batch-size 64}

[ -x "$ours/gaudi-serve" ] || { echo "run 'make venv' first" >&2; exit 2; }
[ -f "$model/config.json" ] || "$ours/python" "$peer/make_bench_model.py" "$model" small >&2

# shellcheck source=bench/server.sh
source "$root/bench/server.sh"

start_ours() {  # $1: log file; $2...: extra `launch` arguments
  # shellcheck disable=SC2086  # OURS_ARGS is a list
  EXPONENTIAL_BUCKETING=true setsid "$ours/gaudi-serve" launch --shard-uds-path "$out/shard" --model-id "$model" \
    --dtype "$dtype" --hostname 127.0.0.1 --port "$port" $ours_args "${@:2}" >"$1" 2>&1 &
  server=$!
  wait_ready /health "$1"
}

for mode in plain spec; do
  extra=()
  [ "$mode" = plain ] || extra=(--speculate "$speculate")
  echo "== $mode ${extra[*]}" >&2
  start_ours "$out/$mode-server.log" "${extra[@]}"
  for c in 1 16; do
    n=$c1_requests; [ "$c" = 1 ] || n=$c16_requests
    "$ours/python" "$peer/online_load.py" "$url" "$model" "$n" "$c" "$in_tokens" "$out_tokens" \
      | sed "s/^RESULT /RESULT mode=$mode c=$c /" | tee -a "$out/results.txt"
  done
  curl -sf "$url/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' \
    | sed "s|^|METRIC |" | tee -a "$out/results.txt" || true
  stop_server
done

"$ours/python" - "$out/results.txt" <<'PY'
import re, sys
res, spec = {}, {}
for line in open(sys.argv[1]):
    if line.startswith("RESULT"):
        kv = dict(re.findall(r"(\S+?)=(\S+)", line))
        res[(kv["mode"], kv["c"])] = float(kv["tok/s"])
    elif line.startswith("METRIC"):
        name, value = line.split()[1].split("{")[0], float(line.split()[-1])
        spec[name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")] = value
for c, target in (("1", 1.5), ("16", 0.95)):
    p, s = res.get(("plain", c)), res.get(("spec", c))
    if p and s:
        print(f"concurrency {c:>2}: plain {p:8.1f} tok/s, speculate {s:8.1f} tok/s, ratio {s / p:.2f} "
              f"({'met' if s / p >= target else 'MISSED'}: target >= {target})")
if spec.get("draft_tokens"):
    print(f"drafts {spec['drafts']:.0f}, draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f} "
          f"({100 * spec['accepted_tokens'] / spec['draft_tokens']:.0f}%), mean accepted length "
          f"{1 + spec['accepted_tokens'] / max(1, spec['drafts']):.2f}")
PY
echo "logs: $out" >&2
