"""Connector counters, in vLLM's ``KVConnectorStats`` shape (summed across workers).

Two kinds of values travel in ``data`` (worker -> scheduler -> vLLM's stat loggers):
- counters, ``name -> number``: summed when intervals or workers are aggregated;
- durations, ``name -> [seconds, ...]`` for names ending in ``_seconds`` (``observe``): one
  observation per worker step, concatenated on aggregation; Prometheus gets them as histograms.

``COUNTERS`` and ``DURATIONS`` document every name the scheduler and worker parts record;
``ucm_ray.vllm.prom`` exports each as ``vllm:ucm_ray_<name>`` (bytes per transport, the
``<loaded|saved>_<transport>_bytes`` family, as ``vllm:ucm_ray_<loaded|saved>_bytes`` with a
``transport`` label). A name missing from the tables is still exported, with a generic help text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS: dict[str, str] = {
    # scheduler side: lookups and the hit policy
    "lookups": "Requests whose tier lookup was answered (the scheduler asked every owning shard once).",
    "lookups_skipped": "Requests not looked up: vLLM's own prefix cache held every block the tier could add.",
    "idle_schedule_us": "Host time (us) of the connector's scheduler hooks in steps that ran no tokens while no "
                        "request waited for a lookup (vLLM stepping while saves land): no forward waited for it, "
                        "so schedule_seconds leaves it out.",
    "lookups_deferred": "Times a request was put back in the queue because its lookup was still in flight.",
    "lookup_calls": "Shard calls the lookups made (answers from this node's published indexes cost none; "
                    "writer-local placement across nodes: the family root's owner, then a pin where the blocks are).",
    "query_tokens": "Prompt tokens of the requests looked up.",
    "hit_tokens": "Prompt tokens the tier provides (external hit after the hit policy): loaded, not computed.",
    "local_hit_tokens": "Prompt tokens vLLM's own prefix cache already had when the tier was asked.",
    "miss_tokens": "Prompt tokens neither vLLM's prefix cache nor the tier had: computed.",
    "recompute_trimmed_tokens": "Tokens the tier had but the hit policy left to recompute (last block tail, "
                                "FULL CUDA graph threshold).",
    "load_blocks": "Blocks scheduled to load from the tier.",
    "disk_hit_blocks": "Of load_blocks, those a shard read from its disk tier into its pool to answer the "
                       "request's lookup (disk hits: promoted, then loaded from the pool like any hit).",
    "disk_promoted_entries": "Entries shards read from their disk tiers into their pools to answer this engine's "
                             "lookups (one per block and tp rank; the hit policy may load fewer: disk_hit_blocks).",
    "disk_promoted_bytes": "Bytes of disk_promoted_entries. Tier-wide disk figures (demotions, bytes used, I/O "
                           "errors, adopted entries) are the shards' (ray_ucm_ray_shard_disk_*).",
    "saved_blocks": "Blocks saved into the tier and sent to their shards to commit.",
    "copies_kept": "Blocks loaded from another node's pool at this node's remote_copy_reads-th read of them (a hot "
                   "prefix's at the first), to be saved again into this node's pool (writer-local placement across "
                   "nodes: a document read on many nodes is served by its copies too, not by its writer's pool alone).",
    "saves_skipped": "Blocks whose save found no write slot granted yet (retried each step until one comes; a cold "
                     "engine's first prompts wait once for the slots asked for at their first token); a mamba "
                     "state without a slot is lost.",
    "saves_dropped": "Blocks never saved: no write slot came for them while their finished request's blocks were kept.",
    "commits_not_visible": "Saved blocks that did not become visible (another engine stored the key first, "
                           "or the grant had lapsed).",
    "lapsed_leases": "Read pins found lapsed at release (should stay 0).",
    # scheduler side: prefill/decode through the tier
    "handoffs": "Decode requests whose kv_transfer_params carried a prefill's announcement (in this engine's "
                "namespace): their lookup waited for the prefill's saves, at most pd_wait_s.",
    "handoff_timeouts": "Decode requests that waited pd_wait_s for their prefill's saves and took a shorter hit "
                        "(vLLM recomputed the rest).",
    "handoff_namespace_mismatches": "Decode requests whose prefill's announcement named another namespace (or "
                                    "could not be read): ignored, their keys could never match this engine's.",
    # worker side: bytes and outcomes
    "loaded_copy_bytes": "Bytes copied from shard pools into vLLM's KV cache (all transports).",
    "saved_copy_bytes": "Bytes copied from vLLM's KV cache into shard pools (all transports).",
    "loaded_blocks": "Blocks whose load completed.",
    "load_failures": "Blocks whose load failed (vLLM recomputes them): dead or hung shard, deadline, checksum, "
                     "stale unpinned entry.",
    "save_failures": "Block copies into a shard that did not land (never committed).",
    "deadline_misses": "Worker steps whose copies missed transfer_timeout_s.",
    "late_reads": "Failed loads whose NIXL read was still in flight (NIXL cannot cancel one): the next step "
                  "waited for it before its forward (at most transfer_timeout_s, else the worker stops).",
    "staging_quarantines": "NIXL staging slabs kept after a staged read timed out with its request in flight, "
                           "until it was over (they count against the staging bound).",
    "save_fences": "Save jobs a step had to wait for before its forward: it reuses blocks they were still "
                   "copying (freed and allocated again). The compute stream waits on the device (shared "
                   "memory on CUDA); elsewhere the host waits.",
    "unwaited_layer_loads": "Layer loads the forward pass never waited for (failed so vLLM recomputes).",
    "checksum_mismatches": "Loaded blocks whose checksum did not match (paranoid mode): removed, recomputed.",
    "stale_loads": "Blocks copied unpinned (found in a same-node shard's published index) whose entry was "
                   "evicted or replaced meanwhile: recomputed.",
}
"""Every counter the connector records, with its Prometheus help text."""

TRANSPORT_BYTES = re.compile(r"^(loaded|saved)_(?!copy_)([a-z0-9]+)_bytes$")
"""``loaded_shm_bytes``, ``saved_nixl_bytes``, ...: bytes per transport (``copy`` is the total)."""

TRANSPORT_BYTES_DOC = {
    "loaded": "Bytes loaded from the tier into vLLM's KV cache, by transport (shm: same node, nixl: other nodes).",
    "saved": "Bytes saved from vLLM's KV cache into the tier, by transport (shm: same node, nixl: other nodes).",
}

DURATIONS: dict[str, str] = {
    "load_seconds": "Per worker step with loads: time spent posting its copies plus time spent waiting for "
                    "them to land (all layers, all pools); copies that landed while the forward pass ran "
                    "cost only their posting.",
    "save_seconds": "Per save job (a step's saves on one worker): from posting its copies to the worker "
                    "seeing them all landed, at one of its next hooks. The engine waits for none of it, unless a "
                    "step reuses blocks still being copied (save_fences).",
    "schedule_seconds": "Per scheduler step that runs tokens and gives the connector work (a lookup, an "
                        "allocation, a finished request, loads or saves to plan, workers' results): host time "
                        "in the connector's scheduler hooks since the previous step's plan. Decode steps with "
                        "none of that (most) record nothing.",
    "handoff_wait_seconds": "Per decode request that carried a prefill's announcement: from its first lookup "
                            "to the hit the prefill announced being there, or pd_wait_s passing.",
}
"""Every duration the connector may record (``observe``), exported as histograms."""


def is_duration(name: str) -> bool:
    return name.endswith("_seconds")


@dataclass
class UcmRayStats(KVConnectorStats):
    """One interval's counters and durations; aggregation sums counters, concatenates durations."""

    totals: dict = field(default_factory=dict)
    """Since start-up (never reset): what ``ucm-ray status``-style tools and tests read. A duration
    appears here as its running sum (``<name>``) and count (``<name>_count``)."""

    def add(self, **counts: int | float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v
            self.totals[k] = self.totals.get(k, 0) + v

    def observe(self, name: str, seconds: float) -> None:
        """One duration observation (``name`` ends in ``_seconds``), e.g. a step's load time."""
        assert is_duration(name), f"duration names end in _seconds: {name}"
        self.data.setdefault(name, []).append(float(seconds))
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.totals[f"{name}_count"] = self.totals.get(f"{name}_count", 0) + 1

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> UcmRayStats:
        merged: dict[str, Any] = dict(self.data)
        for k, v in other.data.items():
            if isinstance(v, list):
                merged[k] = [*merged.get(k, []), *v]  # copies: never extend a list another payload holds
            else:
                merged[k] = merged.get(k, 0) + v
        self.data = merged
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: counters as they are, durations as count, mean, p99."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):
                if v:
                    ordered = sorted(v)
                    out[f"{k}_count"] = len(v)
                    out[f"{k[:-len('_seconds')]}_avg_ms"] = round(1e3 * sum(v) / len(v), 3)
                    out[f"{k[:-len('_seconds')]}_p99_ms"] = round(1e3 * ordered[min(len(v) - 1, int(0.99 * len(v)))], 3)
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> UcmRayStats | None:
        """This interval's counters (or None), leaving an empty object behind."""
        if not self.data or self.is_empty():  # most decode steps: nothing since the last take, no call
            return None
        out = UcmRayStats(data=dict(self.data))
        self.reset()
        return out
