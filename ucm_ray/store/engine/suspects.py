"""Shards in backoff after a failure: skipped until a cheap probe answers.

A shard that failed a call is *suspect*, not dead: it is skipped (its keys go to the next
replica or are misses) for a backoff of 0.5 s doubling to 10 s, after which one cheap
``ping`` is posted; its answer clears the suspicion. Placement stays over the full
membership, so a hiccup never moves keys. Only the directory (Ray's death signal) or a new
incarnation removes a shard.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from ucm_ray.store.types import ShardRecord
from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0


@dataclass
class _Suspicion:
    backoff_s: float
    until: float
    probe: ray.ObjectRef | None = None


class Suspects:
    """Pools in backoff after a failure; a ``ping`` once the backoff ends clears them."""

    def __init__(self) -> None:
        self._by_pool: dict[PoolKey, _Suspicion] = {}

    def failed(self, pool: PoolKey) -> bool:
        """Start or lengthen ``pool``'s backoff; True when it was not suspect before."""
        s = self._by_pool.get(pool)
        backoff = BACKOFF_START_S if s is None else min(BACKOFF_MAX_S, 2 * s.backoff_s)
        self._by_pool[pool] = _Suspicion(backoff, time.monotonic() + backoff)
        return s is None

    def suspect(self, record: ShardRecord) -> bool:
        """Whether to skip ``record`` now. Never blocks: posts the probe when the backoff
        ended and reads its answer once it came."""
        s = self._by_pool.get(record.key)
        if s is None:
            return False
        if s.probe is None:
            if time.monotonic() >= s.until:
                s.probe = record.handle.ping.remote(record.pool.incarnation)
            return True
        ready, _ = ray.wait([s.probe], timeout=0)
        if not ready:
            return True
        try:
            ray.get(s.probe)
        except RayError:
            self.failed(record.key)
            return True
        del self._by_pool[record.key]
        log.info("shard %s answers again: no longer suspect", record.shard_id)
        return False

    def retain(self, pools: set[PoolKey]) -> None:
        """Forget pools that left the membership (dead, or an old incarnation)."""
        for p in [p for p in self._by_pool if p not in pools]:
            del self._by_pool[p]
