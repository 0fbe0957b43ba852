"""What one shard knows: key -> slot, LRU order, read pins and pending writes.

Plain Python, no Ray: the shard actor only holds an instance and forwards
calls, so every rule here (visibility, eviction, leases, fencing of writers)
is unit-testable.

Rules that keep readers from ever seeing wrong bytes:
- A write is two-phase. ``reserve`` hands out fresh, anonymous slots nobody
  else can see; the writer copies bytes into them; ``commit`` binds each slot
  to a key and publishes it. Two writers of one key write two slots: the first
  commit wins, the other slot is freed. A published slot is never overwritten.
- A reservation that outlives ``reserve_timeout_s`` (its writer is slow or
  gone) is *quarantined* for a further ``reserve_timeout_s``: its slots stay
  allocated but can no longer be committed. Only then are they freed, so a
  writer that is still copying never lands bytes in a slot someone else got.
  A writer that needs longer calls ``renew``.
- ``acquire`` pins entries under a lease; eviction skips pinned entries. A
  lease that outlives ``lease_s`` (its reader died) stops protecting the entry,
  and ``release`` then reports the lease as not held so the reader discards
  what it copied.
- Lease ids and grant tokens are random 63-bit values recorded with the
  ``owner`` (a client's random id) that asked: a release, renew or commit by
  anyone else has no effect, so a stale or foreign id can never unpin another
  reader's entry or publish into another writer's slot.
- ``remove`` (a reader found the entry corrupt) unlists the entry at once; a
  pinned entry's slot is freed only when its last pin goes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ucm_ray.store.published_layout import ON_DISK
from ucm_ray.store.shard.allocator import ExtentAllocator
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.store.types import Slot, random_id

Key = bytes
CLEAN_SCAN = 64
"""How many of the coldest unpinned entries eviction looks through for a clean one."""


@dataclass(eq=False)
class _Entry:
    slot: Slot
    pinned_by: set[int] = field(default_factory=set)
    listed: bool = True
    """False once removed: invisible, its slot freed when the last pin goes."""
    generation: int = 0
    """Its generation in the published index (0: not published, the table was full)."""
    clean: bool = False
    """A copy of its bytes is on the disk tier: evicting it loses nothing."""


@dataclass
class _Lease:
    owner: int
    deadline: float
    entries: list[_Entry]
    """The pinned entries (emptied once the lease lapsed and stopped pinning)."""


@dataclass
class _Grant:
    owner: int
    deadline: float
    size: int
    offsets: set[int]
    """Reserved slots not yet committed or freed."""
    quarantined: bool = False


@dataclass
class IndexStats:
    capacity_bytes: int
    used_bytes: int
    entries: int
    pending_bytes: int
    quarantined_bytes: int = 0
    pins: int = 0
    """Entry pins held by read leases not yet released or lapsed: a reader that vanished holds
    its pins until ``lease_s`` passes, and no longer (what a leak check reads)."""
    lookups: int = 0
    """Keys readers asked for (``acquire``: the connector's lookups), per shard asked."""
    hits: int = 0
    """Of those, the keys found: ``hits / lookups`` is the hit rate ``ucm-ray status`` shows."""
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_saves: int = 0
    commits: int = 0
    duplicate_commits: int = 0
    refused_commits: int = 0
    removals: int = 0
    expired_leases: int = 0
    expired_reservations: int = 0
    evicted_dirty: int = 0
    """Evictions, while a disk tier runs, of entries with no copy on disk (demotion fell behind)."""


class BlockIndex:
    """Index of one pool. Not thread-safe: the owning actor serialises calls."""

    def __init__(self, capacity: int, *, lease_s: float, reserve_timeout_s: float,
                 align: int = 64, clock: Callable[[], float] = time.monotonic,
                 published: PublishedIndex | None = None, prefer_clean: bool = False) -> None:
        """``published``: the shared-memory copy of this index that same-node readers look up
        without a call (kept in step here: listed at commit, unlisted before a slot is freed).
        ``prefer_clean``: a disk tier runs behind this pool; eviction takes the least recently
        used entry that has a copy on disk, among the ``CLEAN_SCAN`` coldest, before a dirty one."""
        self._published = published
        self._prefer_clean = prefer_clean
        self._alloc = ExtentAllocator(capacity, align)
        self._lease_s = lease_s
        self._reserve_timeout_s = reserve_timeout_s
        self._clock = clock
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # LRU first, MRU last
        self._grants: dict[int, _Grant] = {}
        self._leases: dict[int, _Lease] = {}
        self._used = 0
        self._on_disk: dict[Key, list[int]] = {}
        """Keys only the disk tier holds, listed in the published index: key -> [size, generation
        (0: no room in the table)]."""
        self._counters = IndexStats(capacity_bytes=self._alloc.capacity, used_bytes=0,
                                    entries=0, pending_bytes=0)

    # --- reads ---------------------------------------------------------------------------

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys are committed, without pinning (tests, benchmarks, ``put``'s skip of
        present keys). Touches hits so a looked-up prefix stays warm. A presence probe, not a
        read: it counts no lookup (``put`` probes every replica of every key it writes)."""
        out = [k in self._entries for k in keys]
        self._touch_head_last([k for k, hit in zip(keys, out) if hit])
        return out

    def acquire(self, owner: int, keys: Sequence[Key]) -> tuple[int, list[Slot | None]]:
        """Pin the committed ones among ``keys``; returns (lease id, slot or None per key).
        Counts lookups and hits: this is the engine's lookup."""
        lease, slots = self.pin(owner, keys)
        self._counters.lookups += len(keys)
        self._counters.hits += sum(s is not None for s in slots)
        return lease, slots

    def pin(self, owner: int, keys: Sequence[Key]) -> tuple[int, list[Slot | None]]:
        """``acquire`` without counting a lookup (the disk tier holds what it promoted until the
        reader's own pin)."""
        self._expire()
        lease = self._fresh_id(self._leases)
        slots: list[Slot | None] = []
        pinned: list[_Entry] = []
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                slots.append(None)
                continue
            if lease not in e.pinned_by:
                e.pinned_by.add(lease)
                pinned.append(e)
            slots.append(e.slot)
        self._touch_head_last([k for k, slot in zip(keys, slots) if slot is not None])
        if pinned:
            self._leases[lease] = _Lease(owner, self._clock() + self._lease_s, pinned)
        return lease, slots

    def extend_pin(self, owner: int, lease_id: int, key: Key) -> bool:
        """Add ``key``'s entry to ``owner``'s lease ``lease_id`` (made if ``pin`` found nothing to
        pin); False when the key is absent or the lease is someone else's."""
        e = self._entries.get(key)
        lease = self._leases.get(lease_id)
        if lease is None:
            lease = self._leases[lease_id] = _Lease(owner, self._clock() + self._lease_s, [])
        if e is None or lease.owner != owner:
            return False
        if lease_id not in e.pinned_by:
            e.pinned_by.add(lease_id)
            lease.entries.append(e)
        return True

    def touch(self, keys: Sequence[Key], asked: int) -> None:
        """What a reader found in the published index (``asked`` keys, ``keys`` the hits): counted
        as lookups and hits, and made recently used, as ``acquire`` does."""
        self._counters.lookups += asked
        self._counters.hits += len(keys)
        self._touch_head_last([k for k in keys if k in self._entries])

    def release(self, owner: int, lease_ids: Sequence[int]) -> list[bool]:
        """Unpin; per lease, False when it was not held by ``owner`` (unknown, someone
        else's: then nothing changes) or had expired (the copied bytes may be stale)."""
        out = []
        now = self._clock()
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner != owner:
                out.append(False)
                continue
            del self._leases[lease_id]
            self._unpin(lease_id, lease)
            out.append(now <= lease.deadline)
        return out

    # --- writes --------------------------------------------------------------------------

    def reserve(self, owner: int, size: int, count: int) -> tuple[int, list[int]]:
        """Up to ``count`` fresh slots of ``size`` bytes, not bound to keys (evicting LRU
        unpinned entries for room); fewer when the pool has no room (each missing one is a
        dropped save)."""
        if size <= 0:
            raise ValueError(f"entry size must be > 0, got {size}")
        self._expire()
        token = self._fresh_id(self._grants)
        offsets: list[int] = []
        for _ in range(count):
            off = self._allocate(size)
            if off is None:
                self._counters.dropped_saves += count - len(offsets)
                break
            offsets.append(off)
        if offsets:
            self._grants[token] = _Grant(owner, self._clock() + self._reserve_timeout_s, size, set(offsets))
        return token, offsets

    def renew(self, owner: int, tokens: Sequence[int]) -> list[bool]:
        """Extend ``owner``'s reservations by ``reserve_timeout_s``; False for one that had
        expired (quarantined or gone) or is not ``owner``'s."""
        self._expire()
        out = []
        for token in tokens:
            g = self._grants.get(token)
            ok = g is not None and g.owner == owner and not g.quarantined
            if g is not None and ok:
                g.deadline = self._clock() + self._reserve_timeout_s
            out.append(ok)
        return out

    def commit(self, owner: int, token: int, items: Sequence[tuple[Key, int, int | None]],
               free_offsets: Sequence[int] = ()) -> list[bool]:
        """Bind slots of grant ``token`` to keys and publish them (items: key, offset,
        checksum or None), and free ``free_offsets`` (slots whose bytes did not land).
        Per item, whether the key is now visible from this write: False when the grant is
        not ``owner``'s, has expired, the offset is not an uncommitted slot of it, or the
        key is present already (then the slot is freed)."""
        self._expire()
        g = self._grants.get(token)
        if g is None or g.owner != owner or g.quarantined:
            self._counters.refused_commits += len(items)
            return [False] * len(items)
        out = []
        for key, offset, csum in items:
            if offset not in g.offsets:
                self._counters.refused_commits += 1
                out.append(False)
                continue
            g.offsets.discard(offset)
            if key in self._entries:
                self._alloc.free(offset, g.size)
                self._counters.duplicate_commits += 1
                out.append(False)
                continue
            entry = self._entries[key] = _Entry(Slot(offset, g.size, csum))
            self._on_disk.pop(key, None)  # its bucket is the pool entry's from here on
            if self._published is not None:
                entry.generation = self._published.publish(key, offset, g.size, csum)
            self._used += g.size
            self._counters.commits += 1
            out.append(True)
        for offset in free_offsets:
            if offset in g.offsets:
                g.offsets.discard(offset)
                self._alloc.free(offset, g.size)
        if not g.offsets:
            del self._grants[token]
        self._touch_head_last([key for (key, _, _), visible in zip(items, out) if visible])
        return out

    def remove(self, items: Sequence[tuple[Key, int]]) -> int:
        """Drop each key whose entry is still at that offset (a reader found it corrupt).
        Unlisted at once; a pinned entry's slot is freed when its last pin goes."""
        n = 0
        for key, offset in items:
            e = self._entries.get(key)
            if e is None or e.slot.offset != offset:
                continue
            del self._entries[key]
            self._unpublish(key)
            e.listed = False
            self._used -= e.slot.size
            if not e.pinned_by:
                self._alloc.free(e.slot.offset, e.slot.size)
            self._counters.removals += 1
            n += 1
        return n

    # --- the disk tier ---------------------------------------------------------------------

    def demotion_batch(self, owner: int, cold_bytes: int, max_bytes: int) -> tuple[int, list[tuple[Key, Slot]]]:
        """The dirty entries among the coldest ``cold_bytes`` bytes (at most ``max_bytes`` of
        them), pinned under a lease of ``owner`` so their slots stay put while their bytes go to
        disk; (lease id, [(key, slot)]). The tier sizes the cold end (its watermarks: admission)."""
        self._expire()
        lease = self._fresh_id(self._leases)
        cold = cold_bytes
        picked: list[_Entry] = []
        items: list[tuple[Key, Slot]] = []
        taken = 0
        for key, e in self._entries.items():
            if cold <= 0 or taken >= max_bytes:
                break
            cold -= e.slot.size
            if e.clean:
                continue
            e.pinned_by.add(lease)
            picked.append(e)
            items.append((key, e.slot))
            taken += e.slot.size
        if picked:
            self._leases[lease] = _Lease(owner, self._clock() + self._lease_s, picked)
        return lease, items

    def cold_dirty_bytes(self, cold_bytes: int) -> int:
        """Bytes of dirty entries among the coldest ``cold_bytes``: what demotion still owes."""
        cold, owed = cold_bytes, 0
        for e in self._entries.values():
            if cold <= 0:
                break
            cold -= e.slot.size
            owed += 0 if e.clean else e.slot.size
        return owed

    def mark_clean(self, items: Sequence[tuple[Key, int]]) -> None:
        """Each (key, offset) whose entry is still at that offset now has a copy on disk."""
        for key, offset in items:
            e = self._entries.get(key)
            if e is not None and e.slot.offset == offset:
                e.clean = True

    def disk_dropped(self, keys: Sequence[Key]) -> None:
        """The disk tier no longer holds ``keys``: their pool entries are the only copies again,
        and those not in the pool are unlisted from the published index."""
        for key in keys:
            e = self._entries.get(key)
            if e is not None:
                e.clean = False
            elif self._on_disk.pop(key, None) is not None and self._published is not None:
                self._published.unpublish(key)

    def disk_tier_off(self) -> None:
        """The disk tier failed and is off (``disk_dropped`` has handed back what it held):
        eviction is plain LRU again."""
        self._prefer_clean = False

    def list_on_disk(self, items: Sequence[tuple[Key, int]]) -> None:
        """(key, size) the disk tier holds and the pool does not (adopted at start, or evicted
        clean): listed in the published index, so a same-node reader asks the shard for them
        instead of taking the index's "absent" for an answer."""
        for key, size in items:
            if key in self._entries:
                continue
            generation = self._published.publish_on_disk(key, size) if self._published is not None else 0
            self._on_disk[key] = [size, generation]

    # --- accounting ----------------------------------------------------------------------

    def stats(self) -> IndexStats:
        self._expire()
        s = self._counters
        s.used_bytes = self._used
        s.entries = len(self._entries)
        s.pending_bytes = sum(len(g.offsets) * g.size for g in self._grants.values() if not g.quarantined)
        s.quarantined_bytes = sum(len(g.offsets) * g.size for g in self._grants.values() if g.quarantined)
        s.pins = sum(len(lease.entries) for lease in self._leases.values())
        return IndexStats(**vars(s))

    # --- internals -----------------------------------------------------------------------

    def _touch_head_last(self, keys: Sequence[Key]) -> None:
        """Make ``keys`` most recently used, the first of them last: callers list a prompt's
        blocks head first, and a prefix is only as good as its head (evicting block 0 of a
        prompt makes every later block of it unreachable), so eviction takes the tail first."""
        for key in reversed(keys):
            self._entries.move_to_end(key)

    @staticmethod
    def _fresh_id(taken: Mapping[int, object]) -> int:
        while True:
            i = random_id()
            if i not in taken:
                return i

    def _allocate(self, size: int) -> int | None:
        off = self._alloc.alloc(size)
        if off is not None:
            return off
        if self._alloc.rounded(size) > self._alloc.capacity:
            return None
        while True:
            victim = self._victim()
            if victim is None:
                return None
            e = self._entries.pop(victim)
            if self._prefer_clean and not e.clean:
                self._counters.evicted_dirty += 1
            self._unpublish(victim)
            if e.clean:
                self.list_on_disk([(victim, e.slot.size)])
            self._alloc.free(e.slot.offset, e.slot.size)
            self._used -= e.slot.size
            self._counters.evictions += 1
            self._counters.evicted_bytes += e.slot.size
            off = self._alloc.alloc(size)
            if off is not None:
                return off

    def _victim(self) -> Key | None:
        """The least recently used unpinned entry; with a disk tier, the least recently used
        clean one among the ``CLEAN_SCAN`` coldest unpinned, if any (bounded: a pool whose tail
        is all dirty must not cost a scan of the whole index per eviction)."""
        first: Key | None = None
        seen = 0
        for k, e in self._entries.items():
            if e.pinned_by:
                continue
            if first is None:
                first = k
                if not self._prefer_clean:
                    break
            if e.clean:
                return k
            seen += 1
            if seen >= CLEAN_SCAN:
                break
        return first

    def _unpublish(self, key: Key) -> None:
        """Unlist ``key`` from the published index before its slot can be freed; publish what
        found no room there before, once there is room."""
        pub = self._published
        if pub is None:
            return
        pub.unpublish(key)
        self._on_disk.pop(key, None)
        if pub.wants_refill:  # pool entries first: the disk's cost a call when unlisted, not a miss
            waiting = [(k, e.slot.offset, e.slot.size, e.slot.checksum)
                       for k, e in self._entries.items() if not e.generation]
            waiting += [(k, ON_DISK, size, None) for k, (size, generation) in self._on_disk.items() if not generation]
            for k, generation in pub.refill(waiting).items():
                if k in self._entries:
                    self._entries[k].generation = generation
                else:
                    self._on_disk[k][1] = generation

    def _unpin(self, lease_id: int, lease: _Lease) -> None:
        for e in lease.entries:
            if lease_id not in e.pinned_by:
                continue
            e.pinned_by.discard(lease_id)
            if not e.listed and not e.pinned_by:  # removed while pinned: its last pin went
                self._alloc.free(e.slot.offset, e.slot.size)
        lease.entries = []

    def _expire(self) -> None:
        now = self._clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.deadline + self._lease_s < now:
                del self._leases[lease_id]  # its reader is long gone; forget the id too
                self._unpin(lease_id, lease)
            elif lease.deadline < now and lease.entries:
                # Keep the id so release() can report expiry, but stop pinning.
                self._unpin(lease_id, lease)
                self._counters.expired_leases += 1
        for token, g in list(self._grants.items()):
            if g.deadline >= now:
                continue
            if not g.quarantined:
                # Its writer may still be copying: keep the slots allocated but uncommittable, for
                # a full timeout from now (not from the old deadline: after a long pause of this
                # shard, a late write may be about to land).
                g.quarantined = True
                g.deadline = now + self._reserve_timeout_s
                self._counters.expired_reservations += 1
                continue
            for off in g.offsets:
                self._alloc.free(off, g.size)
            del self._grants[token]
