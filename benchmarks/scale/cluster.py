"""The nodes: one real ``BlockIndex`` pool per node, placed by the real rendezvous ``owners``.

Only the index is driven (no bytes move): its capacity accounting and LRU eviction decide what a
design keeps. Evictions are observed where the real shard reports them to same-node readers, the
published-index hook ``unpublish``: a recorder stands in for the shared-memory table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.scale.workload import BYTES_PER_TOKEN
from ucm_ray.store.placement import owners
from ucm_ray.store.shard.index import BlockIndex
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.testing.clock import AdvancingClock

WRITER = 1
"""The simulation's one client id towards the pools (no two writers race here)."""
_CHUNK = 4096
"""Keys placed per ``owners`` call: a 4,096 x 1,000 score matrix is 32 MiB."""


class _EvictionLog(PublishedIndex):
    """The published index's hooks without the shared memory: what the pool unlisted (evicted)."""

    def __init__(self) -> None:  # no table: nothing here is read by a reader
        self.evicted: list[bytes] = []

    def publish(self, key: bytes, offset: int, size: int, checksum: int | None) -> int:
        return 1

    def unpublish(self, key: bytes) -> None:
        self.evicted.append(key)

    @property
    def wants_refill(self) -> bool:
        return False


def shard_ids(nodes: int) -> list[str]:
    return [f"node-{index}" for index in range(nodes)]


class Placement:
    """``owners`` over the node shards, memoised per key (a prompt's keys recur across requests)."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = list(ids)
        self._primary: dict[bytes, int] = {}
        self._top: dict[tuple[bytes, int], tuple[int, ...]] = {}

    def primary(self, keys: Sequence[bytes]) -> np.ndarray:
        """The owner of each key (index into ``ids``)."""
        missing = list(dict.fromkeys(key for key in keys if key not in self._primary))
        for at in range(0, len(missing), _CHUNK):
            part = missing[at:at + _CHUNK]
            self._primary.update(zip(part, owners(part, self.ids, 1)[:, 0].tolist()))
        return np.fromiter((self._primary[key] for key in keys), dtype=np.int64, count=len(keys))

    def top(self, key: bytes, replicas: int) -> tuple[int, ...]:
        """The best ``replicas`` owners of ``key``, best first."""
        got = self._top.get((key, replicas))
        if got is None:
            got = self._top[(key, replicas)] = tuple(owners([key], self.ids, replicas)[0].tolist())
        return got


def owners_under(keys: Sequence[bytes], ids: Sequence[str]) -> np.ndarray:
    """Primary owners of ``keys`` under another membership (a join or a leave), chunked."""
    out = [owners(keys[at:at + _CHUNK], ids, 1)[:, 0] for at in range(0, len(keys), _CHUNK)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class Cluster:
    """The pools of ``nodes`` nodes and what each holds (a mirror kept in step with evictions)."""

    def __init__(self, nodes: int, pool_bytes: int, block_bytes: int, placement: Placement | None = None) -> None:
        self.nodes = nodes
        self.block_bytes = block_bytes
        self.block_tokens = block_bytes // BYTES_PER_TOKEN
        self.pool_bytes = pool_bytes
        self.clock = AdvancingClock()
        self.placement = placement or Placement(shard_ids(nodes))
        self._logs = [_EvictionLog() for _ in range(nodes)]
        self.pools = [BlockIndex(pool_bytes, lease_s=1e9, reserve_timeout_s=1e9, clock=self.clock,
                                 published=log) for log in self._logs]
        self.stored: list[set[bytes]] = [set() for _ in range(nodes)]

    def has(self, node: int, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` node's pool holds (a read: it makes them recently used)."""
        return self.pools[node].contains(keys) if keys else []

    def read(self, keys: Sequence[bytes], nodes: Sequence[int]) -> None:
        """Read each key from the node beside it (they hold it): one batch per pool, in order."""
        per_node: dict[int, list[bytes]] = {}
        for key, node in zip(keys, nodes):
            per_node.setdefault(node, []).append(key)
        for node, batch in per_node.items():
            self.pools[node].contains(batch)

    def load(self, keys: Sequence[bytes], nodes: Sequence[int]) -> int:
        """A lookup's hit, found by ``has`` (which already made its pool entries recently used),
        is loaded from the node beside each key: nothing more here; a pool with a tier behind it
        brings back what only that tier holds (``benchmarks/scale_evict.py``'s disk tier). The
        blocks loaded, a prefix of ``keys`` (all of them here)."""
        return len(keys)

    def read_hit(self, keys: Sequence[bytes], nodes: Sequence[int]) -> int:
        """``read`` of a lookup's hit: the blocks loaded, a prefix of ``keys`` (all of them here)."""
        self.read(keys, nodes)
        return len(keys)

    def store(self, node: int, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Save ``keys`` into node's pool (reserve, then commit, as a writer does): (the keys
        stored, the keys the pool evicted for them)."""
        keys = [key for key in dict.fromkeys(keys) if key not in self.stored[node]]
        if not keys:
            return [], []
        pool = self.pools[node]
        token, offsets = pool.reserve(WRITER, self.block_bytes, len(keys))
        stored = keys[:len(offsets)]
        if offsets:
            pool.commit(WRITER, token, [(key, offset, None) for key, offset in zip(stored, offsets)])
        log = self._logs[node]
        evicted, log.evicted = log.evicted, []
        self.stored[node].difference_update(evicted)
        self.stored[node].update(stored)
        return stored, evicted

    def evictions(self) -> int:
        return sum(pool.stats().evictions for pool in self.pools)

    def tick(self) -> None:
        self.clock.advance(1.0)
