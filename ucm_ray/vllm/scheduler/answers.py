"""The control calls the scheduler half posted and has not heard back from: commits, releases,
removals, and the lookups of requests that ended before their pins came in.

Nothing here waits: each step's plan collects what arrived (``collect``) and counts what the
answers say; only ``flush`` (tools and tests) waits for them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.types import Pending, Publishes, ReadLease, Removal
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.stats import UcmRayStats

log = logging.getLogger(__package__)

Pins = list[tuple[PoolKey, list[int]]]
"""Read pins as (pool, lease ids) pairs."""


class StoreAnswers:
    """Control calls in flight to the store, and the pins of lookups no request waits for."""

    def __init__(self, store: BlockStore, stats: UcmRayStats) -> None:
        self._store = store
        self._stats = stats
        self._posted: list[tuple[str, Pending[Any]]] = []  # commits, releases, removals in flight
        self._orphans: list[Pending[ReadLease]] = []  # lookups of aborted requests, released on arrival
        self.idle = True
        """Whether nothing is in flight: no call unanswered, no orphaned lookup (an attribute, not
        a property: every step's plan asks, docs/performance-log.md, stop 66)."""

    @property
    def waiting(self) -> bool:
        """Whether a commit, release or removal is still unanswered."""
        return bool(self._posted)

    def _post(self, kind: str, answer: Pending[Any]) -> None:
        self._posted.append((kind, answer))
        self.idle = False

    def commit(self, publish: Publishes, free: dict[tuple[PoolKey, int], list[int]]) -> None:
        self._post("commit", self._store.commit(publish, free))

    def remove(self, removals: list[Removal]) -> None:
        self._post("remove", self._store.remove(removals))

    def release(self, pins: Pins) -> None:
        by_pool: dict[PoolKey, list[int]] = defaultdict(list)
        for pool, ids in pins:
            by_pool[pool].extend(ids)
        if by_pool:
            self._post("release", self._store.release(dict(by_pool)))

    def orphan(self, lookups: list[Pending[ReadLease]]) -> None:
        """Lookups still in flight that no request waits for: released once their pins are in."""
        self._orphans.extend(lookups)
        if lookups:
            self.idle = False

    def collect(self) -> None:
        """Check what the shards said (never waits); release the pins of orphans that arrived."""
        still = []
        for kind, answer in self._posted:
            if not answer.poll():
                still.append((kind, answer))
                continue
            self._count(kind, answer.result())
        self._posted = still
        arrived = [lookup for lookup in self._orphans if lookup.poll()]
        self._orphans = [lookup for lookup in self._orphans if lookup not in arrived]
        self.release([pin for lookup in arrived for pin in lookup.result().lease_ids.items()])
        self.idle = not (self._posted or self._orphans)

    def _count(self, kind: str, result: Any) -> None:
        if kind == "commit":
            # Not visible from this write: another writer stored the key first (or the
            # grant had lapsed): counted, never an error.
            self._stats.add(commits_not_visible=sum(1 for visible in result if not visible))
        elif kind == "release" and result & set(self._store.pools().descriptors):
            # Cannot happen while lease_s > 2 x transfer_timeout_s (checked in the config):
            # the copies were bounded by the step deadline, well inside the lease. (A pool
            # that is gone took its pins with it: nothing lapsed there.)
            lapsed = result & set(self._store.pools().descriptors)
            log.error("ucm-ray: read pins on %s had lapsed before their release", sorted(lapsed))
            self._stats.add(lapsed_leases=len(lapsed))
