"""A lookup: each key located on its first owner that answers, pinned only where it must be."""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future

import numpy as np
import ray

from ucm_ray.store.engine.calls import ShardAccess
from ucm_ray.store.types import Locations, Pending, ReadLease, ShardRecord
from ucm_ray.transport.base import PoolKey


class Acquire(Pending[ReadLease]):
    """Locates each key on its first owner that is not suspect: in that shard's published index
    when this node has it (no call, nothing pinned), else pinned through a call (also where the
    index lists any of them as on the shard's disk); keys whose shard
    *fails* move on to the next replica. A plain miss on a live owner is final (asking every
    replica for every miss would double the control traffic of cold prompts). Keys are routed
    as arrays: a lookup of a long prompt costs no Python per key before its answer."""

    def __init__(self, access: ShardAccess, keys: list[bytes], pin: Collection[PoolKey],
                 shards: tuple[ShardRecord, ...], owners: np.ndarray, recompute_bytes_s: float = 0.0) -> None:
        """``shards``: the membership's; ``owners``: ``[key, replica]``, each key's owners over all
        of them, best first, as indices into ``shards``; ``recompute_bytes_s``: the asker's prefill
        rate, sent with each call (``BlockStore.acquire``)."""
        self._access = access
        self._keys = keys
        self._pin = pin
        self._lease = ReadLease(Locations.missing(len(keys)))
        self._shards = shards
        self._owners = owners
        self._recompute_bytes_s = recompute_bytes_s
        self._rank: np.ndarray = np.zeros(len(keys), dtype=np.int64)
        self._deadline = access.clock() + access.timeout_s
        self._calls: list[tuple[ShardRecord, list[int], ray.ObjectRef]] = []
        self._arrived: list[Future] | None = None  # as in ``Fanout``: made by the first poll
        self._post(np.arange(len(keys)))

    def _post(self, idx: np.ndarray) -> None:
        access = self._access
        skip = np.array([access.suspects.suspect(rec) for rec in self._shards], dtype=bool)
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
            found = None if rec.key in self._pin else access.readers.locate(rec.key, keys)
            # On the shard's disk thread (its other callers do not wait behind the reads) where
            # some keys may be on its disk: the published index says so, or none was read.
            promoting = access.disk_tier if found is None else bool(found.on_disk.any())
            if found is not None and promoting:
                # Some keys wait on the shard's disk: all of them go through its acquire, which
                # pins the pool's hits before it promotes (and may evict) for the rest; unpinned
                # hits of this very lookup would be the promotion's first victims.
                found = None
            if found is not None:
                hit = self._lease.locations.put_found(ix, rec.key, found)
                unknown = np.flatnonzero(~found.known).tolist()
                access.touches.add(rec.key, rec.handle, [keys[i] for i in hit], len(ix) - len(unknown))
                if not unknown:
                    continue
                ix = [ix[u] for u in unknown]
                keys = [keys[u] for u in unknown]
            # posted at once (the step waits for its answer), after what this client queued
            access.poster.drain(access.timeout_s)
            call = rec.handle.promote_and_acquire if promoting else rec.handle.acquire
            # when this lookup stops waiting, as a time of day: the shard reads from disk only until
            # then, however long the call queued there (``CacheShard._until``)
            answer_by = time.time() + max(0.0, self._deadline - access.clock())
            ref = call.remote(rec.pool.incarnation, access.owner, keys, self._recompute_bytes_s, answer_by)
            self._calls.append((rec, ix, ref))
            self._lease.calls += 1
        self._arrived = None

    def _collect(self) -> None:
        failed: list[int] = []
        for rec, idx, ref in self._calls:
            got = self._access.answer(rec, ref, self._deadline)
            if got is None:
                failed.extend(idx)
                continue
            lease_id, slots, promoted = got
            if any(s is not None for s in slots):
                self._lease.lease_ids.setdefault(rec.key, []).append(lease_id)
            self._lease.locations.put_slots(idx, rec.key, slots)
            if promoted:
                if self._lease.promoted is None:
                    self._lease.promoted = np.zeros(len(self._keys), dtype=bool)
                self._lease.promoted[[idx[i] for i in promoted]] = True
        self._calls = []
        if failed:
            self._rank[failed] += 1
            self._post(np.asarray(failed, dtype=np.int64))

    def poll(self) -> bool:
        while self._calls:
            if self._arrived is None:
                self._arrived = [ref.future() for _, _, ref in self._calls]
            if not all(f.done() for f in self._arrived) and self._access.clock() <= self._deadline:
                return False
            self._collect()
        return True

    def result(self) -> ReadLease:
        while self._calls:
            self._collect()
        return self._lease
