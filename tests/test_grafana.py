"""deploy/grafana/tailserve.json queries only what a live server's /metrics exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server_util import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tailserve.json"

# The series a family of each type exposes besides its own name.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan"}
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, labels and keywords left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, e.g. le="$ttft_slo"
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    names = set()
    for m in _IDENT.finditer(expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("("):  # a function or aggregation
            continue
        if m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(tailserve:x_bucket{instance=~"$i", '
            'le="0.5"}[$__rate_interval]))) / on (job) tailserve:y offset 5m')
    assert metric_names(expr) == {"tailserve:x_bucket", "tailserve:y"}


def _targets(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in sub.get("targets", [])]
    return exprs


def test_dashboard_queries_name_exported_metrics(tiny_model_dir: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with ServerProcess(["--max-num-seqs", "2"], model=tiny_model_dir) as srv:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    exported: set[str] = set()
    le_values: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        exported |= {family.name + s for s in _SUFFIXES.get(family.type, ("",))}
        for sample in family.samples:
            exported.add(sample.name)
            if sample.name.endswith("_bucket"):
                le_values.setdefault(sample.name, set()).add(sample.labels["le"])

    exprs = _targets(dashboard)
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} reads {sorted(names - exported)}, not exported"
        used |= names
    # The list: latency percentiles, KV, queue, preemptions, memory, errors.
    for needed in ("tailserve:time_to_first_token_seconds_bucket",
                   "tailserve:request_time_per_output_token_seconds_bucket",
                   "tailserve:kv_cache_usage_perc", "tailserve:num_requests_waiting",
                   "tailserve:num_preemptions_total", "tailserve:device_memory_used_bytes",
                   "tailserve:request_errors_total"):
        assert needed in used, needed
    assert any(e.startswith("histogram_quantile(") for e in exprs)

    # The SLO targets are bucket boundaries, or le="$target" would match no series.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for var, hist in (("ttft_slo", "time_to_first_token_seconds"),
                      ("tpot_slo", "request_time_per_output_token_seconds")):
        options = {o["value"] for o in variables[var]["options"]}
        assert options <= le_values[f"tailserve:{hist}_bucket"], (var, options)
        assert any(f'le="${var}"' in e for e in exprs), var


def test_prometheus_config_scrapes_metrics() -> None:
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"]


def test_dashboard_panels_have_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
