"""Percentiles and summaries shared by `gaudi-serve benchmark` and `loadtest`."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from gaudi_runtime.bench.stats import json_safe, percentile, summarize, table


def test_percentile_interpolates_between_ranks():
    xs = [10, 20, 30, 40]
    assert percentile(xs, 0) == 10
    assert percentile(xs, 100) == 40
    assert percentile(xs, 50) == 25
    assert percentile(xs, 90) == pytest.approx(37)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy_and_ignores_input_order():
    rng = random.Random(3)
    for n in (1, 2, 5, 17, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        shuffled = xs[::-1]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(shuffled, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_rejects_out_of_range():
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_summary_is_ordered_and_complete():
    s = summarize([5, 1, 4, 2, 3])
    assert s == {"count": 5, "mean": 3, "min": 1, "max": 5, "p50": 3, "p90": pytest.approx(4.6),
                 "p99": pytest.approx(4.96)}
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    empty = summarize([])
    assert empty["count"] == 0 and all(math.isnan(empty[k]) for k in ("mean", "min", "max", "p50", "p90", "p99"))


def test_json_safe_turns_nan_into_null():
    out = json.dumps(json_safe({"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}}), allow_nan=False)
    assert json.loads(out) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def test_table_aligns_columns():
    t = table(["Step", "Metric", "Mean"], [["Prefill", "Latency (ms)", "1.00"], ["", "Throughput", "10.0"]], left=2)
    lines = t.splitlines()
    assert len({len(x) for x in lines}) == 1
    assert lines[2].startswith("| Prefill | Latency (ms) | ")
