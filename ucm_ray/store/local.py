"""LocalBlockStore: the BlockStore rules in one process, without Ray.

It runs both halves of the store in one process: the shard side's ``BlockIndex`` and
published-index writer, and the engine side's published-index readers, which is why it
lives beside them at ``store/`` rather than in ``store/engine/`` or ``store/shard/``.
Shards here are plain objects: a real shared-memory pool file (so workers reach
it through the same ``PoolConnections`` as a Ray shard's) and the same
``BlockIndex``. Calls answer at once. It exists so that both halves of the
connector can be driven together in a fast test (``ucm_ray.testing.harness``),
and it can play the faults the Ray store must survive: a shard that stops
answering, or one that restarts empty under a new incarnation.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.placement import owners
from ucm_ray.store.published_layout import index_path
from ucm_ray.store.shard.index import BlockIndex
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.store.types import (
    Done,
    Location,
    Locations,
    Pending,
    Pools,
    Publishes,
    ReadLease,
    Removal,
    SlotGrant,
    grant_items,
    random_id,
)
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.shm import SharedPool

LOCAL_NODE = "local"
"""The node id of every local pool: give it to the worker's ``PoolConnections``."""


@dataclass
class _LocalShard:
    shard_id: str
    incarnation: int
    pool: SharedPool
    published: PublishedIndex
    index: BlockIndex
    answering: bool = True

    @property
    def key(self) -> PoolKey:
        return (self.shard_id, self.incarnation)

    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(shard_id=self.shard_id, node_id=LOCAL_NODE, pool_bytes=self.pool.size,
                              shm_path=self.pool.path, nixl_agent=None, nixl_metadata=None,
                              pool_base_addr=self.pool.tensor.data_ptr(), incarnation=self.incarnation,
                              index_path=self.published.path)

    def close(self) -> None:
        self.pool.close()
        self.published.close()


class LocalBlockStore(BlockStore):
    """``num_shards`` in-process shards of ``pool_bytes`` each, shared by every client made
    with ``client()`` (each client has its own owner id, as separate engines do)."""

    def __init__(self, num_shards: int = 2, pool_bytes: int = 64 << 20, *, replication: int = 1,
                 lease_s: float = 60.0, reserve_timeout_s: float = 60.0, shm_dir: str = "/dev/shm",
                 clock: Callable[[], float] = time.monotonic, _shared: LocalBlockStore | None = None) -> None:
        """``clock``: the shards' time for their leases and grants (a test may share one it
        moves with the engines' schedulers: ``make_engine(clock=...)``)."""
        self.owner = random_id()
        self._readers = IndexReaders(LOCAL_NODE)
        self._readers_version = -1
        self._world: _World = _shared._world if _shared is not None else \
            _World(pool_bytes, replication, lease_s, reserve_timeout_s, shm_dir, clock)
        if _shared is not None:
            return
        for i in range(num_shards):
            self._world.start(f"local_shard_{i}")

    def client(self) -> LocalBlockStore:
        """Another client of the same shards (another engine)."""
        return LocalBlockStore(_shared=self)

    # --- faults --------------------------------------------------------------------------

    def restart(self, shard_id: str) -> PoolKey:
        """The shard dies and starts again empty, under a new incarnation and a new pool."""
        return self._world.start(shard_id)

    def set_answering(self, shard_id: str, answering: bool) -> None:
        """A shard that does not answer: every call to it is a miss, as a timed-out one is."""
        self._world.shards[shard_id].answering = answering

    def index(self, shard_id: str) -> BlockIndex:
        return self._world.shards[shard_id].index

    def pool_of(self, location: Location) -> SharedPool:
        """The pool a location points into (to corrupt bytes on purpose)."""
        shard = self._world.shards[location.shard_id]
        assert shard.incarnation == location.incarnation
        return shard.pool

    # --- BlockStore ----------------------------------------------------------------------

    def pools(self) -> Pools:
        world = self._world
        return Pools(world.version, {s.key: s.descriptor() for s in world.shards.values()}, world.replication)

    def placement(self, keys: Sequence[bytes]) -> tuple[list[PoolKey], np.ndarray]:
        shards = sorted(self._world.shards.values(), key=lambda s: s.shard_id)
        return [s.key for s in shards], owners(keys, [s.shard_id for s in shards], self._world.replication)

    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = (),
                chain: int | None = None, recompute_bytes_s: float = 0.0) -> Pending[ReadLease]:
        """As the Ray client's: each pool's published index first (every pool here is on this
        node), pinned through the index where it cannot answer or ``pin`` asks for pins."""
        self._sync_readers()
        lease = ReadLease(Locations.missing(len(keys)))
        todo = list(range(len(keys)))
        for rank in range(self._world.replication):
            by_shard: dict[PoolKey, list[int]] = defaultdict(list)
            placed = self.owners([keys[i] for i in todo]) if todo else []
            for i, row in zip(todo, placed):
                if rank < len(row):
                    by_shard[row[rank]].append(i)
            failed: list[int] = []
            for pool, idx in by_shard.items():
                shard = self._live(pool)
                if shard is None:
                    failed.extend(idx)
                    continue
                found = None if pool in pin else self._readers.locate(pool, [keys[i] for i in idx])
                if found is not None:
                    hit = lease.locations.put_found(idx, pool, found)
                    unknown = np.flatnonzero(~found.known).tolist()
                    shard.index.touch([keys[idx[i]] for i in hit], len(idx) - len(unknown))
                    idx = [idx[u] for u in unknown]
                    if not idx:
                        continue
                lease_id, slots = shard.index.acquire(self.owner, [keys[i] for i in idx])
                if any(slot is not None for slot in slots):
                    lease.lease_ids.setdefault(pool, []).append(lease_id)
                lease.locations.put_slots(idx, pool, slots)
            todo = failed
        return Done(lease)

    def surely_absent(self, keys: Sequence[bytes]) -> bool:
        self._sync_readers()
        for key, row in zip(keys, self.owners(keys) if keys else []):
            live = [(pool, shard) for pool in row if (shard := self._live(pool)) is not None]  # as ``acquire`` asks
            if not live:
                continue
            found = self._readers.locate(live[0][0], [key])
            if found is None or not found.known[0]:
                continue
            present = bool(found.generation[0])
            live[0][1].index.touch([key] if present else [], 1)
            if not present:
                return True
        return False

    def _sync_readers(self) -> None:
        if self._readers_version != self._world.version:
            self._readers.sync(self.pools().descriptors)
            self._readers_version = self._world.version

    def release(self, lease_ids: Mapping[PoolKey, Sequence[int]]) -> Pending[set[PoolKey]]:
        lapsed = set()
        for pool, ids in lease_ids.items():
            shard = self._live(pool)
            if shard is not None and not all(shard.index.release(self.owner, list(ids))):
                lapsed.add(pool)
        return Done(lapsed)

    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        shard = self._live(pool)
        if shard is None:
            return Done(None)
        token, offsets = shard.index.reserve(self.owner, size, count)
        return Done(SlotGrant(pool, token, size, offsets) if offsets else None)

    def renew(self, grants: Mapping[PoolKey, Sequence[int]]) -> Pending[set[tuple[PoolKey, int]]]:
        lapsed = set()
        for pool, tokens in grants.items():
            shard = self._live(pool)
            held = shard.index.renew(self.owner, list(tokens)) if shard is not None else [False] * len(tokens)
            lapsed |= {(pool, token) for token, ok in zip(tokens, held) if not ok}
        return Done(lapsed)

    def commit(self, publish: Publishes,
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        by_grant = publish.grants
        visible: np.ndarray = np.zeros(len(publish), dtype=bool)
        for grant in set(by_grant) | set(free):
            shard = self._live(grant[0])
            if shard is None:
                continue
            rows = by_grant.get(grant, np.zeros(0, dtype=np.int64))
            items = grant_items([publish.keys[row] for row in rows.tolist()], publish.locations.offset[rows],
                                publish.locations.checksum[rows])
            visible[rows] = shard.index.commit(self.owner, grant[1], items, list(free.get(grant, ())))
        return Done(visible.tolist())

    def remove(self, removals: Sequence[Removal]) -> Pending[int]:
        removed = 0
        for item in removals:
            shard = self._live(item.location.pool)
            if shard is not None:
                removed += shard.index.remove([(item.key, item.location.offset)])
        return Done(removed)

    def suspect(self, pool: PoolKey) -> None:
        """Recorded only (``suspected``): an in-process shard has no backoff to enter."""
        self._world.suspected.add(pool)

    @property
    def suspected(self) -> set[PoolKey]:
        """Pools any client was told to suspect."""
        return self._world.suspected

    def close(self) -> None:
        """Clients share the shards; ``shutdown`` frees them."""

    def shutdown(self) -> None:
        self._readers.close()
        for shard in self._world.shards.values():
            shard.close()
        self._world.shards.clear()

    def _live(self, pool: PoolKey) -> _LocalShard | None:
        """The shard a call is for, if it is that incarnation and answering (else: a miss)."""
        shard = self._world.shards.get(pool[0])
        if shard is None or shard.incarnation != pool[1] or not shard.answering:
            return None
        return shard


@dataclass
class _World:
    """What every client of one LocalBlockStore shares."""

    pool_bytes: int
    replication: int
    lease_s: float
    reserve_timeout_s: float
    shm_dir: str
    clock: Callable[[], float]
    version: int = 0

    def __post_init__(self) -> None:
        self.shards: dict[str, _LocalShard] = {}
        self.suspected: set[PoolKey] = set()

    def start(self, shard_id: str) -> PoolKey:
        old = self.shards.pop(shard_id, None)
        if old is not None:
            old.close()
        path = os.path.join(self.shm_dir, f"ucmray-local-{shard_id}-{uuid.uuid4().hex[:8]}")
        incarnation = random_id()
        pool = SharedPool(path, self.pool_bytes, create=True)
        try:
            published = PublishedIndex(index_path(path), self.pool_bytes, incarnation)
        except BaseException:
            pool.close()
            raise
        shard = _LocalShard(shard_id, incarnation, pool, published,
                            BlockIndex(self.pool_bytes, lease_s=self.lease_s,
                                       reserve_timeout_s=self.reserve_timeout_s, published=published,
                                       clock=self.clock))
        self.shards[shard_id] = shard
        self.version += 1
        return shard.key
