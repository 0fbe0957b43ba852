"""StoreClient: the Ray implementation of ``BlockStore``, plus whole-tensor put/get.

Control calls are batched: one Ray call per shard per operation, whatever the
number of keys. Bytes never travel through Ray: the client pins or reserves
slots, copies through ``PoolConnections`` (shared memory for same-node shards,
NIXL otherwise), then releases or commits.

Failure rules:
- A shard that errors, times out, or refuses an incarnation is a miss, never an
  error the caller sees, and never a source of bytes that were not verified as
  landed.
- Such a shard is *suspect*, not dead: it is skipped (its keys go to the next
  replica or are misses) for a backoff of 0.5 s doubling to 10 s, after which
  one cheap ``ping`` is posted; its answer clears the suspicion. Placement stays
  over the full membership, so a hiccup never moves keys. Only the directory
  (Ray's death signal) or a new incarnation removes a shard.
- Pools are keyed by (shard id, incarnation): a restarted shard is a new pool,
  and the mapping of its predecessor is closed when the membership that shows
  it arrives.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np
import ray
import torch
from ray.exceptions import RayError, RayTaskError

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import (
    BlockStore,
    Done,
    GrantCommit,
    Location,
    Locations,
    Pending,
    PoolKey,
    Pools,
    Publishes,
    ReadLease,
    Removal,
    SlotGrant,
)
from ucm_ray.store.checksum import checksum
from ucm_ray.store.directory import Membership, ShardRecord
from ucm_ray.store.feed import MembershipFeed
from ucm_ray.store.index import random_id
from ucm_ray.store.placement import owners as place
from ucm_ray.store.poster import CallPoster, PostedCall
from ucm_ray.store.published import IndexReaders
from ucm_ray.store.shard import WrongIncarnation
from ucm_ray.store.touches import TouchSender
from ucm_ray.transport.base import CopyOp, Ranges, as_bytes
from ucm_ray.transport.pools import PoolConnections

log = logging.getLogger(__name__)

T = TypeVar("T")

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


class _Fanout(Pending[T]):
    """One call per shard, queued to the client's ``CallPoster``; ``finish`` merges the answers
    (None: that shard failed)."""

    def __init__(self, client: StoreClient, calls: list[tuple[ShardRecord, Future[PostedCall]]],
                 finish: Callable[[list[Any]], T]) -> None:
        self._client = client
        self._calls = calls
        self._finish = finish
        self._deadline = time.monotonic() + client.config.lookup_timeout_s
        self._value: T | None = None
        self._done = False

    def poll(self) -> bool:
        """Never waits, and only reads futures (a ``ray.wait`` on a call in flight cost ~85 us
        per poll, every step). A call that could not be posted is answered None by ``result``
        at once."""
        if self._done or not self._calls:
            return True
        if time.monotonic() > self._deadline:
            return True
        return all(posted.done() and (posted.exception() is not None or posted.result().answer.done())
                   for _, posted in self._calls)

    def result(self) -> T:
        if not self._done:
            answers = [self._answer(rec, posted) for rec, posted in self._calls]
            self._value = self._finish(answers)
            self._done = True
        return self._value  # type: ignore[return-value]

    def _answer(self, record: ShardRecord, posted: Future[PostedCall]) -> Any:
        try:
            call = posted.result(timeout=max(0.001, self._deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 -- not posted in time, or posting it raised
            self._client._failed(record.key, f"call not posted: {type(e).__name__}")
            return None
        return self._client._get(record, call.answer, self._deadline)


class _Acquire(Pending[ReadLease]):
    """Locates each key on its first owner that is not suspect: in that shard's published index
    when this node has it (no call, nothing pinned), else pinned through a call; keys whose shard
    *fails* move on to the next replica. A plain miss on a live owner is final (asking every
    replica for every miss would double the control traffic of cold prompts). Keys are routed
    as arrays: a lookup of a long prompt costs no Python per key before its answer."""

    def __init__(self, client: StoreClient, keys: list[bytes], pin: Collection[PoolKey]) -> None:
        self._client = client
        self._keys = keys
        self._pin = pin
        self._lease = ReadLease(Locations.missing(len(keys)))
        self._shards = client._membership.shards
        self._owners = client._owner_indices(keys)  # [key, replica] -> index into self._shards
        self._rank: np.ndarray = np.zeros(len(keys), dtype=np.int64)
        self._deadline = time.monotonic() + client.config.lookup_timeout_s
        self._calls: list[tuple[ShardRecord, list[int], ray.ObjectRef]] = []
        self._arrived: list[Future] | None = None  # as in ``_Fanout``: made by the first poll
        self._post(np.arange(len(keys)))

    def _post(self, idx: np.ndarray) -> None:
        c = self._client
        skip = np.array([c._suspects.suspect(rec) for rec in self._shards], dtype=bool)
        chosen: np.ndarray = np.full(len(idx), -1, dtype=np.int64)
        rank = self._rank[idx]
        for r in range(self._owners.shape[1]):
            shard = self._owners[idx, r]
            take = (chosen < 0) & (rank <= r) & ~skip[shard]
            chosen[take] = shard[take]
            rank[take] = r
        self._rank[idx] = np.where(chosen < 0, self._owners.shape[1], rank)
        self._calls = []
        # the shards chosen, by ``bincount``: ``np.unique``'s first call in a process imports
        # ``numpy.ma`` (~10 ms on a fresh engine's first lookup, which its request waits for)
        for shard in np.flatnonzero(np.bincount(chosen[chosen >= 0])).tolist():
            rec = self._shards[shard]
            ix = idx[chosen == shard].tolist()
            keys = [self._keys[i] for i in ix]
            found = None if rec.key in self._pin else c._readers.locate(rec.key, keys)
            if found is not None:
                hit = self._lease.locations.put_found(ix, rec.key, found)
                unknown = np.flatnonzero(~found.known).tolist()
                c._touches.add(rec.key, rec.handle, [keys[i] for i in hit], len(ix) - len(unknown))
                if not unknown:
                    continue
                ix = [ix[u] for u in unknown]
                keys = [keys[u] for u in unknown]
            # posted at once (the step waits for its answer), after what this client queued
            c._poster.drain(c.config.lookup_timeout_s)
            self._calls.append((rec, ix, rec.handle.acquire.remote(rec.pool.incarnation, c.owner, keys)))
        self._arrived = None

    def _collect(self) -> None:
        failed: list[int] = []
        for rec, idx, ref in self._calls:
            got = self._client._get(rec, ref, self._deadline)
            if got is None:
                failed.extend(idx)
                continue
            lease_id, slots = got
            if any(s is not None for s in slots):
                self._lease.lease_ids.setdefault(rec.key, []).append(lease_id)
            self._lease.locations.put_slots(idx, rec.key, slots)
        self._calls = []
        if failed:
            self._rank[failed] += 1
            self._post(np.asarray(failed, dtype=np.int64))

    def poll(self) -> bool:
        while self._calls:
            if self._arrived is None:
                self._arrived = [ref.future() for _, _, ref in self._calls]
            if not all(f.done() for f in self._arrived) and time.monotonic() <= self._deadline:
                return False
            self._collect()
        return True

    def result(self) -> ReadLease:
        while self._calls:
            self._collect()
        return self._lease


class StoreClient(BlockStore):
    def __init__(self, config: UcmRayConfig, *, directory: ray.actor.ActorHandle | None = None) -> None:
        self.config = config
        self.owner = random_id()
        node_id = ray.get_runtime_context().get_node_id()
        self.connections = PoolConnections(config.transport, node_id)
        """The data plane of ``put``/``get`` (public for benchmarks that time copies alone)."""
        self._readers = IndexReaders(node_id if config.local_lookups else None)
        self._suspects = Suspects()
        self._records: dict[PoolKey, ShardRecord] = {}
        self._membership = Membership(0, ())
        self._pools = Pools(0, {}, config.replication)
        """``pools()``'s answer, made once per membership: the scheduler asks every step."""
        self._replication_warned = False
        self._feed = MembershipFeed(config.ray_namespace, config.lookup_timeout_s, directory)
        first = self._feed.fetch()  # None: no directory yet; every key misses until it appears
        if first is not None:
            self._apply(first)
        # last: their threads start now, and must not outlive a failed start
        self._touches = TouchSender()
        self._poster = CallPoster()

    # --- membership ----------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self._membership

    def refresh(self, *, force: bool = False) -> None:
        """Adopt a membership change if one was pushed (never blocks: the scheduler calls this
        on its hot path); ``force`` asks the directory now and waits for the answer."""
        membership = self._feed.fetch() if force else self._feed.poll(self._membership.version)
        if membership is not None and membership.version != self._membership.version:
            self._apply(membership)

    @property
    def replication(self) -> int:
        """Copies per block: the fleet's (from the directory), this client's own setting only
        when the directory does not say."""
        fleet = self._membership.replication
        return fleet if fleet is not None else self.config.replication

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
        self._membership = membership
        self._pools = Pools(membership.version, MappingProxyType(membership.descriptors), self.replication)
        self._records = {s.key: s for s in membership.shards}
        self.connections.sync(membership.descriptors)
        self._readers.sync(membership.descriptors)
        self._suspects.retain(set(self._records))

    def _owner_indices(self, keys: Sequence[bytes]) -> np.ndarray:
        """``[key, replica]``: each key's owners over the FULL membership, best first, as indices
        into ``membership.shards`` (suspects included: a shard's hiccup must not move keys)."""
        return place(keys, [s.shard_id for s in self._membership.shards], self.replication)

    def _owner_records(self, keys: Sequence[bytes]) -> list[list[ShardRecord]]:
        """As ``_owner_indices``, as records."""
        shards = self._membership.shards
        return [[shards[j] for j in row] for row in self._owner_indices(keys).tolist()] if keys else []

    def _get(self, record: ShardRecord, answer: ray.ObjectRef | Future[Any], deadline: float) -> Any:
        """The answer of a shard call (its ref, or the future of a posted one), or None (the
        shard is then suspect) when it failed, timed out by ``deadline``, or refused our
        incarnation (then the membership is refetched)."""
        timeout = max(0.001, deadline - time.monotonic())
        try:
            return answer.result(timeout=timeout) if isinstance(answer, Future) else ray.get(answer, timeout=timeout)
        except TimeoutError:  # a future's wait (``ray.get``'s is a RayError)
            self._failed(record.key, "GetTimeoutError")
            return None
        except RayError as e:
            refused = isinstance(e, RayTaskError) and isinstance(e.cause, WrongIncarnation)
            self._failed(record.key, "refused a stale incarnation" if refused else type(e).__name__)
            return None

    def _failed(self, pool: PoolKey, why: str) -> None:
        if self._suspects.failed(pool):
            log.warning("shard %s failed (%s): suspect, its keys go to replicas or miss", pool[0], why)

    # --- BlockStore ----------------------------------------------------------------------

    def pools(self) -> Pools:
        self.refresh()
        return self._pools

    def placement(self, keys: Sequence[bytes]) -> tuple[list[PoolKey], np.ndarray]:
        return [s.key for s in self._membership.shards], self._owner_indices(keys)

    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = ()) -> Pending[ReadLease]:
        return _Acquire(self, list(keys), pin)

    def surely_absent(self, keys: Sequence[bytes]) -> bool:
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
            self._touches.add(rec.key, rec.handle, [key] if present else [], 1)  # counted as a lookup
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
                calls.append((rec, self._poster.post(rec.handle.release, pool[1], self.owner, list(ids))))

        def finish(answers: list[Any]) -> set[PoolKey]:
            return gone | {rec.key for (rec, _), a in zip(calls, answers) if a is None or not all(a)}

        return _Fanout(self, calls, finish)

    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        rec = self._records.get(pool)
        if rec is None or count <= 0 or self._suspects.suspect(rec):
            return Done(None)
        posted = self._poster.post(rec.handle.reserve, pool[1], self.owner, [(size, count)])

        def finish(answers: list[Any]) -> SlotGrant | None:
            if answers[0] is None or not answers[0][0][1]:
                return None
            token, offsets = answers[0][0]
            return SlotGrant(pool, token, size, offsets)

        return _Fanout(self, [(rec, posted)], finish)

    def renew(self, grants: Mapping[PoolKey, Sequence[int]]) -> Pending[set[tuple[PoolKey, int]]]:
        expired: set[tuple[PoolKey, int]] = set()
        calls, asked = [], []
        for pool, tokens in grants.items():
            rec = self._records.get(pool)
            if rec is None:
                expired.update((pool, t) for t in tokens)
            elif tokens:
                calls.append((rec, self._poster.post(rec.handle.renew, pool[1], self.owner, list(tokens))))
                asked.append(list(tokens))

        def finish(answers: list[Any]) -> set[tuple[PoolKey, int]]:
            out = set(expired)
            for (rec, _), tokens, ok in zip(calls, asked, answers):
                out.update((rec.key, t) for i, t in enumerate(tokens) if ok is None or not ok[i])
            return out

        return _Fanout(self, calls, finish)

    def commit(self, publish: Publishes,
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        # per pool, one batch per grant: (token, keys, offsets, checksums, free offsets); and
        # the rows of ``publish`` each batch answers for
        batches: dict[PoolKey, list[GrantCommit]] = defaultdict(list)
        rows_of: dict[PoolKey, list[np.ndarray]] = defaultdict(list)
        grants = publish.grants
        locations = publish.locations
        for (pool, token), rows in grants.items():
            batches[pool].append((token, [publish.keys[row] for row in rows.tolist()], locations.offset[rows],
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
            calls.append((rec, self._poster.post(rec.handle.commit, pool[1], self.owner, grant_batches)))
            order.append(rows_of[pool])

        def finish(answers: list[Any]) -> list[bool]:
            visible: np.ndarray = np.zeros(len(publish), dtype=bool)
            for rows_per_grant, got in zip(order, answers):
                for rows, oks in zip(rows_per_grant, got or []):
                    visible[rows] = oks
            return visible.tolist()

        return _Fanout(self, calls, finish)

    def remove(self, removals: Sequence[Removal]) -> Pending[int]:
        items: dict[PoolKey, list[tuple[bytes, int]]] = defaultdict(list)
        for r in removals:
            items[r.location.pool].append((r.key, r.location.offset))
        calls = [(self._records[p], self._poster.post(self._records[p].handle.remove, p[1], its))
                 for p, its in items.items() if p in self._records]
        return _Fanout(self, calls, lambda answers: sum(a or 0 for a in answers))

    def suspect(self, pool: PoolKey) -> None:
        self._failed(pool, "a worker's transfer failed")

    def close(self) -> None:
        try:
            self._poster.close()  # what the engine queued is posted (its last commits)
            self._touches.close()
        finally:
            self.connections.close()
            self._readers.close()

    # --- whole tensors: tests, benchmarks, engines without a connector -------------------

    def lookup_async(self, keys: Sequence[bytes]) -> Pending[list[bool]]:
        """Per key, whether any owner that is not suspect holds it (no pinning); one call per shard."""
        self.refresh()
        keys = list(keys)
        present = [False] * len(keys)
        idx: dict[PoolKey, tuple[ShardRecord, list[int]]] = {}
        for i, row in enumerate(self._owner_records(keys)):
            for rec in row:
                if not self._suspects.suspect(rec):
                    idx.setdefault(rec.key, (rec, []))[1].append(i)
        for pool, (rec, ix) in list(idx.items()):  # same-node shards: their published index says
            found = self._readers.locate(pool, [keys[i] for i in ix])
            if found is None:
                continue
            for i in np.flatnonzero(found.generation).tolist():
                present[ix[i]] = True
            unknown = np.flatnonzero(~found.known).tolist()
            if unknown:
                idx[pool] = (rec, [ix[u] for u in unknown])
            else:
                del idx[pool]
        calls = [(rec, self._poster.post(rec.handle.contains, rec.pool.incarnation, [keys[i] for i in ix]))
                 for rec, ix in idx.values()]
        asked = [ix for _, ix in idx.values()]

        def finish(answers: list[Any]) -> list[bool]:
            for ix, hits in zip(asked, answers):
                for i, hit in zip(ix, hits or []):
                    present[i] = present[i] or hit
            return present

        return _Fanout(self, calls, finish)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.lookup_async(keys).result()

    def register_local(self, tensor: torch.Tensor) -> None:
        """Register a buffer that ``put``/``get`` tensors will lie in (once, at start-up)."""
        self.connections.register_local(tensor)

    def transport_kind(self, shard_id: str) -> str:
        return self.connections.kind(next(s.key for s in self._membership.shards if s.shard_id == shard_id))

    def put(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Store whole tensors under ``keys`` on each key's owners (reserve anonymous slots,
        copy, commit); per key, whether it is now visible. Keys already present are not
        rewritten. Tensors must lie in buffers registered with ``register_local``."""
        if len(keys) != len(tensors):
            raise ValueError(f"put: {len(keys)} keys but {len(tensors)} tensors")
        views = [as_bytes(t) for t in tensors]
        visible = self.lookup(keys)
        todo = [i for i, v in enumerate(visible) if not v]
        wanted: dict[PoolKey, tuple[ShardRecord, dict[int, list[int]]]] = {}
        for i, row in zip(todo, self._owner_records([keys[i] for i in todo])):
            for rec in row:
                if not self._suspects.suspect(rec):
                    wanted.setdefault(rec.key, (rec, defaultdict(list)))[1][views[i].numel()].append(i)
        deadline = time.monotonic() + self.config.lookup_timeout_s
        calls = [(rec, by_size, rec.handle.reserve.remote(
            rec.pool.incarnation, self.owner, [(size, len(ix)) for size, ix in by_size.items()]))
            for rec, by_size in wanted.values()]
        ops: dict[PoolKey, list[CopyOp]] = defaultdict(list)
        placed: list[tuple[int, PoolKey, int, int]] = []  # key index, pool, token, offset
        for rec, by_size, ref in calls:
            for ix, (token, offsets) in zip(by_size.values(), self._get(rec, ref, deadline) or []):
                for i, off in zip(ix, offsets):
                    ops[rec.key].append(CopyOp(off, views[i]))
                    placed.append((i, rec.key, token, off))
        failed = self.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()}, write=True,
                                           timeout_s=self.config.transfer_timeout_s)
        for pool in failed:
            self._failed(pool, "save failed")
        sums = {i: checksum(views[i]) for i, _, _, _ in placed} if self.config.checksum else {}
        publish: list[tuple[bytes, Location, int]] = []
        landed, free = [], defaultdict(list)
        for i, pool, token, off in placed:
            if pool in failed:
                free[(pool, token)].append(off)
                continue
            publish.append((keys[i], Location(pool[0], pool[1], off, views[i].numel(), sums.get(i)), token))
            landed.append(i)
        for i, ok in zip(landed, self.commit(Publishes.of(publish), free).result()):
            visible[i] = visible[i] or ok
        # A key another writer stored first (a race) is present too.
        missing = [i for i, v in enumerate(visible) if not v]
        if missing:
            for i, found in zip(missing, self.lookup([keys[i] for i in missing])):
                visible[i] = found
        return visible

    def get(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``tensors`` from the store; per key, whether its bytes are valid. An entry with a
        checksum is verified whatever this client's ``checksum`` setting (the writer chose);
        a mismatch is a miss and removes the entry. Keys whose copy failed (a shard died: its
        published index still lists them) are read again from a replica, the failed pool now
        suspect."""
        if len(keys) != len(tensors):
            raise ValueError(f"get: {len(keys)} keys but {len(tensors)} tensors")
        self.refresh()
        views = [as_bytes(t) for t in tensors]
        ok = [False] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(max(1, self.replication)):
            got, failed = self._get_once([keys[i] for i in todo], [views[i] for i in todo])
            for i, hit in zip(todo, got):
                ok[i] = hit
            todo = [i for i, lost in zip(todo, failed) if lost]
            if not todo:
                break
        return ok

    def _get_once(self, keys: list[bytes], views: list[torch.Tensor]) -> tuple[list[bool], list[bool]]:
        """One pass of ``get``: per key, whether it is valid, and whether its copy failed."""
        lease = self.acquire(keys).result()
        locs = list(lease.locations)
        ok = [loc is not None and loc.size == views[i].numel() for i, loc in enumerate(locs)]
        ops: dict[PoolKey, list[CopyOp]] = defaultdict(list)
        for i, loc in enumerate(locs):
            if loc is not None and ok[i]:
                ops[loc.pool].append(CopyOp(loc.offset, views[i]))
        failed = self.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()}, write=False,
                                           timeout_s=self.config.transfer_timeout_s)
        for pool in failed:
            self._failed(pool, "load failed")
        lost = [loc is not None and ok[i] and loc.pool in failed for i, loc in enumerate(locs)]
        untrusted = failed | self.release(lease.lease_ids).result()
        unpinned = np.flatnonzero(lease.locations.generation.astype(bool) & np.asarray(ok, dtype=bool))
        stale_rows, _ = self._readers.stale(lease.locations, keys, unpinned)
        stale = set(unpinned[stale_rows].tolist())
        corrupt = []
        for i, loc in enumerate(locs):
            if loc is None or not ok[i]:
                continue
            if loc.pool in untrusted or i in stale:
                ok[i] = False
            elif loc.checksum is not None and checksum(views[i]) != loc.checksum:
                log.error("checksum mismatch for a key on shard %s: a miss; removing the entry", loc.shard_id)
                ok[i] = False
                corrupt.append(Removal(keys[i], loc))
        if corrupt:
            self.remove(corrupt).result()
        return ok, lost
