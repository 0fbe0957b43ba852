"""BlockStore: the control calls of the tier, as the connector's scheduler side uses them.

One owner of the block lifecycle: the engine's scheduler process holds a
``BlockStore`` and does every control call (pin, reserve, commit, release,
remove); workers only move bytes through ``transport.pools.PoolConnections``
and report per-job results back. Two implementations: the Ray client
(``store.engine.ray_store.RayBlockStore``, which ``store.engine.client.StoreClient``
extends: shards are actors) and an in-process one (``store.local.LocalBlockStore``:
a fast test double of the same rules, used by the two-halves harness). The values
the calls take and return live in ``store.types``.

Every call is batched (one call per shard whatever the number of keys) and
returns a ``Pending`` that never blocks on ``poll``. A shard that fails, times
out, or answers for another incarnation is a miss for that call, never an
error the engine sees.

Fencing: every shard start gets a random 63-bit *incarnation*. Locations,
lease ids and slot grants carry the (shard id, incarnation) they belong to; a
shard refuses ids of another incarnation, and a client closes the mapping of
an old incarnation before it maps the new one. Lease ids and grant tokens are
random 63-bit values checked against the ``owner`` that asked for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ucm_ray.store.types import Locations, Pending, Pools, Publishes, ReadLease, Removal, SlotGrant
from ucm_ray.transport.base import PoolKey


class BlockStore(ABC):
    """Control calls of the tier. Not thread-safe: one scheduler thread drives it."""

    owner: int
    """Random 63-bit id of this client; leases and grants are checked against it."""

    @abstractmethod
    def pools(self) -> Pools:
        """Current membership (picks up changes without blocking)."""

    @abstractmethod
    def placement(self, keys: Sequence[bytes]) -> tuple[list[PoolKey], np.ndarray]:
        """Per key, the pools that should hold it (``replication`` of them, fewer if fewer live),
        best first, as a row of indices into the pools returned: a step's saves are placed as
        arrays, not a list per block."""

    def owners(self, keys: Sequence[bytes]) -> list[list[PoolKey]]:
        """``placement`` as lists of pools, for callers that take a few keys."""
        pools, index = self.placement(keys)
        return [[pools[j] for j in row] for row in index.tolist()]

    @abstractmethod
    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = (),
                chain: int | None = None, recompute_bytes_s: float = 0.0) -> Pending[ReadLease]:
        """Locate what is committed among ``keys`` on a live replica: read from the published
        index of a pool on this node (no call, no pin: the reader validates its copy), pinned
        through a call elsewhere and on the pools in ``pin`` (where a reader cannot validate).
        ``chain``: how many leading keys are the prompt's block chain, in order (its first
        attention group: its family root is among them); None: all of them.
        ``recompute_bytes_s``: the asker's prefill rate in KV bytes a second (0.0: unknown): a
        shard reads keys from its disk tier only where that is faster."""

    def hot_prefix(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt's chain are in the fleet's hot-prefix table
        (``store.hot_prefixes``; 0 where there is none). Its family root, whose owner writer-local
        placement tells where the family's blocks went, is the block after them (the first block
        when every block is hot)."""
        return 0

    def remote_rows(self, locations: Locations) -> list[int]:
        """The rows of ``locations`` in pools on another node than this client's (writer-local
        placement across nodes: what a reader keeps copies of, ``remote_copy_reads``); none
        where every pool is on one node."""
        return []

    def loaded(self, locations: Locations) -> None:
        """A load of these entries landed: counted per pool on another node for the fleet's load
        figure (``store.pool_load``; nothing where every pool is on one node)."""
        return None

    @abstractmethod
    def surely_absent(self, keys: Sequence[bytes]) -> bool:
        """Whether some of ``keys`` is surely not stored, as the published index of its owner on
        this node says: no call, no pin (False where no index here can tell). A cold prompt's
        lookup ends on it, before its other keys are even derived."""

    @abstractmethod
    def release(self, lease_ids: Mapping[PoolKey, Sequence[int]]) -> Pending[set[PoolKey]]:
        """Unpin; the result names pools where a lease was not (or no longer) held."""

    @abstractmethod
    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        """Up to ``count`` fresh slots of ``size`` bytes, invisible until published."""

    @abstractmethod
    def renew(self, grants: Mapping[PoolKey, Sequence[int]]) -> Pending[set[tuple[PoolKey, int]]]:
        """Extend reservations still held; the result names (pool, token) that had expired."""

    @abstractmethod
    def commit(self, publish: Publishes,
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        """Publish entries whose bytes landed, return unused or failed slots (``free``, per
        (pool, token)); per publish, whether the key is now visible from this write."""

    @abstractmethod
    def remove(self, removals: Sequence[Removal]) -> Pending[int]:
        """Drop entries found corrupt; a pinned one stops being visible at once and its slot
        is freed when the last pin goes."""

    @abstractmethod
    def suspect(self, pool: PoolKey) -> None:
        """A worker's copies with ``pool`` failed: back off from it until a probe answers."""

    @abstractmethod
    def close(self) -> None: ...
