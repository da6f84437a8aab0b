"""Summary statistics shared by `gaudi-serve benchmark` and `gaudi-serve loadtest` (pure), and the timing
the kernel benchmarks share (`least_ms`, `copies_beyond`)."""

from __future__ import annotations

import json
import math
import time

QUANTILES = (50, 90, 99)


def least_ms(fn, calls: int, repeats: int, clock=time.perf_counter) -> float:
    """The least time of `clock` per call, in ms, over `repeats` rounds of `fn` (which makes `calls`
    calls), after one unrecorded round."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, (clock() - start) / calls)
    return best * 1e3


def copies_beyond(cache_mb: int, nbytes: int) -> int:
    """How many copies of an `nbytes` weight exceed `cache_mb` (cycled, they stream from memory)."""
    return cache_mb * 2**20 // nbytes + 1


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values) -> dict:
    """count, mean, min, max, p50, p90, p99 of `values` (NaN for every statistic when empty)."""
    xs = [float(v) for v in values]
    if not xs:
        return {"count": 0, "mean": math.nan, "min": math.nan, "max": math.nan,
                **{f"p{q}": math.nan for q in QUANTILES}}
    return {"count": len(xs), "mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs),
            **{f"p{q}": percentile(xs, q) for q in QUANTILES}}


STAT_COLUMNS = ("mean", "min", "max", "p50", "p90", "p99")


def fmt(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A Markdown-style table with aligned columns (the first `left` left-aligned, the rest right)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        out = [str(c).ljust(widths[i]) if i < left else str(c).rjust(widths[i]) for i, c in enumerate(cells)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def json_safe(obj):
    """NaN/inf become None so that the JSON output is standard JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(report: dict, path: str) -> None:
    """The report as JSON on stdout (path "-") or in a file."""
    text = json.dumps(json_safe(report), indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
