"""Reading Prometheus text and the Grafana dashboard's PromQL, for the metrics tests."""

from __future__ import annotations

import re
from typing import Any

from tests.support import ROOT

DASHBOARD = ROOT / "deploy/grafana/ucm-ray.json"


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def as_ray_name(vllm_name: str) -> str:
    """What Ray exports for a metric vLLM's Ray stat logger records (``vllm:x`` -> ``ray_vllm_x``)."""
    return "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", vllm_name)


_PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "group", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "le",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers left once strings, label matchers, ranges,
    grouping clauses, function calls, Grafana variables and keywords are taken out."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    s = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", " ", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:])\d+(\.\d*)?([eE][+-]?\d+)?", " ", s)  # numbers: 0.99, 1e-9
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        word = m.group()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query" and query:
            text = query.get("query", "") if isinstance(query, dict) else query
            m = re.match(r"label_values\((.*),\s*[A-Za-z_]+\)$", text.strip())
            if m:
                exprs.append(m.group(1))
    return exprs
