"""The engine-overhead table of bench/compare_vllm.sh: each engine's `gaudi-serve loadtest --json`
reports at each concurrency, and our/vLLM ratios of output throughput and TTFT p50.

    python -m gaudi_runtime.bench.overhead_report RUN_DIR [RUN]

RUN_DIR holds `overhead-ENGINE-cN.json` files; ENGINE `vllm` is the reference, every other engine
label (`ours`, `ours-omp1`, ...) gets a ratio against it at the same concurrency.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPORT = re.compile(r"^overhead-(?P<engine>.+)-c(?P<concurrency>\d+)\.json$")
# The goal the workload is measured against: throughput at least this many times vLLM's, TTFT p50 at most.
THROUGHPUT_GOAL, TTFT_GOAL = 1.5, 0.8


def summarize(report: dict) -> dict:
    """Output tokens/s (counted by the server), TTFT p50 and requests ok of a loadtest report's one step."""
    step = report["steps"][0]
    return {"tok_s": step["throughput"]["output_tokens_per_s"], "ttft_p50": step["ttft_ms"]["p50"],
            "ok": step["requests"]["ok"], "sent": step["requests"]["sent"]}


def load(run_dir: Path) -> dict[tuple[str, int], dict]:
    """{(engine, concurrency): summary} of the reports in `run_dir`."""
    found = {}
    for path in sorted(run_dir.glob("overhead-*.json")):
        m = REPORT.match(path.name)
        if m:
            found[(m["engine"], int(m["concurrency"]))] = summarize(json.loads(path.read_text()))
    return found


def table(results: dict[tuple[str, int], dict], run: int = 1) -> list[str]:
    """One line per engine and concurrency; engines other than vLLM with their ratios to it."""
    if not results:
        return []
    lines = [f"{'run':>3}  {'overhead':<18} {'out tok/s':>9} {'TTFT p50':>9} {'ok':>7}  "
             f"{'tok/s ratio':>11} {'TTFT ratio':>10}  target (>= {THROUGHPUT_GOAL}x, <= {TTFT_GOAL}x)"]
    order = sorted(results, key=lambda k: (k[1], k[0] != "vllm", k[0]))
    for engine, conc in order:
        r = results[(engine, conc)]
        ref = results.get(("vllm", conc))
        ratios = ""
        if engine != "vllm" and ref:
            tput, ttft = r["tok_s"] / ref["tok_s"], r["ttft_p50"] / ref["ttft_p50"]
            met = "met" if tput >= THROUGHPUT_GOAL and ttft <= TTFT_GOAL else "MISSED"
            ratios = f"{tput:>11.2f} {ttft:>10.2f}  {met}"
        label, ok = f"{engine} c{conc}", f"{r['ok']}/{r['sent']}"
        lines.append(f"{run:>3}  {label:<18} {r['tok_s']:>9.1f} {r['ttft_p50']:>9.1f} {ok:>7}  {ratios}".rstrip())
    return lines


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    run = int(args[1]) if len(args) > 1 else 1
    for line in table(load(Path(args[0])), run):
        print(line)


if __name__ == "__main__":
    main()
