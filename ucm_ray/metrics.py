"""Metrics exported through Ray (dashboard + Prometheus ``/metrics``, prefixed ``ray_``).

Shards publish their index figures, tagged ``shard`` and ``node`` (the Ray node id); Ray exports
them as ``ray_ucm_ray_shard_<figure>`` (gauges) and ``ray_ucm_ray_shard_<figure>_total``
(counters), the names ``deploy/grafana/ucm-ray.json`` charts. A counter appears once it first
moves (Ray exports no zero counter).
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any

from ray.util import metrics

GAUGES = {
    "capacity_bytes": "Bytes of the shard's pool.",
    "used_bytes": "Bytes of the pool held by committed entries.",
    "entries": "Committed entries (blocks, states) in the pool.",
    "pending_bytes": "Bytes granted to writers and not yet committed or freed.",
    "quarantined_bytes": "Bytes of lapsed write grants held back until no late write can land.",
    "hints": "Keys this shard can say the pool of (writer-local placement: blocks of the families it roots).",
    "pins": "Entry pins held by read leases not yet released or lapsed.",
}
COUNTERS = {
    "lookups": "Keys readers asked this shard for (the connector's lookups, per key).",
    "hits": "Of the keys asked for, those found (hit rate = hits / lookups).",
    "evictions": "Entries evicted (LRU) to make room.",
    "evicted_bytes": "Bytes of the entries evicted.",
    "dropped_saves": "Write slots refused: no room even after eviction (everything pinned).",
    "commits": "Entries committed (made visible).",
    "duplicate_commits": "Commits of a key already stored (another writer was first): slot freed.",
    "refused_commits": "Commits refused (lapsed or foreign grant).",
    "removals": "Entries removed (failed checksum).",
    "expired_leases": "Read pins that lapsed before their reader released them.",
    "expired_reservations": "Write grants that lapsed before their writer committed.",
    "hints_registered": "Keys writers registered here as committed in their node's pool (writer-local placement).",
    "hints_asked": "Keys readers on other nodes asked this shard where they are.",
    "hints_answered": "Of those, the keys it named a pool for.",
}
TAG_KEYS = ("shard", "node")


class ShardMetrics:
    """Turns a shard's cumulative ``IndexStats`` into Ray gauges and counters."""

    def __init__(self, shard_id: str, node_id: str = "") -> None:
        self._tags = {"shard": shard_id, "node": node_id}
        self._gauges = {n: metrics.Gauge(f"ucm_ray_shard_{n}", description=d, tag_keys=TAG_KEYS)
                        for n, d in GAUGES.items()}
        self._counters = {n: metrics.Counter(f"ucm_ray_shard_{n}_total", description=d, tag_keys=TAG_KEYS)
                          for n, d in COUNTERS.items()}
        self._last: dict[str, int] = {n: 0 for n in COUNTERS}
        self._lock = threading.Lock()  # the shard's metrics thread and its stats() both publish

    def publish(self, stats: Any, extra: dict[str, int] | None = None) -> None:
        """``stats``: the index's ``IndexStats``; ``extra``: the shard's other figures (hints)."""
        with self._lock:
            self._publish({**asdict(stats), **(extra or {})})

    def _publish(self, values: dict[str, Any]) -> None:
        for n, g in self._gauges.items():
            if n in values:
                g.set(values[n], tags=self._tags)
        for n, c in self._counters.items():
            if n not in values:
                continue
            delta = values[n] - self._last[n]
            if delta > 0:
                c.inc(delta, tags=self._tags)
            self._last[n] = values[n]
