"""The chart's Grafana dashboard: every query reads only series the runtime exports (checked against
the names a real `Metrics` registry renders), the panels a fleet needs are there, and the chart
ships it, off by default, as a ConfigMap carrying the label Grafana's dashboard sidecar looks for."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gaudi_runtime.router.metrics import LOAD_GAUGES, Metrics
from tests.unit.test_chart import CHART, helm, render  # noqa: F401 (helm is a fixture)

DASHBOARD = CHART / "dashboards" / "gaudi-serve.json"
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")  # a metric name before its label matchers
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")


def exported_series() -> set[str]:
    """Every sample name a runtime's /metrics can show (histograms with their _bucket/_sum/_count)."""
    m = Metrics("tiny")
    m.set_load(1, 2, 0.5)
    for name in ("tgi_batch_inference_duration", "tgi_batch_forward_duration"):
        getattr(m, name).labels(method="decode").observe(0.01)
    m.tgi_request_failure.labels(err="validation").inc()
    names = set()
    for family in text_string_to_metric_families(m.render().decode()):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def queries(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def test_every_query_reads_series_the_runtime_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series()
    used = set()
    for q in queries(dashboard):
        names = SELECTOR.findall(q) + LABEL_VALUES.findall(q)
        assert names, f"no metric found in {q!r}: every selector carries label matchers"
        used.update(names)
    unknown = sorted(used - exported)
    assert not unknown, f"the dashboard queries series the runtime does not export: {unknown}"


def test_the_fleet_panels_are_there() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    text = " ".join(queries(dashboard))
    for series in (*LOAD_GAUGES, "tgi_request_time_to_first_token_duration_bucket", "tgi_request_generated_tokens_sum"):
        assert series in text, series
    titles = [p["title"] for p in dashboard["panels"]]
    assert any("Queue" in t for t in titles) and any("KV" in t for t in titles)
    assert any("first token" in t for t in titles) and any("tokens per second" in t for t in titles)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_chart_ships_it_only_when_asked(helm: str) -> None:  # noqa: F811
    assert not [d for d in render(helm, []) if d["kind"] == "ConfigMap"]
    docs = render(helm, ["--set", "metrics.grafanaDashboard.enabled=true",
                         "--set", "metrics.grafanaDashboard.annotations.grafana_folder=LLM"])
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["gaudi-serve.json"]) == json.loads(Path(DASHBOARD).read_text())
