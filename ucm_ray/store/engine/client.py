"""StoreClient: the Ray ``BlockStore`` plus whole-tensor put/get/lookup.

The whole-tensor calls serve tests, benchmarks and engines without a connector:
each reserves or pins slots, copies through ``PoolConnections``, then commits or
releases, as the connector's two halves do step by step.

A NIXL transfer that timed out may still land (NIXL cannot cancel one in flight:
``Transfer.late``), and these calls guard against it as the connector does: ``get``
returns only once no read of its can land in the caller's tensors (else ``LateReadError``),
``put`` leaves a late write's slots to lapse at the shard, which quarantines them,
rather than free them for the next writer.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ucm_ray.store.checksum import checksum
from ucm_ray.store.engine.calls import Fanout
from ucm_ray.store.engine.ray_store import RayBlockStore
from ucm_ray.store.types import Done, Location, Pending, Publishes, Removal, ShardRecord
from ucm_ray.transport.base import CopyOp, LateReadError, PoolKey, Ranges, Transfer, as_bytes, still_late

log = logging.getLogger(__name__)


class StoreClient(RayBlockStore):
    """The client engines, tests and benchmarks make (``StoreClient(config)``)."""

    def lookup_async(self, keys: Sequence[bytes]) -> Pending[list[bool]]:
        """Per key, whether any owner that is not suspect holds it (no pinning); one call per
        shard. Under writer-local placement across nodes, ``keys[0]`` is the family root (see
        ``put``) and the lookup is a pin released at once (the hints say where to ask)."""
        self.refresh()
        keys = list(keys)
        if self._families:
            lease = self.acquire(keys).result()
            self.release(lease.lease_ids).result()
            return Done(lease.locations.found().tolist())
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
        calls = [(rec, self.access.poster.post(rec.handle.contains, rec.pool.incarnation, [keys[i] for i in ix]))
                 for rec, ix in idx.values()]
        asked = [ix for _, ix in idx.values()]

        def finish(answers: list[Any]) -> list[bool]:
            for ix, hits in zip(asked, answers):
                for i, hit in zip(ix, hits or []):
                    present[i] = present[i] or hit
            return present

        return Fanout(self.access, calls, finish)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.lookup_async(keys).result()

    def register_local(self, tensor: torch.Tensor) -> None:
        """Register a buffer that ``put``/``get`` tensors will lie in (once, at start-up)."""
        self.connections.register_local(tensor)

    def transport_kind(self, shard_id: str) -> str:
        return self.connections.kind(next(s.key for s in self.membership.shards if s.shard_id == shard_id))

    def put(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Store whole tensors under ``keys`` on each key's owners (reserve anonymous slots,
        copy, commit); per key, whether it is now visible. Keys already present are not
        rewritten. Tensors must lie in buffers registered with ``register_local``. The keys are
        one family, as a prompt's blocks are (rooted at ``keys[0]``, or past the fleet's hot
        prefix: ``hot_prefix``): ``get`` and ``lookup`` find them on other nodes when asked
        with the same leading keys. A pool whose write timed out in flight stores none of its
        keys, and its slots are not freed (``_commit_landed``): the write may still land there."""
        if len(keys) != len(tensors):
            raise ValueError(f"put: {len(keys)} keys but {len(tensors)} tensors")
        views = [as_bytes(t) for t in tensors]
        visible = self.lookup(keys)
        todo = [i for i, v in enumerate(visible) if not v]
        placed = self._reserve(keys, views, todo)
        ops: dict[PoolKey, list[CopyOp]] = defaultdict(list)
        for i, pool, _, off in placed:
            ops[pool].append(CopyOp(off, views[i]))
        failed = self.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()}, write=True,
                                           timeout_s=self.config.transfer_timeout_s)
        for pool in failed.blamed:
            self.access.failed(pool, "save failed")
        for i, ok in self._commit_landed(keys, views, placed, failed.pools, {pool for pool, _ in failed.late}):
            visible[i] = visible[i] or ok
        # A key another writer stored first (a race) is present too.
        missing = [i for i, v in enumerate(visible) if not v]
        if missing:
            for i, found in zip(missing, self.lookup([keys[i] for i in missing])):
                visible[i] = found
        return visible

    def _reserve(self, keys: Sequence[bytes], views: list[torch.Tensor],
                 todo: list[int]) -> list[tuple[int, PoolKey, int, int]]:
        """Slots for the keys ``todo`` on each of their owners that is not suspect, one call per
        shard for all sizes: (key index, pool, grant token, offset) per slot granted."""
        wanted: dict[PoolKey, tuple[ShardRecord, dict[int, list[int]]]] = {}
        for i, row in zip(todo, self._owner_records([keys[i] for i in todo])):
            for rec in row:
                if not self._suspects.suspect(rec):
                    wanted.setdefault(rec.key, (rec, defaultdict(list)))[1][views[i].numel()].append(i)
        deadline = time.monotonic() + self.config.lookup_timeout_s
        calls = [(rec, by_size, rec.handle.reserve.remote(
            rec.pool.incarnation, self.owner, [(size, len(ix)) for size, ix in by_size.items()]))
            for rec, by_size in wanted.values()]
        placed: list[tuple[int, PoolKey, int, int]] = []
        for rec, by_size, ref in calls:
            for ix, (token, offsets) in zip(by_size.values(), self.access.answer(rec, ref, deadline) or []):
                placed.extend((i, rec.key, token, off) for i, off in zip(ix, offsets))
        return placed

    def _commit_landed(self, keys: Sequence[bytes], views: list[torch.Tensor],
                       placed: list[tuple[int, PoolKey, int, int]], failed: set[PoolKey],
                       late: set[PoolKey]) -> list[tuple[int, bool]]:
        """Publish the slots whose copy landed, free those of ``failed`` pools; per key index
        published, whether the key is now visible from this write. The slots of ``late`` pools
        (their write timed out in flight, and may land whenever the shard answers) are neither:
        freed, the next writer could be handed them before the late bytes land over its own.
        Left alone, the grant lapses at the shard after ``reserve_timeout_s`` and is quarantined
        for as long again (``BlockIndex``), as the connector's uncertain saves' grants are."""
        sums = {i: checksum(views[i]) for i, _, _, _ in placed} if self.config.checksum else {}
        publish: list[tuple[bytes, Location, int]] = []
        landed, free = [], defaultdict(list)
        for i, pool, token, off in placed:
            if pool in late:
                continue
            if pool in failed:
                free[(pool, token)].append(off)
                continue
            publish.append((keys[i], Location(pool[0], pool[1], off, views[i].numel(), sums.get(i)), token))
            landed.append(i)
        # rows of the fleet's hot prefix under the first key, the rest under the block after it
        hot = self.hot_prefix(keys)
        root = keys[hot] if hot < len(keys) else keys[0] if keys else b""
        rows = replace(Publishes.of(publish), families=[keys[0] if i < hot else root for i in landed])
        return list(zip(landed, self.commit(rows, free).result()))

    def get(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``tensors`` from the store; per key, whether its bytes are valid. An entry with a
        checksum is verified whatever this client's ``checksum`` setting (the writer chose);
        a mismatch is a miss and removes the entry. Keys whose copy failed (a shard died: its
        published index still lists them) are read again from a replica, the failed pool now
        suspect.

        A read that timed out in flight may still land in its tensors (NIXL cannot cancel it):
        before they are read again from a replica, or returned, ``get`` waits until it cannot,
        at most ``transfer_timeout_s`` more, else raises ``LateReadError`` (the tensors may
        still change: the caller must not use them while the shard may answer). Returning a
        miss at the timeout let the late bytes land later over the replica's, or over whatever
        the caller had put in the tensor since. Reading into a private buffer instead would
        cost every read a copy; the wait costs only reads that already timed out."""
        if len(keys) != len(tensors):
            raise ValueError(f"get: {len(keys)} keys but {len(tensors)} tensors")
        self.refresh()
        views = [as_bytes(t) for t in tensors]
        ok = [False] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(max(1, self.replication)):
            got, failed, late = self._get_once([keys[i] for i in todo], [views[i] for i in todo])
            if late:
                self._await_late(late)
            for i, hit in zip(todo, got):
                ok[i] = hit
            todo = [i for i, lost in zip(todo, failed) if lost]
            if not todo:
                break
        return ok

    def _await_late(self, late: list[Transfer]) -> None:
        """Wait until none of ``late`` (reads that timed out in flight) can land any more, at
        most ``transfer_timeout_s``; ``LateReadError`` when one still can."""
        still = still_late(late, time.monotonic() + self.config.transfer_timeout_s)
        if still:
            raise LateReadError(f"ucm-ray: {len(still)} failed NIXL reads of get still in flight "
                                f"{self.config.transfer_timeout_s} s after their timeout: NIXL cannot cancel "
                                "them, and their bytes may still land in the tensors given to get")

    def _get_once(self, keys: list[bytes],
                  views: list[torch.Tensor]) -> tuple[list[bool], list[bool], list[Transfer]]:
        """One pass of ``get``: per key, whether it is valid, and whether its copy failed; and
        the failed reads that may still land (``Failures.late``)."""
        lease = self.acquire(keys).result()
        locs = list(lease.locations)
        ok = [loc is not None and loc.size == views[i].numel() for i, loc in enumerate(locs)]
        ops: dict[PoolKey, list[CopyOp]] = defaultdict(list)
        for i, loc in enumerate(locs):
            if loc is not None and ok[i]:
                ops[loc.pool].append(CopyOp(loc.offset, views[i]))
        failures = self.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()}, write=False,
                                             timeout_s=self.config.transfer_timeout_s)
        failed = failures.pools
        for pool in failures.blamed:
            self.access.failed(pool, "load failed")
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
        return ok, lost, [transfer for _, transfer in failures.late]
