"""The metrics' own parts, without an engine: the stats aggregate and reach a real Prometheus
registry, every recorded counter is documented, and the Grafana dashboard charts the panels the
operators asked for with PromQL that names real series (the workload that moves the counters on
live endpoints is ``tests/e2e/test_metrics.py``)."""

from __future__ import annotations

import json

from tests.support import ROOT
from tests.support.prometheus import DASHBOARD, dashboard_exprs, parse_samples, promql_metric_names


def test_promql_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, model_name) (rate(ray_vllm_ucm_ray_load_seconds_bucket'
            '{model_name=~"$model"}[$__rate_interval]))) / on(shard) group_left sum without (WorkerId) '
            '(ray_ucm_ray_shard_capacity_bytes{shard="a:b"}) * 100 > bool 1e-9')
    assert promql_metric_names(expr) == {"ray_vllm_ucm_ray_load_seconds_bucket", "ray_ucm_ray_shard_capacity_bytes"}


def test_dashboard_is_grafana_json_with_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("hit rate", "hit tokens", "load gb/s", "load latency", "pool use", "evictions",
                   "failed loads", "ttft"):
        assert wanted in titles, f"no panel about {wanted!r} in {titles}"
    assert all(promql_metric_names(e) for e in dashboard_exprs(dashboard))
    assert dashboard["uid"] == "ucm-ray" and dashboard["schemaVersion"] >= 30


def test_every_recorded_counter_is_documented():
    """The Prometheus help texts (``stats.COUNTERS``) cover every name the two connector halves
    record, so no counter reaches /metrics without saying what it counts."""
    import ast

    from ucm_ray.vllm.stats import COUNTERS, DURATIONS, TRANSPORT_BYTES

    recorded = set()
    sources = [*(ROOT / "ucm_ray/vllm").glob("scheduler*.py"), *(ROOT / "ucm_ray/vllm").glob("worker*.py"),
               *(ROOT / "ucm_ray/vllm/scheduler").glob("*.py"), *(ROOT / "ucm_ray/vllm/worker").glob("*.py")]
    for source in sources:  # each half, a module or a package of them
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("add", "observe") and "stats" in ast.unparse(node.func.value):
                recorded |= {kw.arg for kw in node.keywords if kw.arg}
                recorded |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    assert recorded, "no stats.add(...) found: the parts moved?"
    undocumented = {n for n in recorded if n not in COUNTERS and n not in DURATIONS and not TRANSPORT_BYTES.match(n)}
    assert not undocumented, f"add these to ucm_ray.vllm.stats.COUNTERS: {sorted(undocumented)}"


def test_stats_aggregate_and_prometheus_observe():
    """Counters sum and durations concatenate across workers; observe() turns one interval into
    counters, per-transport bytes and histogram observations (a real prometheus_client registry)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from ucm_ray.vllm.prom import UcmRayPromMetrics
    from ucm_ray.vllm.stats import UcmRayStats

    worker0, worker1 = UcmRayStats(), UcmRayStats()
    worker0.add(loaded_shm_bytes=100, loaded_copy_bytes=100, loaded_blocks=2)
    worker0.observe("load_seconds", 0.004)
    worker1.add(loaded_nixl_bytes=50, loaded_copy_bytes=50, loaded_blocks=1, load_failures=1)
    worker1.observe("load_seconds", 0.2)
    merged = worker0.take().aggregate(worker1.take())
    assert merged.data == {"loaded_shm_bytes": 100, "loaded_nixl_bytes": 50, "loaded_copy_bytes": 150,
                           "loaded_blocks": 3, "load_failures": 1, "load_seconds": [0.004, 0.2]}
    assert worker0.totals["load_seconds_count"] == 1 and worker0.is_empty()
    reduced = merged.reduce()
    assert reduced["load_seconds_count"] == 2 and reduced["load_p99_ms"] == 200.0

    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=registry, **kw)
        return Bound

    types = {cls: bound(cls) for cls in (Counter, Gauge, Histogram)}

    class _Config:
        kv_transfer_config = None

    prom = UcmRayPromMetrics(_Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(merged.data, 0)
    samples = parse_samples(generate_latest(registry).decode())

    def value(name: str, **labels: str) -> float:
        [v] = [v for n, lab, v in samples if n == name and lab == {"model_name": "m", "engine": "0", **labels}]
        return v

    assert value("vllm:ucm_ray_loaded_bytes_total", transport="shm") == 100
    assert value("vllm:ucm_ray_loaded_bytes_total", transport="nixl") == 50
    assert value("vllm:ucm_ray_loaded_blocks_total") == 3
    assert value("vllm:ucm_ray_load_failures_total") == 1
    assert value("vllm:ucm_ray_hit_tokens_total") == 0  # exists before it moves
    assert value("vllm:ucm_ray_load_seconds_count") == 2
    assert value("vllm:ucm_ray_load_seconds_bucket", le="0.005") == 1
    assert value("vllm:ucm_ray_save_seconds_count") == 0
    assert not any(n.startswith("vllm:ucm_ray_loaded_copy_bytes") for n, _, _ in samples)  # = sum of transports
