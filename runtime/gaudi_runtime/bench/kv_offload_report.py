"""The KV-tier benchmark's numbers (pure, but for reading and writing files): tier sizes, a run's summary,
two runs' greedy outputs compared, and bench/kv_offload.sh's table of ratios against issue 47's targets.

    python -m gaudi_runtime.bench.kv_offload_report size MODEL_DIR TOKENS [--dtype bfloat16]
    python -m gaudi_runtime.bench.kv_offload_report compare A.jsonl B.jsonl
    python -m gaudi_runtime.bench.kv_offload_report table OUT_DIR

`size` prints the GiB that TOKENS tokens of KV cache take for the model (what --kv-offloading-size
asks for). `table` reads the reports bench/kv_offload.sh wrote into OUT_DIR: LABEL.json (the
`bench.returning` report), LABEL.jsonl (its answers) and skipped.txt (`LABEL reason` lines).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from gaudi_runtime.bench.stats import fmt, json_safe, table

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The runs bench/kv_offload.sh makes, in the table's order: (label, what it is).
RUNS = (("none", "ours, no tier"), ("host", "ours, host tier"), ("disk-build", "ours, disk tier: build"),
        ("disk-return", "ours, disk tier after restart"), ("cold-return", "ours, cold server"),
        ("vllm", "vLLM, --kv-offloading-size"))
# (what, numerator run, denominator run, report key, target, "max" or "min")
TARGETS = (("returning TTFT p50, host tier / none", "host", "none", "returning_ttft_p50", 0.3, "max"),
           ("throughput, host tier / none", "host", "none", "tokens_per_s", 1.3, "min"),
           ("first returning TTFT p50 after restart, disk / cold", "disk-return", "cold-return",
            "returning_ttft_p50", 0.4, "max"),
           ("returning TTFT p50, ours host tier / vLLM offloading", "host", "vllm", "returning_ttft_p50", 1.0, "max"))
SAME_OUTPUTS = (("host", "none"), ("disk-return", "cold-return"))


def kv_bytes_per_token(config: dict, dtype: str = "bfloat16") -> int:
    """Bytes one token's keys and values take across the model's layers (a Hugging Face config.json)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def gib(tokens: int, bytes_per_token: int) -> float:
    return tokens * bytes_per_token / 2**30


def tier_metric_lines(metrics_text: str) -> list[str]:
    """The /metrics samples whose names mention `kv_offload` or `tier` (names not fixed: read loosely)."""
    out = []
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line and not line.startswith("#") and ("kv_offload" in name or "tier" in name):
            out.append(line)
    return out


def render(r: dict) -> str:
    """A run's summary for a reader: what was sent, TTFT of first and returning turns, throughput, hits."""
    first, back = r["first_ttft_ms"], r["returning_ttft_ms"]
    lines = [f"phase {r['phase']}: {r['conversations']} conversations ({r['shape']}), {r['ok']}/{r['requests']} ok"
             + (f", errors {r['errors']}" if r["errors"] else "") + f", {fmt(r['seconds'])} s",
             f"device budget {r['device_budget'] or 'unknown'} tokens; histories after the first turn "
             f"{r['history_tokens']} tokens" + (f" ({r['budget_multiple']:.1f}x)" if r["budget_multiple"] else "")]
    if first["count"]:
        lines.append(f"first turns: TTFT p50 {fmt(first['p50'], 1)} ms, p90 {fmt(first['p90'], 1)} ms "
                     f"({first['count']})")
    lines.append(f"returning turns: TTFT p50 {fmt(back['p50'], 1)} ms, p90 {fmt(back['p90'], 1)} ms "
                 f"({back['count']}); {fmt(r['returning_tokens_per_s'], 1)} output tokens/s")
    lines.append(f"whole run: {fmt(r['tokens_per_s'], 1)} output tokens/s")
    for when, hits in r["prefix_cache"].items():
        if hits is not None:
            lines.append(f"prefix cache, {when} turns: {fmt(100 * hits['hit_rate'], 1)}% of prompt tokens found "
                         f"({hits['hits']:.0f} of {hits['queries']:.0f})")
    return "\n".join(lines)


def result_line(r: dict) -> str:
    hits = (r["prefix_cache"].get("returning") or {}).get("hit_rate")
    return (f"RESULT phase={r['phase']} conversations={r['conversations']} requests={r['requests']} ok={r['ok']} "
            f"seconds={r['seconds']:.2f} tok/s={r['tokens_per_s']:.1f} "
            f"returning_tok/s={r['returning_tokens_per_s']:.1f} "
            f"first_ttft_p50_ms={r['first_ttft_ms']['p50']:.1f} "
            f"returning_ttft_p50_ms={r['returning_ttft_ms']['p50']:.1f} "
            f"returning_ttft_p90_ms={r['returning_ttft_ms']['p90']:.1f} "
            f"returning_hit_rate={'n/a' if hits is None or math.isnan(hits) else f'{hits:.3f}'}")


def write_report(r: dict, path: str) -> None:
    """The report without the answers' texts (those go to write_outputs)."""
    turns = [{k: v for k, v in t.items() if k != "text"} for t in r["turns"]]
    Path(path).write_text(json.dumps(json_safe({**r, "turns": turns}), indent=1) + "\n")


def write_outputs(r: dict, path: str) -> None:
    rows = sorted((t["conversation"], t["turn"], t["text"]) for t in r["turns"] if t["status"] == "ok")
    Path(path).write_text("".join(json.dumps({"conversation": c, "turn": t, "text": x}) + "\n" for c, t, x in rows))


def load_outputs(path) -> dict[tuple[int, int], str]:
    rows = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return {(d["conversation"], d["turn"]): d["text"] for d in rows}


def compare_outputs(a: dict[tuple[int, int], str], b: dict[tuple[int, int], str]) -> tuple[bool, str]:
    """(identical, what differs first): the same answers to the same turns, none missing on either side."""
    if not a and not b:
        return False, "no answers to compare"
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            return False, f"conversation {key[0]} turn {key[1] + 1} answered by one run only"
        if a[key] != b[key]:
            return False, f"conversation {key[0]} turn {key[1] + 1} differs: {a[key][:40]!r} vs {b[key][:40]!r}"
    return True, f"{len(a)} answers identical"


def metric(r: dict, key: str) -> float:
    if key == "returning_ttft_p50":
        v = r["returning_ttft_ms"]["p50"]
    else:
        v = r[key]
    return math.nan if v is None else float(v)


def absent(labels: list[str], skipped: dict[str, str]) -> str:
    return ", ".join(f"{x} {'skipped' if x in skipped else 'not run'}" for x in labels)


def ratio_lines(reports: dict[str, dict], skipped: dict[str, str]) -> list[str]:
    """One line per target: the ratio and met / MISSED, or why it could not be computed."""
    out = []
    for what, num, den, key, target, kind in TARGETS:
        missing = [x for x in (num, den) if x not in reports]
        if missing:
            out.append(f"{what}: not measured ({absent(missing, skipped)})")
            continue
        n, d = metric(reports[num], key), metric(reports[den], key)
        ratio = n / d if d else math.nan
        ok = ratio <= target if kind == "max" else ratio >= target
        sign = "<=" if kind == "max" else ">="
        out.append(f"{what}: {fmt(ratio)} (target {sign} {target}) "
                   f"{'met' if ok and not math.isnan(ratio) else 'MISSED'}")
    return out


def output_lines(outputs: dict[str, dict], skipped: dict[str, str]) -> list[str]:
    out = []
    for a, b in SAME_OUTPUTS:
        if a in outputs and b in outputs:
            same, detail = compare_outputs(outputs[a], outputs[b])
            out.append(f"greedy outputs identical, {a} vs {b}: {'yes' if same else 'NO'} ({detail})")
        else:
            missing = [x for x in (a, b) if x not in outputs]
            out.append(f"greedy outputs identical, {a} vs {b}: not compared ({absent(missing, skipped)})")
    return out


def run_rows(reports: dict[str, dict], skipped: dict[str, str]) -> list[list[str]]:
    rows = []
    for label, what in RUNS:
        r = reports.get(label)
        if r is None:
            rows.append([label, what, "skipped" if label in skipped else "not run", *["-"] * 5])
            continue
        hits = (r["prefix_cache"].get("returning") or {}).get("hit_rate")
        rows.append([label, what, f"{r['ok']}/{r['requests']}", fmt(r["first_ttft_ms"]["p50"], 1),
                     fmt(r["returning_ttft_ms"]["p50"], 1), fmt(r["returning_ttft_ms"]["p90"], 1),
                     fmt(r["tokens_per_s"], 1), "n/a" if hits is None else fmt(100 * hits, 1)])
    return rows


def summary_table(reports: dict[str, dict], outputs: dict[str, dict], skipped: dict[str, str]) -> str:
    header = ["run", "server", "ok", "first TTFT p50", "return TTFT p50", "return TTFT p90", "out tok/s",
              "return hit %"]
    lines = [table(header, run_rows(reports, skipped), left=2)]
    lines += [f"{label} skipped: {why}" for label, why in skipped.items()]
    lines += [f"{label} metric: {m}" for label, _ in RUNS for m in reports.get(label, {}).get("tier_metrics", [])]
    return "\n".join([*lines, "", *ratio_lines(reports, skipped), *output_lines(outputs, skipped)])


def read_dir(out: Path) -> tuple[dict, dict, dict]:
    """The reports, answers and skip reasons bench/kv_offload.sh left in `out`."""
    reports, outputs, skipped = {}, {}, {}
    for label, _ in RUNS:
        if (out / f"{label}.json").exists():
            reports[label] = json.loads((out / f"{label}.json").read_text())
        if (out / f"{label}.jsonl").exists():
            outputs[label] = load_outputs(out / f"{label}.jsonl")
    if (out / "skipped.txt").exists():
        for line in (out / "skipped.txt").read_text().splitlines():
            label, _, why = line.partition(" ")
            skipped[label] = why
    return reports, outputs, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gaudi_runtime.bench.kv_offload_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("size", help="GiB of KV cache that TOKENS tokens take")
    s.add_argument("model_dir")
    s.add_argument("tokens", type=int)
    s.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    c = sub.add_parser("compare", help="are two runs' answers identical")
    c.add_argument("a")
    c.add_argument("b")
    t = sub.add_parser("table", help="bench/kv_offload.sh's table")
    t.add_argument("out_dir")
    a = p.parse_args(argv)
    if a.cmd == "size":
        config = json.loads((Path(a.model_dir) / "config.json").read_text())
        print(f"{gib(a.tokens, kv_bytes_per_token(config, a.dtype)):.6g}")
        return 0
    if a.cmd == "compare":
        same, detail = compare_outputs(load_outputs(a.a), load_outputs(a.b))
        print(f"outputs identical: {'yes' if same else 'no'} ({detail})")
        return 0 if same else 1
    print(summary_table(*read_dir(Path(a.out_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
