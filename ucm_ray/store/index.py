"""What one shard knows: key -> slot, LRU order, read pins and pending writes.

Plain Python, no Ray: the shard actor only holds an instance and forwards
calls, so every rule here (visibility, eviction, leases) is unit-testable.

Rules that keep readers from ever seeing wrong bytes:
- A write is two-phase. ``reserve`` hands out a fresh slot that nobody else
  can see; the client copies bytes into it; ``commit`` publishes it. Two
  writers of one key get two slots: the first commit wins, the other slot is
  freed. A published slot is never overwritten, so no reader sees a torn block.
- ``acquire`` pins entries under a lease; eviction skips pinned entries. A
  lease that outlives ``lease_s`` (its reader died) stops protecting the entry,
  and ``release`` then reports the lease as expired so the reader discards
  what it copied.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ucm_ray.store.allocator import ExtentAllocator

Key = bytes


@dataclass(frozen=True)
class Slot:
    """Where a committed entry's bytes live in the pool."""

    offset: int
    size: int
    checksum: int | None = None


@dataclass
class _Entry:
    slot: Slot
    pinned_by: set[int] = field(default_factory=set)


@dataclass
class _Pending:
    deadline: float
    slots: dict[Key, Slot]


@dataclass
class IndexStats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    pending_bytes: int
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_saves: int = 0
    commits: int = 0
    duplicate_commits: int = 0
    expired_leases: int = 0
    expired_reservations: int = 0


class BlockIndex:
    """Index of one pool. Not thread-safe: the owning actor serialises calls."""

    def __init__(self, capacity: int, *, lease_s: float, reserve_timeout_s: float,
                 align: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self._alloc = ExtentAllocator(capacity, align)
        self._lease_s = lease_s
        self._reserve_timeout_s = reserve_timeout_s
        self._clock = clock
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # LRU first, MRU last
        self._pending: dict[int, _Pending] = {}
        self._leases: dict[int, tuple[float, list[Key]]] = {}
        self._ids = itertools.count(1)
        self._used = 0
        self._counters = IndexStats(capacity_bytes=self._alloc.capacity, used_bytes=0,
                                    entries=0, pending_bytes=0)

    # --- reads ---------------------------------------------------------------------------

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys are committed. Touches hits so a looked-up prefix stays warm."""
        out = []
        for k in keys:
            hit = k in self._entries
            if hit:
                self._entries.move_to_end(k)
            out.append(hit)
        self._counters.lookups += len(keys)
        self._counters.hits += sum(out)
        return out

    def acquire(self, keys: Sequence[Key]) -> tuple[int, list[Slot | None]]:
        """Pin the committed ones among ``keys``; returns (lease id, slot or None per key)."""
        self._expire()
        lease = next(self._ids)
        slots: list[Slot | None] = []
        pinned: list[Key] = []
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                slots.append(None)
                continue
            self._entries.move_to_end(k)
            e.pinned_by.add(lease)
            pinned.append(k)
            slots.append(e.slot)
        if pinned:
            self._leases[lease] = (self._clock() + self._lease_s, pinned)
        return lease, slots

    def release(self, lease: int) -> bool:
        """Unpin; False when the lease had expired (the copied bytes may be stale)."""
        held = self._leases.pop(lease, None)
        if held is None:
            return False
        deadline, keys = held
        for k in keys:
            e = self._entries.get(k)
            if e is not None:
                e.pinned_by.discard(lease)
        return self._clock() <= deadline

    # --- writes --------------------------------------------------------------------------

    def reserve(self, items: Sequence[tuple[Key, int]]) -> tuple[int, list[int | None]]:
        """Slots for new keys: offset per item, None when present already or no room."""
        self._expire()
        token = next(self._ids)
        pending = _Pending(deadline=self._clock() + self._reserve_timeout_s, slots={})
        offsets: list[int | None] = []
        for key, size in items:
            if size <= 0:
                raise ValueError(f"entry size must be > 0, got {size}")
            if key in self._entries or key in pending.slots:
                offsets.append(None)
                continue
            off = self._allocate(size)
            if off is None:
                self._counters.dropped_saves += 1
                offsets.append(None)
                continue
            pending.slots[key] = Slot(off, size)
            offsets.append(off)
        if pending.slots:
            self._pending[token] = pending
        return token, offsets

    def commit(self, token: int, keys: Sequence[Key],
               checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish reserved keys whose bytes landed; per key, whether it is now visible
        from this write (False: the reservation expired or another writer won)."""
        pending = self._pending.get(token)
        out = []
        for i, k in enumerate(keys):
            slot = pending.slots.pop(k, None) if pending else None
            if slot is None:
                out.append(False)
                continue
            if k in self._entries:
                self._alloc.free(slot.offset, slot.size)
                self._counters.duplicate_commits += 1
                out.append(False)
                continue
            csum = checksums[i] if checksums is not None else None
            self._entries[k] = _Entry(Slot(slot.offset, slot.size, csum))
            self._used += slot.size
            self._counters.commits += 1
            out.append(True)
        if pending is not None and not pending.slots:
            del self._pending[token]
        return out

    def abort(self, token: int, keys: Sequence[Key] | None = None) -> None:
        """Free reserved slots whose bytes did not land (all of the token's when keys is None)."""
        pending = self._pending.get(token)
        if pending is None:
            return
        for k in list(pending.slots) if keys is None else keys:
            slot = pending.slots.pop(k, None)
            if slot is not None:
                self._alloc.free(slot.offset, slot.size)
        if not pending.slots:
            del self._pending[token]

    def remove(self, keys: Sequence[Key]) -> int:
        """Drop unpinned entries (e.g. a checksum mismatch seen by a reader)."""
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is not None and not e.pinned_by:
                self._drop(k)
                n += 1
        return n

    # --- accounting ----------------------------------------------------------------------

    def stats(self) -> IndexStats:
        s = self._counters
        s.used_bytes = self._used
        s.entries = len(self._entries)
        s.pending_bytes = sum(sl.size for p in self._pending.values() for sl in p.slots.values())
        return IndexStats(**vars(s))

    def _allocate(self, size: int) -> int | None:
        off = self._alloc.alloc(size)
        if off is not None:
            return off
        if self._alloc.rounded(size) > self._alloc.capacity:
            return None
        while True:
            victim = next((k for k, e in self._entries.items() if not e.pinned_by), None)
            if victim is None:
                return None
            self._drop(victim)
            self._counters.evictions += 1
            off = self._alloc.alloc(size)
            if off is not None:
                return off

    def _drop(self, key: Key) -> None:
        e = self._entries.pop(key)
        self._alloc.free(e.slot.offset, e.slot.size)
        self._used -= e.slot.size
        self._counters.evicted_bytes += e.slot.size

    def _expire(self) -> None:
        now = self._clock()
        for lease, (deadline, keys) in list(self._leases.items()):
            if deadline + self._lease_s < now:
                del self._leases[lease]  # its reader is long gone
            elif deadline < now and keys:
                # Keep the lease id so release() can report expiry, but stop pinning.
                for k in keys:
                    e = self._entries.get(k)
                    if e is not None:
                        e.pinned_by.discard(lease)
                self._leases[lease] = (deadline, [])
                self._counters.expired_leases += 1
        for token, p in list(self._pending.items()):
            if p.deadline < now:
                self._counters.expired_reservations += 1
                self.abort(token)
