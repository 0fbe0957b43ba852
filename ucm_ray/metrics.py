"""Metrics exported through Ray (dashboard + Prometheus ``/metrics``, prefixed ``ray_``).

Shards publish their index figures, tagged ``shard`` and ``node`` (the Ray node id); Ray exports
them as ``ray_ucm_ray_shard_<figure>`` (gauges) and ``ray_ucm_ray_shard_<figure>_total``
(counters), the names ``deploy/grafana/ucm-ray.json`` charts. A counter appears once it first
moves (Ray exports no zero counter).
"""

from __future__ import annotations

import threading
from typing import Any

from ray.util import metrics

GAUGES = {
    "capacity_bytes": "Bytes of the shard's pool.",
    "used_bytes": "Bytes of the pool held by committed entries.",
    "entries": "Committed entries (blocks, states) in the pool.",
    "pending_bytes": "Bytes granted to writers and not yet committed or freed.",
    "quarantined_bytes": "Bytes of lapsed write grants held back until no late write can land.",
    "hints": "Keys this shard can say the pool of (writer-local placement: blocks of the families it roots).",
    "relay_held": "Keys of readers' hot-prefix copies this shard, as their steward, holds for its next forward.",
    "pins": "Entry pins held by read leases not yet released or lapsed.",
    "disk_capacity_bytes": "Bytes of the shard's disk tier files (disk_bytes, rounded down to 4 KiB).",
    "disk_used_bytes": "Bytes of the disk tier holding entries (and slots awaiting the next manifest).",
    "disk_entries": "Entries on the shard's disk tier.",
    "disk_enabled": "1 while the disk tier runs, 0 once a disk error turned it off.",
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
    "hints_adopted": "Keys handed over by another shard when a prefix of its family root became hot (new root here).",
    "hints_asked": "Keys readers on other nodes asked this shard where they are.",
    "hints_answered": "Of those, the keys it named a pool for.",
    "popular_told": "Reads of a block from another node told it is popular (each keeps a copy and holds one of the "
                    "block's copy_nodes_per_pool places).",
    "popular_confirmed": "Of those, places whose copy the reader's node registered here.",
    "popular_unconfirmed": "Places given back: no copy registered within 10 s of the tell (a hybrid engine, "
                           "remote_copy_reads 0, a failed load).",
    "hot_asks": "Asks of family roots this shard owns, as hot_prefix_asks counts them: one per lookup that asked "
                "where a root's blocks are, whatever its keys (hints are not asks).",
    "hot_blocks_learned": "Blocks this shard found shared by the many askers of a family root it owns (hot prefixes).",
    "relayed_copies": "Keys of readers' hot-prefix copies announced to this shard as their steward (relay_hot_copies).",
    "relay_forwards": "Forwards of those to the directory (one call each, at most one a second).",
    "relayed_polls": "Engines' membership long polls this shard answered as its node's relay (relay_membership).",
    "relay_cannot_say": "Engines' long polls it answered None as their relay (not following the directory, yet or "
                        "any more, or behind the engine): each sends that engine's next poll to the directory.",
    "relay_dropped": "Keys of announced copies dropped: more gathered than a forward holds (a lost announcement).",
    "evicted_dirty": "Evictions, with a disk tier, of entries not yet on disk (demotion fell behind).",
    "disk_demoted": "Entries written from the pool to the disk tier.",
    "disk_demoted_bytes": "Bytes of the entries written to the disk tier.",
    "disk_promoted": "Entries read from the disk tier back into the pool (disk hits).",
    "disk_promoted_bytes": "Bytes of the entries promoted from the disk tier.",
    "disk_promote_misses": "Keys asked of the disk tier that it did not hold or whose bytes failed their check.",
    "disk_promote_late": "Keys left on disk because a lookup had spent its disk_wait_s or its asker's "
                         "lookup timeout (recomputed).",
    "disk_promote_skipped": "Keys not read: their measured read cost was above the asking engine recomputing them "
                            "(its measured rate, or disk_recompute_bytes_s), or would not end within disk_wait_s "
                            "(recomputed).",
    "disk_corrupt": "Disk tier reads whose bytes failed their checksum (dropped; a miss).",
    "disk_io_errors": "Disk I/O errors (the first turns the disk tier off).",
    "disk_adopted": "Entries the disk tier re-adopted from its manifest at start.",
}
TAG_KEYS = ("shard", "node")


class ShardMetrics:
    """Turns a shard's cumulative figures (``IndexStats`` and, with a disk tier, its ``disk_*``
    figures, as ``CacheShard.stats`` reports them) into Ray gauges and counters."""

    def __init__(self, shard_id: str, node_id: str = "") -> None:
        self._tags = {"shard": shard_id, "node": node_id}
        self._gauges = {n: metrics.Gauge(f"ucm_ray_shard_{n}", description=d, tag_keys=TAG_KEYS)
                        for n, d in GAUGES.items()}
        self._counters = {n: metrics.Counter(f"ucm_ray_shard_{n}_total", description=d, tag_keys=TAG_KEYS)
                          for n, d in COUNTERS.items()}
        self._last: dict[str, int] = {n: 0 for n in COUNTERS}
        self._lock = threading.Lock()  # the shard's metrics thread and its stats() both publish

    def publish(self, figures: dict[str, Any]) -> None:
        """Figures a shard lacks (no disk tier: no ``disk_*``) are not exported."""
        with self._lock:
            self._publish(figures)

    def _publish(self, values: dict[str, Any]) -> None:
        for n, g in self._gauges.items():
            if n in values:
                g.set(int(values[n]), tags=self._tags)
        for n, c in self._counters.items():
            if n not in values:
                continue
            delta = values[n] - self._last[n]
            if delta > 0:
                c.inc(delta, tags=self._tags)
            self._last[n] = values[n]
