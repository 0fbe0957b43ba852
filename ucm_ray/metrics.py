"""Metrics exported through Ray (dashboard + Prometheus ``/metrics``, prefixed ``ray_``).

Shards publish their index counters; the names are the ones the Grafana
dashboard in ``deploy/`` charts.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ray.util import metrics

_GAUGES = ("capacity_bytes", "used_bytes", "entries", "pending_bytes")
_COUNTERS = ("lookups", "hits", "evictions", "evicted_bytes", "dropped_saves", "commits",
             "duplicate_commits", "expired_leases", "expired_reservations")


class ShardMetrics:
    """Turns a shard's cumulative ``IndexStats`` into Ray gauges and counters."""

    def __init__(self, shard_id: str) -> None:
        self._tags = {"shard": shard_id}
        self._gauges = {n: metrics.Gauge(f"ucm_ray_shard_{n}", description=f"shard {n}",
                                         tag_keys=("shard",)) for n in _GAUGES}
        self._counters = {n: metrics.Counter(f"ucm_ray_shard_{n}_total", description=f"shard {n}",
                                             tag_keys=("shard",)) for n in _COUNTERS}
        self._last: dict[str, int] = {n: 0 for n in _COUNTERS}

    def publish(self, stats: Any) -> None:
        values = asdict(stats)
        for n, g in self._gauges.items():
            g.set(values[n], tags=self._tags)
        for n, c in self._counters.items():
            delta = values[n] - self._last[n]
            if delta > 0:
                c.inc(delta, tags=self._tags)
            self._last[n] = values[n]
