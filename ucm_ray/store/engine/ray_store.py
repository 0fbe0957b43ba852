"""RayBlockStore: the Ray implementation of ``BlockStore``.

Control calls are batched: one Ray call per shard per operation, whatever the
number of keys, queued to a thread of the client's own (``poster``). Bytes never
travel through Ray: the caller copies them through ``PoolConnections`` (shared
memory for same-node shards, NIXL otherwise) between a pin or a reservation and
its release or commit.

Failure rules:
- A shard that errors, times out, or refuses an incarnation is a miss, never an
  error the caller sees (``calls``), and turns suspect for a backoff
  (``suspects``); placement stays over the full membership, so a hiccup never
  moves keys. Only the directory (Ray's death signal) or a new incarnation
  removes a shard.
- Pools are keyed by (shard id, incarnation): a restarted shard is a new pool,
  and the mapping of its predecessor is closed when the membership that shows
  it arrives.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.acquire import Acquire
from ucm_ray.store.engine.calls import Fanout, ShardAccess
from ucm_ray.store.engine.family import FamilyAcquire, HintPoster
from ucm_ray.store.engine.feed import MembershipFeed
from ucm_ray.store.engine.poster import CallPoster
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.engine.suspects import Suspects
from ucm_ray.store.engine.touches import TouchSender
from ucm_ray.store.hot_prefixes import SCAN_BLOCKS
from ucm_ray.store.placement import copy_bound, writer_owners
from ucm_ray.store.placement import owners as place
from ucm_ray.store.pool_load import PoolReads
from ucm_ray.store.types import (
    Done,
    GrantCommit,
    Locations,
    Membership,
    Pending,
    Pools,
    Publishes,
    ReadLease,
    Removal,
    ShardRecord,
    SlotGrant,
    random_id,
    rows_picker,
)
from ucm_ray.transport.base import PoolKey
from ucm_ray.transport.pools import PoolConnections

log = logging.getLogger(__name__)


class RayBlockStore(BlockStore):
    """``BlockStore`` over shard actors: membership from the directory, one Ray call per shard
    per operation, posted from the client's own thread."""

    def __init__(self, config: UcmRayConfig, *, directory: ray.actor.ActorHandle | None = None) -> None:
        self.config = config
        self.owner = random_id()
        node_id = ray.get_runtime_context().get_node_id()
        self._node_id = node_id
        self.connections = PoolConnections(config.transport, node_id, nixl_staging=config.nixl_stage_through_host)
        """The data plane of ``put``/``get`` (public for benchmarks that time copies alone)."""
        self._readers = IndexReaders(node_id if config.local_lookups else None, remote=config.transport != "shm")
        self._suspects = Suspects()
        self._records: dict[PoolKey, ShardRecord] = {}
        self._membership = Membership(0, ())
        self._local: list[bool] = []
        """Per member, whether it is on this client's node (where writer-local saves go)."""
        self._families = False
        """Whether lookups go by family (writer-local placement over more than this node)."""
        self._nodes = 0
        """The fleet's nodes (what a root's owner counts distinct askers against)."""
        self._copy_bound = 0
        """Pools named for a block past which a reader keeps no copy of it (``copy_nodes_per_pool``)."""
        self._pools = Pools(0, {}, config.replication)
        """``pools()``'s answer, made once per membership: the scheduler asks every step."""
        self._replication_warned = False
        self._reads = PoolReads() if config.pick_by_load else None
        """Bytes loaded per pool on another node since the last long poll, which reports them (``pick_by_load``)."""
        self._load: dict[PoolKey, float] = {}
        """The most loaded pools' figures, as the directory last pushed them (``pick_by_load``)."""
        self._feed = MembershipFeed(config.ray_namespace, config.lookup_timeout_s, directory,
                                    node_id if config.relay_membership else None, self._reads)
        first = self._feed.fetch()  # None: no directory yet; every key misses until it appears
        if first is not None:
            self._apply(first)
        # last: its threads start now, and must not outlive a failed start
        self.access = ShardAccess(self.owner, config.lookup_timeout_s, self._suspects, self._readers,
                                  TouchSender(), CallPoster(), disk_tier=bool(config.disk_roots))
        """What this client's calls go through (its ``Acquire`` and ``Fanout`` calls take it)."""
        self._hints = HintPoster(self.access, self._feed.directory, node_id, config.relay_hot_copies)

    # --- membership ----------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self._membership

    def refresh(self, *, force: bool = False) -> None:
        """Adopt a membership change if one was pushed (never blocks: the scheduler calls this
        on its hot path); ``force`` asks the directory now and waits for the answer."""
        if not force:
            self.pools()  # adopts a pushed change
            return
        membership = self._feed.fetch()
        if membership is not None and membership.version != self._membership.version:
            self._apply(membership)

    @property
    def replication(self) -> int:
        """Copies per block: the fleet's (from the directory), this client's own setting only
        when the directory does not say."""
        fleet = self._membership.replication
        return fleet if fleet is not None else self.config.replication

    @property
    def placement_mode(self) -> str:
        """``placement``: the fleet's (from the directory), this client's only when it does not say."""
        fleet = self._membership.placement
        return fleet if fleet is not None else self.config.placement

    def _apply(self, membership: Membership) -> None:
        """Adopt a membership; old incarnations' mappings are closed before any later use."""
        if (membership.replication is not None and membership.replication != self.config.replication
                and not self._replication_warned):
            self._replication_warned = True
            log.warning("replication: the fleet in Ray namespace %r keeps %d cop%s per block; this "
                        "engine's setting (%d) is ignored (replication is set by `ucm-ray up` or the "
                        "Serve app's tier, not per engine)", self.config.ray_namespace,
                        membership.replication, "y" if membership.replication == 1 else "ies",
                        self.config.replication)
        held = self._membership
        self._membership = membership
        if self._reads is not None:
            self._load = membership.pool_load.by_pool(membership.shards)
        if (held.version and membership.replication == held.replication and membership.placement == held.placement
                and [s.key for s in membership.shards] == list(self._records)):
            # the hot-prefix table moved, no shard did: ``pools()`` stays as it was, or every push
            # of readers' copies (once a second at scale) would send every pool's descriptor to the
            # workers again and re-run the slot supply's full tick (``SchedulerPart.build_connector_meta``)
            return
        self._local = [s.pool.node_id == self._node_id for s in membership.shards]
        self._families = self.placement_mode == "writer_local" and not all(self._local)
        self._nodes = len({s.pool.node_id for s in membership.shards})
        self._copy_bound = copy_bound(self._nodes, self.config.copy_nodes_per_pool)
        home = (frozenset(s.key for s, local in zip(membership.shards, self._local) if local)
                if self.placement_mode == "writer_local" and 0 < sum(self._local) < len(self._local) else None)
        self._pools = Pools(membership.version, MappingProxyType(membership.descriptors), self.replication, home)
        self._records = {s.key: s for s in membership.shards}
        self.connections.sync(membership.descriptors)
        self._readers.sync(membership.descriptors)
        self._suspects.retain(set(self._records))

    def _owner_indices(self, keys: Sequence[bytes]) -> np.ndarray:
        """``[key, replica]``: each key's owners over the FULL membership, best first, as indices
        into ``membership.shards`` (suspects included: a shard's hiccup must not move keys);
        under writer-local placement the first is on this node (where this client saves, and
        where a same-node writer saved)."""
        ids = [s.shard_id for s in self._membership.shards]
        if self.placement_mode == "writer_local":
            return writer_owners(keys, ids, self._local, self.replication)
        return place(keys, ids, self.replication)

    def _root_owners(self, roots: Sequence[bytes]) -> list[list[ShardRecord]]:
        """Per family root, the shards that keep its hints (rendezvous over the full membership)."""
        shards = self._membership.shards
        rows = place(roots, [s.shard_id for s in shards], self.replication).tolist() if roots else []
        return [[shards[j] for j in row] for row in rows]

    def _owner_records(self, keys: Sequence[bytes]) -> list[list[ShardRecord]]:
        """As ``_owner_indices``, as records."""
        shards = self._membership.shards
        return [[shards[j] for j in row] for row in self._owner_indices(keys).tolist()] if keys else []

    # --- BlockStore ----------------------------------------------------------------------

    def pools(self) -> Pools:
        # A pushed membership change adopted here, not through another call: the scheduler asks
        # at every step's plan, where with the host's caches cold each call costs
        # (docs/performance-log.md, stop 66); ``refresh`` comes here too.
        membership = self._feed.poll(self._membership)
        if membership is not None and membership.version != self._membership.version:
            self._apply(membership)
        return self._pools

    def placement(self, keys: Sequence[bytes]) -> tuple[list[PoolKey], np.ndarray]:
        return [s.key for s in self._membership.shards], self._owner_indices(keys)

    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = (),
                chain: int | None = None, recompute_bytes_s: float = 0.0) -> Pending[ReadLease]:
        keys = list(keys)
        shards = self._membership.shards
        local = Acquire(self.access, keys, pin, shards, self._owner_indices(keys), recompute_bytes_s)
        if not self._families or not keys:
            return local
        chain_keys = keys if chain is None else keys[:chain]
        hot = self._membership.hot
        hot_rows = hot.leading(chain_keys)
        root = hot.root_position(chain_keys) if chain_keys else 0
        return FamilyAcquire(self.access, keys, pin, shards, local, self._root_owners([keys[root]])[0],
                             [hot.pools[key] for key in keys[:hot_rows]], chain_keys[root:root + SCAN_BLOCKS],
                             self._node_id, self._copy_bound, recompute_bytes_s, self._nodes, self._load)

    def hot_prefix(self, chain: Sequence[bytes]) -> int:
        return self._membership.hot.leading(chain) if self._families else 0

    def remote_rows(self, locations: Locations) -> list[int]:
        if not self._families:
            return []
        remote = [at for at, pool in enumerate(locations.pools)
                  if (rec := self._records.get(pool)) is not None and rec.pool.node_id != self._node_id]
        return np.flatnonzero(np.isin(locations.pool, remote)).tolist() if remote else []

    def loaded(self, locations: Locations) -> None:
        if self._reads is None or not self._families or not len(locations):
            return
        found = locations.pool >= 0
        per_pool = np.bincount(locations.pool[found], weights=locations.size[found], minlength=len(locations.pools))
        remote = {pool: int(size) for pool, size in zip(locations.pools, per_pool.tolist())
                  if size and (rec := self._records.get(pool)) is not None and rec.pool.node_id != self._node_id}
        if remote:
            self._reads.add(remote)

    def surely_absent(self, keys: Sequence[bytes]) -> bool:
        if self._families:
            return False  # another node's writer may hold what this node's indexes lack
        shards = self._membership.shards
        for key, row in zip(keys, self._owner_indices(keys).tolist() if keys else []):
            # the owner ``acquire`` would ask: the first replica not suspect
            rec = next((shards[j] for j in row if not self._suspects.suspect(shards[j])), None)
            if rec is None:
                continue
            generation = self._readers.generation_of(rec.key, key)
            if generation is None:
                continue  # another node's shard, or an index that cannot say: the lookup asks
            present = bool(generation)
            self.access.touches.add(rec.key, rec.handle, [key] if present else [], 1)  # counted as a lookup
            if not present:
                return True
        return False

    def release(self, lease_ids: Mapping[PoolKey, Sequence[int]]) -> Pending[set[PoolKey]]:
        gone: set[PoolKey] = set()
        calls = []
        for pool, ids in lease_ids.items():
            rec = self._records.get(pool)
            if rec is None:
                gone.add(pool)  # dead, or an old incarnation: its pins went with it
            elif ids:
                calls.append((rec, self.access.poster.post(rec.handle.release, pool[1], self.owner, list(ids))))

        def finish(answers: list[Any]) -> set[PoolKey]:
            return gone | {rec.key for (rec, _), a in zip(calls, answers) if a is None or not all(a)}

        return Fanout(self.access, calls, finish)

    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        rec = self._records.get(pool)
        if rec is None or count <= 0 or self._suspects.suspect(rec):
            return Done(None)
        posted = self.access.poster.post(rec.handle.reserve, pool[1], self.owner, [(size, count)])

        def finish(answers: list[Any]) -> SlotGrant | None:
            if answers[0] is None or not answers[0][0][1]:
                return None
            token, offsets = answers[0][0]
            return SlotGrant(pool, token, size, offsets)

        return Fanout(self.access, [(rec, posted)], finish)

    def renew(self, grants: Mapping[PoolKey, Sequence[int]]) -> Pending[set[tuple[PoolKey, int]]]:
        expired: set[tuple[PoolKey, int]] = set()
        calls, asked = [], []
        for pool, tokens in grants.items():
            rec = self._records.get(pool)
            if rec is None:
                expired.update((pool, t) for t in tokens)
            elif tokens:
                calls.append((rec, self.access.poster.post(rec.handle.renew, pool[1], self.owner, list(tokens))))
                asked.append(list(tokens))

        def finish(answers: list[Any]) -> set[tuple[PoolKey, int]]:
            out = set(expired)
            for (rec, _), tokens, ok in zip(calls, asked, answers):
                out.update((rec.key, t) for i, t in enumerate(tokens) if ok is None or not ok[i])
            return out

        return Fanout(self.access, calls, finish)

    def commit(self, publish: Publishes,
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        # per pool, one batch per grant: (token, keys, offsets, checksums, free offsets); and
        # the rows of ``publish`` each batch answers for
        batches: dict[PoolKey, list[GrantCommit]] = defaultdict(list)
        rows_of: dict[PoolKey, list[np.ndarray]] = defaultdict(list)
        grants = publish.grants
        locations = publish.locations
        keys = publish.keys if isinstance(publish.keys, list) else list(publish.keys)
        for (pool, token), rows in grants.items():
            batches[pool].append((token, rows_picker(rows)(keys), locations.offset[rows],
                                  locations.checksum[rows], list(free.get((pool, token), ()))))
            rows_of[pool].append(rows)
        nothing: np.ndarray = np.zeros(0, dtype=np.int64)
        for (pool, token), offsets in free.items():
            if (pool, token) not in grants:
                batches[pool].append((token, [], nothing, nothing, list(offsets)))
                rows_of[pool].append(nothing)
        calls, order = [], []
        for pool, grant_batches in batches.items():
            rec = self._records.get(pool)
            if rec is None:
                continue  # gone: its slots went with it; its publishes stay False
            calls.append((rec, self.access.poster.post(rec.handle.commit, pool[1], self.owner, grant_batches)))
            order.append(rows_of[pool])

        families = self._families

        def finish(answers: list[Any]) -> list[bool]:
            visible: np.ndarray = np.zeros(len(publish), dtype=bool)
            for rows_per_grant, got in zip(order, answers):
                for rows, oks in zip(rows_per_grant, got or []):
                    visible[rows] = oks
            shown = visible.tolist()
            if families and any(shown):
                self._hints.post(publish, shown, self._root_owners)
            return shown

        return Fanout(self.access, calls, finish)

    def remove(self, removals: Sequence[Removal]) -> Pending[int]:
        items: dict[PoolKey, list[tuple[bytes, int]]] = defaultdict(list)
        for r in removals:
            items[r.location.pool].append((r.key, r.location.offset))
        calls = [(self._records[p], self.access.poster.post(self._records[p].handle.remove, p[1], its))
                 for p, its in items.items() if p in self._records]
        return Fanout(self.access, calls, lambda answers: sum(a or 0 for a in answers))

    def suspect(self, pool: PoolKey) -> None:
        self.access.failed(pool, "a worker's transfer failed")

    def close(self) -> None:
        try:
            self.access.close()  # what the engine queued is posted (its last commits)
        finally:
            self.connections.close()
            self._readers.close()
