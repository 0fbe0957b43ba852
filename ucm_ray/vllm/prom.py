"""The connector's statistics on vLLM's Prometheus endpoint (and, under Ray Serve, Ray's).

vLLM asks the connector class for a ``KVConnectorPromMetrics`` (``build_prom_metrics``) in the
process that serves metrics, with the metric classes to use: ``prometheus_client``'s for vLLM's
own ``/metrics`` (names ``vllm:ucm_ray_*``), Ray's wrappers under Ray Serve LLM's
``RayPrometheusStatLogger`` (exported by Ray as ``ray_vllm_ucm_ray_*``). Every logging interval
it hands ``observe`` the interval's ``UcmRayStats.data``, summed over the engine's workers
and its scheduler:
- each counter ``<name>`` increments ``vllm:ucm_ray_<name>`` (exposed as ``..._total``);
- ``<loaded|saved>_<transport>_bytes`` increment ``vllm:ucm_ray_<loaded|saved>_bytes{transport=...}``;
- each duration list ``<name>_seconds`` is observed into the histogram ``vllm:ucm_ray_<name>_seconds``.
Series carry vLLM's own labels (``model_name``, ``engine``) so they line up with vLLM's metrics.
The documented counters exist (at 0) from start-up on vLLM's endpoint; Ray exports a series once
it first moves.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from ucm_ray.vllm.compat import KVConnectorPromMetrics
from ucm_ray.vllm.stats import COUNTERS, DURATIONS, TRANSPORT_BYTES, TRANSPORT_BYTES_DOC, is_duration

PREFIX = "vllm:ucm_ray_"
TRANSPORTS = ("shm", "nixl")
"""Transports whose byte series exist from start-up (others appear when used)."""
LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def metric_names() -> list[str]:
    """Names this module registers with vLLM (before the exposition's ``_total``/``_bucket``)."""
    return ([PREFIX + n for n in COUNTERS if not n.endswith("copy_bytes")]
            + [f"{PREFIX}{what}_bytes" for what in TRANSPORT_BYTES_DOC] + [PREFIX + n for n in DURATIONS])


class UcmRayPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._gauge_cls = metric_types[Gauge]
        self._families: dict[str, Any] = {}
        self._children: dict[tuple[str, int, str], Any] = {}
        for name, doc in COUNTERS.items():
            if not name.endswith("copy_bytes"):  # the sum over transports: sum the labelled series
                self._family(name, doc)
        for what, doc in TRANSPORT_BYTES_DOC.items():
            self._family(f"{what}_bytes", doc, transport=True)
        for name, doc in DURATIONS.items():
            self._family(name, doc)
        for engine in per_engine_labelvalues:  # series at 0 from start-up: rates and panels have data
            for name in COUNTERS:
                if not name.endswith("copy_bytes"):
                    self._child(name, engine)
            for what in TRANSPORT_BYTES_DOC:
                for transport in TRANSPORTS:
                    self._child(f"{what}_bytes", engine, transport)
            for name in DURATIONS:
                self._child(name, engine)

    def _family(self, name: str, doc: str, transport: bool = False) -> Any:
        family = self._families.get(name)
        if family is None:
            labels = list(self._labelnames) + (["transport"] if transport else [])
            if is_duration(name):
                family = self._histogram_cls(name=PREFIX + name, documentation=doc, labelnames=labels,
                                             buckets=LATENCY_BUCKETS)
            else:
                family = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labels)
            self._families[name] = family
        return family

    def _child(self, name: str, engine: int, transport: str = "") -> Any:
        key = (name, engine, transport)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine]) + ([transport] if transport else [])
            child = self._children[key] = self._families[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            if isinstance(value, list):
                if is_duration(name):
                    self._family(name, f"ucm-ray {name}")
                    child = self._child(name, engine_idx)
                    for seconds in value:
                        child.observe(seconds)
                continue
            if not isinstance(value, (int, float)) or value <= 0 or name.endswith("copy_bytes"):
                continue
            m = TRANSPORT_BYTES.match(name)
            if m:
                self._family(f"{m[1]}_bytes", TRANSPORT_BYTES_DOC[m[1]], transport=True)
                self._child(f"{m[1]}_bytes", engine_idx, m[2]).inc(value)
            else:
                self._family(name, COUNTERS.get(name, f"ucm-ray connector counter {name}"))
                self._child(name, engine_idx).inc(value)
