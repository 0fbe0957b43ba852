"""Connector counters, in vLLM's ``KVConnectorStats`` shape (summed across workers)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class UcmRayStats(KVConnectorStats):
    """Monotonic counters for one interval: every value is a number, aggregation sums."""

    totals: dict = field(default_factory=dict)
    """Since start-up (never reset): what ``ucm-ray status``-style tools and tests read."""

    def add(self, **counts: int | float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v
            self.totals[k] = self.totals.get(k, 0) + v

    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

    def aggregate(self, other: KVConnectorStats) -> UcmRayStats:
        merged = Counter(self.data)
        merged.update(other.data)
        self.data = dict(merged)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> UcmRayStats | None:
        """This interval's counters (or None), leaving an empty object behind."""
        if self.is_empty():
            return None
        out = UcmRayStats(data=dict(self.data))
        self.reset()
        return out
