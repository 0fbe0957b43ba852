"""StoreClient: what engines (and benchmarks) use to reach the sharded store.

Control calls are batched: one Ray call per shard per operation, whatever the
number of keys. Bytes never travel through Ray: the client asks for slots
(acquire / reserve), copies through a ``PoolTransport`` (shared memory for
same-node shards, NIXL otherwise), then releases / commits.

Failure rule: a shard that errors or times out is a miss, never an error the
engine sees, and never a source of bytes that were not verified as landed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
import threading
from typing import Mapping, Sequence

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

try:  # Ray >= 2.10
    from ray.exceptions import ActorUnavailableError
except ImportError:  # pragma: no cover
    ActorUnavailableError = RayActorError  # type: ignore[misc,assignment]

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.checksum import checksum
from ucm_ray.store.directory import DIRECTORY_NAME, Membership, ShardRecord
from ucm_ray.store.placement import owners
from ucm_ray.transport.base import CopyOp, PoolTransport, TransferError, as_bytes

log = logging.getLogger(__name__)

_SHARD_ERRORS = (RayActorError, ActorUnavailableError, GetTimeoutError)


@dataclass(frozen=True)
class Location:
    """A slot of one key on one shard."""

    shard_id: str
    offset: int
    size: int
    checksum: int | None = None


@dataclass
class ReadLease:
    """Pinned locations of the keys to read; release it when the copies are done."""

    locations: list[Location | None]
    leases: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class WriteReservation:
    """Fresh slots (one per granted replica) per key; commit or abort them."""

    keys: list[bytes]
    locations: list[list[Location]]
    tokens: dict[str, int] = field(default_factory=dict)


class LookupFuture:
    """In-flight lookup; ``result`` gives, per key, whether any live replica holds it."""

    def __init__(self, client: "StoreClient", n: int, calls: list[tuple[str, ray.ObjectRef, np.ndarray]]):
        self._client = client
        self._n = n
        self._calls = calls
        self._started = time.monotonic()

    def done(self) -> bool:
        refs = [ref for _, ref, _ in self._calls]
        if not refs:
            return True
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) == len(refs):
            return True
        return time.monotonic() - self._started > self._client.config.lookup_timeout_s

    def result(self, timeout_s: float | None = None) -> list[bool]:
        deadline = self._started + (timeout_s if timeout_s is not None else self._client.config.lookup_timeout_s)
        present = np.zeros(self._n, dtype=bool)
        for shard_id, ref, idx in self._calls:
            hits = self._client._get(shard_id, ref, max(0.0, deadline - time.monotonic()))
            if hits is not None:
                present[idx] |= np.asarray(hits, dtype=bool)
        return present.tolist()


class AcquireFuture:
    """Pins keys on their primary owner; keys whose shard *failed* move on to the next replica.

    A plain miss on a live primary is final (asking every replica for every miss
    would double the control traffic of cold prompts). ``poll`` never blocks, so
    the scheduler can check it once per step.
    """

    def __init__(self, client: "StoreClient", keys: list[bytes]) -> None:
        self._client = client
        self._keys = keys
        self.lease = ReadLease(locations=[None] * len(keys))
        self._live, self._own = client._owners(keys) if keys else ([], np.zeros((0, 0), dtype=np.int64))
        self._started = time.monotonic()
        self._calls: list[tuple[ShardRecord, list[int], ray.ObjectRef]] = []
        self._rank = 0
        self._post(list(range(len(keys))))

    def _post(self, idx: list[int]) -> None:
        if not idx or self._rank >= self._own.shape[1]:
            return
        by_shard: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            by_shard[int(self._own[i, self._rank])].append(i)
        self._calls = [(self._live[j], ix, self._live[j].handle.acquire.remote([self._keys[i] for i in ix]))
                       for j, ix in by_shard.items()]

    def _collect(self, timeout_s: float) -> None:
        failed: list[int] = []
        for shard, idx, ref in self._calls:
            got = self._client._get(shard.shard_id, ref, timeout_s)
            if got is None:
                failed.extend(idx)
                continue
            lease_id, slots = got
            self.lease.leases.setdefault(shard.shard_id, []).append(lease_id)
            for i, slot in zip(idx, slots):
                if slot is not None:
                    self.lease.locations[i] = Location(shard.shard_id, slot.offset, slot.size, slot.checksum)
        self._calls = []
        self._rank += 1
        self._post(failed)

    def poll(self) -> bool:
        """True once every key is resolved (pinned or a miss)."""
        while self._calls:
            refs = [ref for _, _, ref in self._calls]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            overdue = time.monotonic() - self._started > self._client.config.lookup_timeout_s
            if len(ready) < len(refs) and not overdue:
                return False
            self._collect(0.0 if not overdue else 0.001)
        return True

    def result(self) -> ReadLease:
        while self._calls:
            left = self._client.config.lookup_timeout_s - (time.monotonic() - self._started)
            self._collect(max(0.001, left))
        return self.lease


class ReserveFuture:
    """Posted ``reserve`` calls (one per owning shard); ``result`` collects the slots."""

    def __init__(self, client: "StoreClient", keys: list[bytes], sizes: list[int]) -> None:
        self._client = client
        self._sizes = sizes
        self._res = WriteReservation(keys=keys, locations=[[] for _ in keys])
        self._calls: list[tuple[ShardRecord, np.ndarray, ray.ObjectRef]] = []
        for shard, idx in client._fan_out(keys) if keys else ():
            items = [(keys[i], sizes[i]) for i in idx]
            self._calls.append((shard, idx, shard.handle.reserve.remote(items)))

    def result(self) -> WriteReservation:
        for shard, idx, ref in self._calls:
            got = self._client._get(shard.shard_id, ref, self._client.config.lookup_timeout_s)
            if got is None:
                continue
            token, offsets = got
            self._res.tokens[shard.shard_id] = token
            for i, off in zip(idx, offsets):
                if off is not None:
                    self._res.locations[i].append(Location(shard.shard_id, off, self._sizes[i]))
        self._calls = []
        return self._res


class StoreClient:
    def __init__(self, config: UcmRayConfig, *, directory: ray.actor.ActorHandle | None = None) -> None:
        self.config = config
        self._directory = directory or ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._transports: dict[str, PoolTransport] = {}
        self._transport_lock = threading.Lock()
        self._local_buffers: list[torch.Tensor] = []
        self._suspect: set[str] = set()
        self._membership: Membership = ray.get(self._directory.membership.remote(),
                                               timeout=config.lookup_timeout_s)
        self._pending_membership: ray.ObjectRef | None = None
        self._last_refresh = time.monotonic()

    # --- membership ----------------------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self._membership

    def refresh(self, *, force: bool = False, period_s: float = 1.0) -> None:
        """Pick up joins and deaths without blocking the caller (the scheduler calls this on its
        hot path): at most once per ``period_s`` the membership is requested, and it is applied
        by a later call once it has arrived. ``force`` fetches and waits."""
        if force or (self._pending_membership is None
                     and time.monotonic() - self._last_refresh >= period_s):
            self._last_refresh = time.monotonic()
            self._pending_membership = self._directory.membership.remote()
        ref = self._pending_membership
        if ref is None:
            return
        ready, _ = ray.wait([ref], timeout=self.config.lookup_timeout_s if force else 0)
        if not ready:
            if time.monotonic() - self._last_refresh > self.config.lookup_timeout_s:
                log.warning("shard directory slow to answer; keeping membership v%d", self._membership.version)
                self._pending_membership = None
            return
        self._pending_membership = None
        try:
            membership = ray.get(ref)
        except _SHARD_ERRORS as e:
            log.warning("shard directory unreachable (%s); keeping membership v%d",
                        type(e).__name__, self._membership.version)
            return
        if membership.version != self._membership.version:
            self._membership = membership
            live = set(membership.shard_ids)
            with self._transport_lock:
                for sid in [s for s in self._transports if s not in live]:
                    self._transports.pop(sid).close()
            self._suspect &= live

    def _live(self) -> list[ShardRecord]:
        return [s for s in self._membership.shards if s.shard_id not in self._suspect]

    def _owners(self, keys: Sequence[bytes]) -> tuple[list[ShardRecord], np.ndarray]:
        live = self._live()
        return live, owners(keys, [s.shard_id for s in live], self.config.replication)

    def _fan_out(self, keys: Sequence[bytes]) -> list[tuple[ShardRecord, np.ndarray]]:
        """Per live shard, the indices of the keys it holds a replica of."""
        live, own = self._owners(keys)
        out = []
        for j, shard in enumerate(live):
            idx = np.nonzero((own == j).any(axis=1))[0]
            if len(idx):
                out.append((shard, idx))
        return out

    def _mark_failed(self, shard_id: str, err: BaseException) -> None:
        if shard_id not in self._suspect:
            log.warning("shard %s failed (%s): its keys are misses until membership changes",
                        shard_id, type(err).__name__)
        self._suspect.add(shard_id)
        self._last_refresh = 0.0

    def _get(self, shard_id: str, ref: ray.ObjectRef, timeout_s: float):
        try:
            return ray.get(ref, timeout=timeout_s)
        except _SHARD_ERRORS as e:
            self._mark_failed(shard_id, e)
            return None

    # --- lookups -------------------------------------------------------------------------

    def lookup_async(self, keys: Sequence[bytes]) -> LookupFuture:
        """Fire one ``contains`` call per shard owning any of ``keys``; never blocks."""
        self.refresh()
        keys = list(keys)
        if not keys:
            return LookupFuture(self, 0, [])
        calls = [(shard.shard_id, shard.handle.contains.remote([keys[i] for i in idx]), idx)
                 for shard, idx in self._fan_out(keys)]
        return LookupFuture(self, len(keys), calls)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.lookup_async(keys).result()

    # --- reads ---------------------------------------------------------------------------

    def acquire_async(self, keys: Sequence[bytes]) -> "AcquireFuture":
        """Pin ``keys`` where they live, without blocking: see ``AcquireFuture``."""
        self.refresh()
        return AcquireFuture(self, list(keys))

    def acquire(self, keys: Sequence[bytes]) -> ReadLease:
        return self.acquire_async(keys).result()

    def release(self, lease: ReadLease) -> set[str]:
        """Unpin; returns the shards whose lease expired (their copies are untrusted)."""
        records = {s.shard_id: s for s in self._membership.shards}
        calls = [(sid, records[sid].handle.release.remote(ids))
                 for sid, ids in lease.leases.items() if sid in records]
        stale = {sid for sid in lease.leases if sid not in records}
        for sid, ref in calls:
            ok = self._get(sid, ref, self.config.lookup_timeout_s)
            if ok is None or not all(ok):
                stale.add(sid)
        lease.leases.clear()
        return stale

    def release_async(self, leases: dict[str, list[int]] | ReadLease) -> None:
        """Unpin without waiting (the engine's hot path): a lost release only delays
        eviction of those entries until their lease expires."""
        ids = leases.leases if isinstance(leases, ReadLease) else leases
        records = {s.shard_id: s for s in self._membership.shards}
        for sid, lease_ids in ids.items():
            if sid in records and lease_ids:
                records[sid].handle.release.remote(lease_ids)
        if isinstance(leases, ReadLease):
            leases.leases = {}

    # --- writes --------------------------------------------------------------------------

    def reserve_async(self, keys: Sequence[bytes], sizes: Sequence[int]) -> "ReserveFuture":
        """Ask every live owner (r replicas) of each key for a fresh slot; never blocks."""
        self.refresh()
        return ReserveFuture(self, list(keys), [int(x) for x in sizes])

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int]) -> WriteReservation:
        return self.reserve_async(keys, sizes).result()

    def commit(self, res: WriteReservation, landed: Sequence[bool],
               checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish keys whose bytes landed, free the rest; per key, visible on any replica."""
        by_shard: dict[str, tuple[list[int], list[bytes]]] = defaultdict(lambda: ([], []))
        for i, locs in enumerate(res.locations):
            for loc in locs:
                ok_idx, failed = by_shard[loc.shard_id]
                (ok_idx.append(i) if landed[i] else failed.append(res.keys[i]))
        records = {s.shard_id: s for s in self._membership.shards}
        calls = []
        for sid, (ok_idx, failed) in by_shard.items():
            if sid not in records or sid not in res.tokens:
                continue
            sums = [checksums[i] for i in ok_idx] if checksums is not None else None
            ref = records[sid].handle.commit.remote(res.tokens[sid], [res.keys[i] for i in ok_idx],
                                                    failed, sums)
            calls.append((sid, ok_idx, ref))
        visible = [False] * len(res.keys)
        for sid, ok_idx, ref in calls:
            got = self._get(sid, ref, self.config.lookup_timeout_s)
            for i, v in zip(ok_idx, got or []):
                visible[i] = visible[i] or v
        return visible

    # --- data plane ----------------------------------------------------------------------

    def register_local(self, tensor: torch.Tensor) -> None:
        """Register a buffer that ``CopyOp.local`` views will point into (once, at start-up)."""
        self._local_buffers.append(tensor)
        for t in self._transports.values():
            t.register_local(tensor)

    def transport(self, shard_id: str) -> PoolTransport:
        with self._transport_lock:  # the connector's copy thread and its caller both get here
            return self._transport_locked(shard_id)

    def _transport_locked(self, shard_id: str) -> PoolTransport:
        t = self._transports.get(shard_id)
        if t is None:
            record = next(s for s in self._membership.shards if s.shard_id == shard_id)
            t = self._make_transport(record)
            for buf in self._local_buffers:
                t.register_local(buf)
            self._transports[shard_id] = t
        return t

    def transport_kind(self, shard_id: str) -> str:
        return self.transport(shard_id).name

    def _make_transport(self, record: ShardRecord) -> PoolTransport:
        pool = record.pool
        mode = self.config.transport
        if mode == "auto":
            mode = "shm" if pool.node_id == self._node_id and pool.shm_path else "nixl"
        if mode == "shm":
            from ucm_ray.transport.shm import ShmPoolTransport

            return ShmPoolTransport(pool)
        from ucm_ray.transport.nixl import NixlPoolTransport

        return NixlPoolTransport(pool)

    def put(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Store whole tensors under ``keys``; per key, whether it is now visible.
        Tensors must lie in buffers registered with ``register_local``."""
        if len(keys) != len(tensors):
            raise ValueError(f"put: {len(keys)} keys but {len(tensors)} tensors")
        views = [as_bytes(t) for t in tensors]
        res = self.reserve(keys, [v.numel() for v in views])
        landed = [bool(locs) for locs in res.locations]
        by_shard: dict[str, list[tuple[int, CopyOp]]] = defaultdict(list)
        for i, locs in enumerate(res.locations):
            for loc in locs:
                by_shard[loc.shard_id].append((i, CopyOp(loc.offset, views[i])))
        self._run(by_shard, landed, write=True)
        sums = [checksum(v) for v in views] if self.config.checksum else None
        visible = self.commit(res, landed, sums)
        # A key another writer stored (earlier, or first in a race) is present too.
        missing = [i for i, v in enumerate(visible) if not v]
        if missing:
            found = self.lookup([keys[i] for i in missing])
            for i, f in zip(missing, found):
                visible[i] = f
        return visible

    def get(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``tensors`` from the store; per key, whether its bytes are valid."""
        if len(keys) != len(tensors):
            raise ValueError(f"get: {len(keys)} keys but {len(tensors)} tensors")
        views = [as_bytes(t) for t in tensors]
        lease = self.acquire(keys)
        ok = [loc is not None and loc.size == views[i].numel() for i, loc in enumerate(lease.locations)]
        by_shard: dict[str, list[tuple[int, CopyOp]]] = defaultdict(list)
        for i, loc in enumerate(lease.locations):
            if ok[i]:
                by_shard[loc.shard_id].append((i, CopyOp(loc.offset, views[i])))
        self._run(by_shard, ok, write=False)
        for sid in self.release(lease):
            for i, _ in by_shard.get(sid, []):
                ok[i] = False
        if self.config.checksum:
            for i, loc in enumerate(lease.locations):
                if ok[i] and loc.checksum is not None and checksum(views[i]) != loc.checksum:
                    log.error("checksum mismatch for a key on shard %s: treated as a miss", loc.shard_id)
                    ok[i] = False
        return ok

    def transfer(self, by_shard: Mapping[str, Sequence[CopyOp]], *, write: bool) -> set[str]:
        """Post every shard's batch, then wait for all; returns the shards whose batch failed.
        (The batches are posted before any is waited on so that shards' copies overlap.)"""
        posted, failed = [], set()
        for sid, ops in by_shard.items():
            try:
                t = self.transport(sid)
                posted.append((sid, t.write(ops) if write else t.read(ops)))
            except (TransferError, OSError, StopIteration, ValueError) as e:
                log.warning("%s with shard %s failed to start: %s", "save" if write else "load", sid, e)
                failed.add(sid)
        for sid, transfer in posted:
            try:
                transfer.wait(self.config.transfer_timeout_s)
            except TransferError as e:
                log.warning("%s with shard %s failed: %s", "save" if write else "load", sid, e)
                failed.add(sid)
        return failed

    def _run(self, by_shard: dict[str, list[tuple[int, CopyOp]]], ok: list[bool], *, write: bool) -> None:
        """Copy, then clear ``ok`` for the keys of every shard whose batch failed."""
        failed = self.transfer({sid: [op for _, op in items] for sid, items in by_shard.items()}, write=write)
        for sid in failed:
            for i, _ in by_shard[sid]:
                ok[i] = False

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()
