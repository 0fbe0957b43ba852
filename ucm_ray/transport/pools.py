"""PoolConnections: one process's transports to the shard pools, keyed by (shard id, incarnation).

The data plane both the store client and the connector's workers use; it makes
no Ray calls. Transports are keyed by ``PoolKey`` rather than by shard id so a
restarted shard (same id, new incarnation, new pool file) can never be reached
through the mapping of its predecessor: ``sync`` closes every transport whose
pool is no longer current before anything else uses this object.

Transfers never raise: a pool whose batch cannot be posted or fails is reported
back, and the caller treats its keys as misses (loads) or dropped saves; it suspects the pool
only where the failure was not this process's own (``Failures.blamed``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ucm_ray.transport.base import (
    LocalTransferError,
    PoolDescriptor,
    PoolKey,
    PoolTransport,
    PreparedCopies,
    Ranges,
    RepeatedRanges,
    Transfer,
)

if TYPE_CHECKING:
    from ucm_ray.transport.nixl.staging import HostStaging

log = logging.getLogger(__name__)

MODES = ("auto", "shm", "nixl")


@dataclass
class Failures:
    """The pools whose batches failed: their keys are misses, their rows not saved. ``blamed``,
    those of them whose failure was not this process's own (``LocalTransferError``: no host
    staging room, a slab not allocated): only those may be suspected."""

    pools: set[PoolKey] = field(default_factory=set)
    blamed: set[PoolKey] = field(default_factory=set)
    late: list[tuple[PoolKey, Transfer]] = field(default_factory=list)
    """Of the failed transfers, those whose bytes may still land (``Transfer.late``), with their
    pool: a read's destination blocks, a write's pool slots must not be used again until they
    are not."""

    @classmethod
    def of(cls, pools: set[PoolKey]) -> Failures:
        """Failures of ``pools``, every one blamed (a batch the pool never took)."""
        return cls(set(pools), set(pools))

    def add(self, pool: PoolKey, error: BaseException) -> None:
        self.pools.add(pool)
        if not isinstance(error, LocalTransferError):
            self.blamed.add(pool)

    def update(self, other: Failures) -> None:
        self.pools |= other.pools
        self.blamed |= other.blamed
        self.late += other.late


def _what(write: bool) -> str:
    return "save" if write else "load"


def _not_started(write: bool, pool: PoolKey, error: Exception) -> None:
    log.warning("%s with shard %s failed to start: %s: %s", _what(write), pool[0], type(error).__name__, error)


class PoolConnections:
    """Transports to shard pools keyed by (shard id, incarnation). Thread-safe."""

    def __init__(self, mode: str = "auto", node_id: str | None = None, *, nixl_staging: str = "auto") -> None:
        """``nixl_staging``: ``UcmRayConfig.nixl_stage_through_host`` (``nixl.staging``)."""
        if mode not in MODES:
            raise ValueError(f"transport mode {mode!r} is not one of {' | '.join(MODES)}")
        self._mode = mode
        self._node_id = node_id
        self._descriptors: dict[PoolKey, PoolDescriptor] = {}
        self._open: dict[PoolKey, PoolTransport] = {}
        self._kinds: dict[PoolKey, str] = {}
        self._local: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._nixl_staging = nixl_staging
        self._staging: HostStaging | None = None
        """Made with the first NIXL transport (none where every pool is mapped)."""

    @property
    def staging(self) -> HostStaging | None:
        """The host staging of this process's NIXL transfers (None until a NIXL pool is opened)."""
        return self._staging

    def sync(self, descriptors: Mapping[PoolKey, PoolDescriptor]) -> None:
        """Make ``descriptors`` the current pools; close every transport of a pool that is
        gone (a dead shard, or an old incarnation of a restarted one)."""
        with self._lock:
            self._descriptors = dict(descriptors)
            self._kinds = {k: v for k, v in self._kinds.items() if k in self._descriptors}
            stale = [k for k in self._open if k not in self._descriptors]
            closing = [self._open.pop(k) for k in stale]
        for key, t in zip(stale, closing):
            log.info("closing transport to %s incarnation %x: no longer current", key[0], key[1])
            t.close()

    def open_all(self) -> None:
        """Open a transport to every current pool now (a same-node pool's mapping faults in all
        its pages, a CUDA one is page-locked too: ~0.3 s per GiB), so no later copy pays that.
        A pool that cannot be opened now fails its copies later, as it would have."""
        with self._lock:
            pools = [k for k in self._descriptors if k not in self._open]
        for pool in pools:
            try:
                self._transport(pool)
            except Exception as e:  # noqa: BLE001 -- reported again by the copies that need it
                log.info("transport to shard %s not opened ahead: %s: %s", pool[0], type(e).__name__, e)

    def register_local(self, tensor: torch.Tensor) -> None:
        """Local memory that ``Ranges`` will copy into or out of (also registered with transports
        opened later)."""
        with self._lock:
            self._local.append(tensor)
            transports = list(self._open.values())
        for t in transports:
            t.register_local(tensor)

    def transfer(self, by_pool: Mapping[PoolKey, Ranges], *, write: bool,
                 timeout_s: float) -> Failures:
        """``post`` then ``wait``: the pools whose batch failed. Never raises."""
        posted, failed = self.post(by_pool, write=write)
        failures = Failures.of(failed)
        failures.update(self.wait(posted, write=write, timeout_s=timeout_s))
        return failures

    def post(self, by_pool: Mapping[PoolKey, Ranges], *,
             write: bool) -> tuple[list[tuple[PoolKey, Transfer]], set[PoolKey]]:
        """Post every pool's batch without waiting (so pools' copies overlap, and a caller can
        post the next layer while this one moves); returns what was posted and the pools whose
        batch could not be. Never raises."""
        posted: list[tuple[PoolKey, Transfer]] = []
        failed: set[PoolKey] = set()
        for pool, ranges in by_pool.items():
            if not len(ranges):
                continue
            try:
                t = self._transport(pool)
                posted.append((pool, t.write(ranges) if write else t.read(ranges)))
            except Exception as e:  # noqa: BLE001 -- whatever it is, that pool's keys are misses
                _not_started(write, pool, e)
                failed.add(pool)
        return posted, failed

    def prepare(self, pool: PoolKey, ranges: Ranges | RepeatedRanges, ends: list[int], *,
                write: bool) -> PreparedCopies | None:
        """A step's copies with ``pool``, planned once to be posted part by part with
        ``post_part`` (``ends[k]``: where part k's ranges end; ``RepeatedRanges`` carry their
        own); None when the pool cannot be reached or planned (its copies fail). Never raises."""
        try:
            transport = self._transport(pool)
            if isinstance(ranges, RepeatedRanges):
                return transport.prepare_repeated(ranges, to_pool=write)
            return transport.prepare(ranges, ends, to_pool=write)
        except Exception as e:  # noqa: BLE001 -- as in ``post``
            _not_started(write, pool, e)
            return None

    @staticmethod
    def post_part(prepared: Mapping[PoolKey, PreparedCopies | None], part: int | None, *,
                  write: bool) -> tuple[list[tuple[PoolKey, Transfer]], set[PoolKey]]:
        """``post`` for prepared copies: part ``part`` of each pool's (None: every part of it as
        one transfer, ``post_whole``). Never raises."""
        posted: list[tuple[PoolKey, Transfer]] = []
        failed: set[PoolKey] = set()
        for pool, copies in prepared.items():
            if copies is None:  # logged by ``prepare``
                failed.add(pool)
                continue
            try:
                posted.append((pool, copies.post(part) if part is not None else copies.post_whole()))
            except Exception as e:  # noqa: BLE001 -- as in ``post``
                _not_started(write, pool, e)
                failed.add(pool)
        return posted, failed

    @staticmethod
    def post_each(pool: PoolKey, copies: PreparedCopies | None, parts: range, *,
                  write: bool) -> tuple[list[Transfer], set[PoolKey]]:
        """``post_part`` of ``parts`` (in order) of one pool's prepared copies in one call (a
        transfer per part; none and the pool failed if it could not). Never raises."""
        if copies is None:  # logged by ``prepare``
            return [], {pool}
        try:
            return copies.post_each(parts.stop, parts.start), set()
        except Exception as e:  # noqa: BLE001 -- as in ``post``
            _not_started(write, pool, e)
            return [], {pool}

    def stream_ordered(self, pool: PoolKey, device: torch.device) -> bool:
        """Whether copies with ``pool`` into ``device`` memory are queued on the device in stream
        order (shared memory on CUDA): then they are posted from the caller's thread and the
        device itself waits for them; others (CPU copies, NIXL) need a host thread to wait."""
        return device.type == "cuda" and self.kind(pool) == "shm"

    @staticmethod
    def wait(posted: list[tuple[PoolKey, Transfer]], *, write: bool, timeout_s: float,
             clock: Callable[[], float] = time.monotonic) -> Failures:
        """Wait for posted batches within one overall ``timeout_s`` (on ``clock``: the worker's,
        whose step deadline it is); the pools whose batch failed."""
        failed = Failures()
        deadline = clock() + timeout_s
        for pool, transfer in posted:
            try:
                transfer.wait(max(0.0, deadline - clock()))
            except Exception as e:  # noqa: BLE001 -- as above: never raise into a copy thread
                log.warning("%s with shard %s failed: %s: %s", _what(write), pool[0], type(e).__name__, e)
                failed.add(pool, e)
                if transfer.late():
                    failed.late.append((pool, transfer))
        return failed

    def kind(self, pool: PoolKey) -> str:
        """``shm`` or ``nixl``: the transport this process uses (or will use) for ``pool``,
        without opening it; ``none`` for a pool that is not current."""
        with self._lock:
            kind = self._kinds.get(pool)
            desc = self._descriptors.get(pool)
        if kind is None and desc is not None:
            kind = self._kinds[pool] = self._kind(desc)
        return kind or "none"

    def close(self) -> None:
        with self._lock:
            closing, self._open = list(self._open.values()), {}
            staging, self._staging = self._staging, None
        for t in closing:
            t.close()
        if staging is not None:  # after the transports: they deregistered its slabs from NIXL
            staging.close()

    def _transport(self, pool: PoolKey) -> PoolTransport:
        with self._lock:  # a copy thread and a control thread may both get here
            t = self._open.get(pool)
            if t is not None:
                return t
            desc = self._descriptors.get(pool)
            if desc is None:
                raise KeyError(f"shard {pool[0]} incarnation {pool[1]:x} is not a current pool")
            t = self._connect(desc)
            try:
                for buf in self._local:
                    t.register_local(buf)
            except BaseException:
                t.close()
                raise
            self._open[pool] = t
            return t

    def _kind(self, desc: PoolDescriptor) -> str:
        if self._mode != "auto":
            return self._mode
        same_node = desc.node_id == self._node_id and desc.shm_path and os.path.exists(desc.shm_path)
        return "shm" if same_node else "nixl"

    def _connect(self, desc: PoolDescriptor) -> PoolTransport:
        if self._kind(desc) == "shm":
            from ucm_ray.transport.shm import ShmPoolTransport

            return ShmPoolTransport(desc)
        from ucm_ray.transport.nixl import NixlPoolTransport
        from ucm_ray.transport.nixl.staging import HostStaging

        if self._staging is None:  # (under the lock: ``_transport`` holds it)
            self._staging = HostStaging(self._nixl_staging)
        return NixlPoolTransport(desc, staging=self._staging)
