"""Moves entries between a shard's pool and its ``DiskStore``: demotion ahead of eviction,
promotion back into the pool on a hit.

Why this shape: the pool stays the only place block bytes are read from (engines copy from it
as today); the disk only ever talks to the pool. Demotion copies the coldest dirty entries of a
pool above its high watermark until its coldest ``used - low`` bytes are all on disk, so the
index's eviction (``prefer_clean``) finds clean entries and a save never waits on the disk.
A pool that has evicted since demotion last found its cold end clean counts as full (``used`` =
capacity): entries of mixed sizes fragment a pool, and a save that finds no hole large enough
evicts while the used bytes are under the high watermark. Measured by used bytes alone, such a
pool was never demoted and every eviction took a dirty entry (CI's lost keys, stop 56).
Both directions take the index lock only to pick, pin, commit or release, never across the
disk I/O: the shard's control calls go on while bytes move.

Write-back admission: an entry reaches disk only once it has aged to the cold end of a pool above
its watermark (a block read again before then never costs a disk write); ``through`` admits every
committed entry.

Manifests are written on a clock, not per batch: at most one per ``CHECKPOINT_S`` and never more
than a tenth of the demotion time (a manifest is rewritten whole, and listing 10x a pool of small
entries costs tens of milliseconds). An entry marked clean before its manifest is safe: until a
crash the store serves it, and a crash loses the pool's copy too, so it is lost, never wrong.

Promotion is planned against the measured cost of its reads (``ReadCost``: a chunk's seconds as a
fixed part plus a part per byte, fitted to the chunks this tier read): keys are read only while
reading is worth it. A chunk that would take longer to read than the asking engine takes to
recompute it (the prefill's KV bytes per second: the engine's own measured rate, sent with its
lookup, or the fleet's ``recompute_bytes_s`` where that is set) is not read, and nor is anything
after it; otherwise only the head of a lookup's disk keys that is predicted read within ``wait_s`` is
reserved and read, so no clean entry is evicted for a read the bound would give up anyway. The
keys cut are misses, recomputed (``promote_skipped``). The bound is ``wait_s`` or what is left of
the asker's own budget, whichever ends first (``promote_pinned``'s ``budget_s``): a promotion
queued behind others must not read for an asker that stopped waiting.

``TierStats`` changes under a lock of its own (the demotion thread, the shard's disk thread and its
default thread all count; ``+=`` from two threads loses updates), never held across I/O: a
shard's ``stats`` call does not wait behind a demotion batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from itertools import groupby

import torch

from ucm_ray.store.shard.disk.read_cost import ReadCost
from ucm_ray.store.shard.disk.store import DiskStats, DiskStore
from ucm_ray.store.shard.index import BlockIndex, IndexStats, Key
from ucm_ray.store.types import random_id

PROMOTE_CHUNK = 32
"""Keys a promotion reserves, reads and commits together (a 4k-token prompt of 16-token blocks is
256 keys: eight chunks, each with one deadline check)."""
CHECKPOINT_S = 1.0
CHECKPOINT_SHARE = 10
"""A manifest is due ``CHECKPOINT_S`` after the last, or ``CHECKPOINT_SHARE`` times the last one's
duration where that is longer (manifest writes take at most a tenth of the tier's time)."""
RATE_WEIGHT = 0.3
"""Weight of the newest chunk in the measured read cost: a few chunks follow a change of load."""
CLEAN_LOW, CLEAN_LOW_LARGE_DISK = 0.75, 0.5
"""The default low watermark: a quarter of the pool kept clean, half where the disk is at least
``LARGE_DISK`` pools (``clean_low``)."""
LARGE_DISK = 2
PROBE_S = 10.0
"""While the plan cuts keys, one chunk is still read when nothing was for this long: the rate is
only measured by reading, and a rate measured under a burst of load must be able to recover."""


@dataclass
class TierStats:
    demoted: int = 0
    demoted_bytes: int = 0
    promoted: int = 0
    promoted_bytes: int = 0
    promote_misses: int = 0
    """Keys asked to be promoted that the disk did not hold, or whose bytes failed their check."""
    promote_late: int = 0
    """Keys left unpromoted because the call had spent its ``wait_s`` (misses, recomputed)."""
    promote_skipped: int = 0
    """Keys not read because the measured rate said reading them costs more than recomputing, or
    would not end within ``wait_s`` (misses, recomputed)."""


@dataclass
class _Chunk:
    """A chunk of a promotion whose reads are in flight."""
    sizes: list[int | None]
    """Per key of the chunk, its size on disk (None: not there, a miss)."""
    grants: list[tuple[int, int, int, int]]
    """(key's index, grant token, pool offset, size) of the keys reserved and being read."""
    finish: Callable[[], list[bool | None]]
    started: float


def clean_low(disk_bytes: int, pool_bytes: int) -> float:
    """The default low watermark: the pool's cold end kept clean is ``1 - low`` of it. Why half
    where the disk is large: with saves on the writer's node one pool takes a whole long prompt
    back (a promotion) or in (its save), up to ~40 % of it, and past the clean share evicts dirty
    entries, lost for good. Why a quarter where it is not: the clean share's copies take disk room
    that would hold other entries (half of the pool is a quarter of a disk twice its size).
    Simulated at 10 nodes (``benchmarks/scale_evict.py``, random / sticky routers): half clean
    gains 0.5 / 0.2 points of hits with a disk of 2 pools and 0.5 / 0.6 with 4, loses 1.6 with 1;
    with 1.5 pools 0.625 loses 0.8 / gains 0.2, hence a step (docs/scaling.md, stop 62)."""
    return CLEAN_LOW_LARGE_DISK if disk_bytes >= LARGE_DISK * pool_bytes else CLEAN_LOW


class DiskTier:
    def __init__(self, index: BlockIndex, pool: torch.Tensor, store: DiskStore,
                 index_lock: AbstractContextManager, *, write_through: bool = False,
                 high: float = 0.9, low: float | None = None, batch_bytes: int = 64 << 20,
                 wait_s: float = 0.5, recompute_bytes_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``pool``: the pool's bytes (uint8); ``index_lock`` serialises ``index`` with the
        shard's control calls. Watermarks are fractions of the pool's capacity (``low``: by default
        ``clean_low`` of the disk's and the pool's sizes). ``wait_s``: the
        longest one ``promote`` reads from disk (on the shard's disk thread: its other calls go on).
        ``recompute_bytes_s``: the KV bytes per second the engines' prefill recomputes; a disk
        measured slower is not read (0: the asking engine's rate, given to ``promote_pinned``).
        ``clock``: the time of a promotion's ``wait_s`` deadline and of its reads' measured cost
        (``read_cost``: what the plan weighs against the deadline; a test's own passes it when the
        test's slow disk says its reads took that long, not when the host was slow)."""
        capacity = self._capacity = index.stats().capacity_bytes
        if low is None:
            low = clean_low(store.snapshot().capacity_bytes, capacity)
        if not 0 <= low <= high <= 1:
            raise ValueError(f"watermarks must satisfy 0 <= low <= high <= 1, got {low}, {high}")
        self._index = index
        self._pool = pool
        self._store = store
        self._lock = index_lock
        self._disk_lock = threading.Lock()  # DiskStore is not thread-safe
        self._high = 0 if write_through else int(high * capacity)
        self._low = 0 if write_through else int(low * capacity)
        # Entries of a batch stay pinned while it is written: a batch of at most 1/64 of the pool
        # (and at least one entry) keeps saves from finding the pool's cold end pinned.
        self._batch_bytes = min(batch_bytes, max(1, capacity // 64))
        self._wait_s = wait_s
        self._clock = clock
        self._recompute_bytes_s = recompute_bytes_s
        self.read_cost = ReadCost(RATE_WEIGHT)
        """Measured: what a chunk of this tier's promotion reads costs (fixed + per byte)."""
        self._probed_at = time.monotonic()
        self._owner = random_id()
        self._checkpointed_at = time.monotonic()
        self._checkpoint_s = 0.0
        self._off = False
        self._evictions_seen = index.stats().evictions
        """The pool's eviction count when demotion last found its cold end clean: more since
        means the pool is evicting (full in effect, whatever its used bytes say)."""
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        with self._lock:  # what a restart adopted: same-node readers must ask for it
            self._index.list_on_disk([(k, store.size_of(k) or 0) for k in store.keys()])

    def demote_once(self) -> int:
        """One batch: the pool's coldest dirty entries to disk. Returns the bytes written (0 when
        the pool is under its high watermark, everything cold is clean, or the tier is off)."""
        if not self._store.enabled:
            self._after_turned_off()
            return 0
        with self._lock:
            stats = self._index.stats()
            used = self._used(stats)
            if used <= self._high:
                return 0
            lease, items = self._index.demotion_batch(self._owner, used - self._low, self._batch_bytes)
            if not items:  # the cold end is clean: caught up with the evictions so far
                self._evictions_seen = stats.evictions
                return 0
        done: list[tuple[Key, int]] = []
        gone: list[Key] = []
        written = 0
        try:
            with self._disk_lock:
                stored = self._store.put_many([key for key, _ in items],
                                              [self._pool[slot.offset:slot.offset + slot.size] for _, slot in items])
                gone = self._store.take_gone()
            done = [(key, slot.offset) for (key, slot), ok in zip(items, stored) if ok]
            written = sum(slot.size for (_, slot), ok in zip(items, stored) if ok)
        finally:
            with self._lock:
                self._index.mark_clean(done)
                self._index.disk_dropped(gone)
                self._index.release(self._owner, [lease])
        self._count(demoted=len(done), demoted_bytes=written)
        if not self._store.enabled:  # a write failed: the disk is off from now on
            self._after_turned_off()
        return written

    def demote(self) -> int:
        """Batches until demotion owes nothing, or a pool's worth was written: a disk smaller
        than the pool's cold end evicts what it was just given (those entries are dirty again),
        and without the cap this would rewrite them forever."""
        total = 0
        while total < self._capacity and (done := self.demote_once()):
            total += done
            self.checkpoint_if_due()
        self.checkpoint_if_due()
        return total

    def checkpoint_if_due(self) -> bool:
        """Write the store's manifest if one is due (see the module's docstring): whether one was.
        The shard's demotion thread calls ``demote`` every half second, idle or not, so an entry
        written is listed within about ``CHECKPOINT_S`` of its write."""
        now = time.monotonic()
        if now - self._checkpointed_at < max(CHECKPOINT_S, CHECKPOINT_SHARE * self._checkpoint_s):
            return False
        with self._disk_lock:
            before = self._store.stats.manifests
            self._store.checkpoint()
            gone = self._store.take_gone()
            wrote = self._store.stats.manifests != before
        if gone:
            with self._lock:
                self._index.disk_dropped(gone)
        if not self._store.enabled:
            self._after_turned_off()
        done = time.monotonic()
        if wrote:
            self._checkpoint_s = done - now
        self._checkpointed_at = done
        return wrote

    def _after_turned_off(self) -> None:
        """Once the disk failed: what it held is the pool's alone again (readers stop asking the
        shard for it), and eviction goes back to plain LRU, counting nothing as "fell behind"."""
        if self._off:
            return
        with self._disk_lock:
            gone = self._store.take_gone()
        with self._lock:
            self._index.disk_dropped(gone)
            self._index.disk_tier_off()
        self._off = True

    def behind(self) -> bool:
        """Whether demotion still owes a batch (the pool's cold end holds dirty entries; never once
        the tier is off: nothing will demote them)."""
        if not self._store.enabled:
            return False
        with self._lock:
            used = self._used(self._index.stats())
            return used > self._high and self._index.cold_dirty_bytes(used - self._low) > 0

    def _used(self, stats: IndexStats) -> int:
        """The pool's used bytes as the watermarks see them: its capacity while it is evicting
        (see the module's docstring)."""
        return self._capacity if stats.evictions != self._evictions_seen else stats.used_bytes

    def on_disk(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys the disk holds: dict probes without the disk lock, so a lookup never waits
        behind a demotion batch's I/O (a membership test of a dict is atomic under the GIL; an
        answer that races an eviction is a promotion that misses, as any stale lookup is)."""
        return self._store.contains(keys)

    @property
    def stats(self) -> TierStats:
        """A copy of the tier's counters, taken under their lock."""
        with self._stats_lock:
            return replace(self._stats)

    def _count(self, **added: int) -> None:
        """Adds to the counters named (see the module's docstring: why a lock)."""
        with self._stats_lock:
            for name, n in added.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def disk_stats(self) -> DiskStats:
        """Without the disk lock: a shard's ``stats`` call must not wait behind a demotion
        batch's I/O (a copy of counters; one a write is changing is off by that write)."""
        return self._store.snapshot()

    def close(self) -> None:
        with self._disk_lock:
            self._store.close()

    def promote(self, keys: Sequence[Key], recompute_bytes_s: float = 0.0) -> list[bool]:
        """Bring ``keys`` from disk into the pool, head first; per key, whether it is in the pool
        now (already there, or read and committed). A key whose bytes fail their check is dropped
        from disk and reported False (the engine recomputes it)."""
        out, lease, _ = self.promote_pinned(keys, recompute_bytes_s)
        with self._lock:
            self._index.release(self._owner, [lease])
        return out

    def unpin(self, lease: int) -> None:
        with self._lock:
            self._index.release(self._owner, [lease])

    def promote_pinned(self, keys: Sequence[Key], recompute_bytes_s: float = 0.0,
                       budget_s: float | None = None) -> tuple[list[bool], int, list[int]]:
        """``promote``, with every key of ``keys`` in the pool pinned under one lease (release it
        with ``unpin`` once the reader pinned them), and the indices of the keys it read from disk
        (checked and committed): promoting a later key of a prompt must not
        evict an earlier one. Keys go in chunks of ``PROMOTE_CHUNK`` (one reservation, reads in
        flight together, one commit), the next chunk's reads in flight while the last one commits
        (the disk lock is held throughout: demotion waits, at most ``wait_s`` and a read); no read
        starts once ``wait_s`` has passed: the keys left are misses (recomputed), so no shard call
        waits on the disk longer than that and a read. ``recompute_bytes_s``: the asking engine's
        prefill rate (0.0: unknown, read), used unless the tier was given one. ``budget_s``: what is
        left of the asker's wait (None: no bound but ``wait_s``); ``wait_s`` and it count from
        this call, and the plan reads within what is left once the disk lock is taken (a demotion
        batch or another promotion may hold it); none left: nothing is read (those on disk count
        late). Nothing to read: no disk lock."""
        deadline = self._clock() + (self._wait_s if budget_s is None else min(self._wait_s, budget_s))
        with self._lock:
            lease, slots = self._index.pin(self._owner, keys)
        out = [s is not None for s in slots]
        missing = [i for i, found in enumerate(out) if not found]
        if budget_s is not None and budget_s <= 0:
            # dict probes, no disk lock: the answer waits behind no batch
            self._count(promote_late=sum(self._store.contains([keys[i] for i in missing])))
            missing = []
        if not missing:
            return out, lease, []
        started = 0
        with self._disk_lock:
            todo = self._worth_reading(keys, missing, self._recompute_bytes_s or recompute_bytes_s,
                                       deadline - self._clock())
            reading: _Chunk | None = None
            while started < len(todo) and self._clock() <= deadline:
                chunk = todo[started:started + PROMOTE_CHUNK]
                started += len(chunk)
                previous, reading = reading, self._start_chunk(chunk, keys, deadline)
                if previous is not None:
                    self._finish_chunk(previous, keys, lease, out)
                if len(reading.grants) < len(reading.sizes) - reading.sizes.count(None):
                    break  # the pool had no room even after eviction: later keys would evict these
            else:
                self._count(promote_late=len(todo) - started)  # past the deadline: never started
            if reading is not None:
                self._finish_chunk(reading, keys, lease, out)
        if not self._store.enabled:  # a read failed: the disk is off from now on
            self._after_turned_off()
        return out, lease, [i for i in missing if out[i]]

    def _worth_reading(self, keys: Sequence[Key], todo: list[int], recompute_bytes_s: float,
                       budget: float) -> list[int]:
        """Under the disk lock: the head of ``todo`` (indices of ``keys`` the pool lacks) to read,
        as the module's docstring says, chunk by chunk as ``promote_pinned`` reads them: all of it
        until a chunk was measured; then chunks while each costs less to read than to recompute
        (``read_cost`` against ``recompute_bytes_s``; 0: no limit) and the reads end within
        ``budget`` seconds, and of the chunk that would not end in time, the keys that would. When
        that cuts keys and nothing was read for ``PROBE_S``, one chunk is read regardless (the cost
        is measured again). No budget left: all of it (the caller finds its deadline passed and
        counts them late, not skipped)."""
        if not self.read_cost.samples or not todo or budget <= 0:
            return todo
        fixed, per_byte = self.read_cost.fit()
        keep = 0
        for first in range(0, len(todo), PROMOTE_CHUNK):
            sizes = [self._store.size_of(keys[i]) or 0 for i in todo[first:first + PROMOTE_CHUNK]]
            if recompute_bytes_s and fixed + per_byte * sum(sizes) > sum(sizes) / recompute_bytes_s:
                break  # recomputing these is faster than reading them
            spent, fits = fixed, 0
            for size in sizes:
                spent += per_byte * size
                if spent > budget:
                    break
                fits += 1
            keep += fits
            budget -= spent
            if fits < len(sizes):
                break
        if keep < len(todo) and time.monotonic() - self._probed_at > PROBE_S:
            keep = max(keep, min(len(todo), PROMOTE_CHUNK))
            self._probed_at = time.monotonic()
        self._count(promote_skipped=len(todo) - keep)
        return todo[:keep]

    def _start_chunk(self, chunk: list[int], keys: Sequence[Key], deadline: float) -> _Chunk:
        """Under the disk lock: reserve pool slots for ``chunk`` (indices into ``keys``, head
        first, until the pool has no room) and start reading into them. One reservation per run
        of equal sizes, not per key: each index call costs a fresh id and a sweep of leases and
        grants, and at 64 KiB that was as much as the read (performance log)."""
        sizes = [self._store.size_of(keys[i]) for i in chunk]
        self._count(promote_misses=sizes.count(None))
        grants: list[tuple[int, int, int, int]] = []  # (key's index, token, offset, size)
        present = [(i, size) for i, size in zip(chunk, sizes) if size is not None]
        with self._lock:
            for size, run in groupby(present, key=lambda item: item[1]):
                wanted = [i for i, _ in run]
                token, offsets = self._index.reserve(self._owner, size, len(wanted))
                grants += [(i, token, offset, size) for i, offset in zip(wanted, offsets)]
                if len(offsets) < len(wanted):
                    break  # no room: the later keys would evict these
        started = self._clock()  # before: a one-key chunk is read right here
        finish = self._store.start_many([keys[i] for i, _, _, _ in grants],
                                        [self._pool[off:off + size] for _, _, off, size in grants], deadline,
                                        self._clock)
        return _Chunk(sizes, grants, finish, started)

    def _finish_chunk(self, chunk: _Chunk, keys: Sequence[Key], lease: int, out: list[bool]) -> None:
        """Under the disk lock: wait for ``chunk``'s reads, commit what was read and checked and
        pin it under ``lease`` (``out`` says which keys are pinned now), free the other slots:
        one commit per reservation."""
        read = chunk.finish()
        nbytes = sum(size for (_, _, _, size), ok in zip(chunk.grants, read) if ok is not None)
        self.read_cost.add(nbytes, self._clock() - chunk.started)
        if nbytes:
            self._probed_at = time.monotonic()  # measured: no probe is owed for another PROBE_S
        gone = self._store.take_gone()  # a failed check dropped it
        by_token: dict[int, list[tuple[int, int, int, bool | None]]] = {}
        for (i, token, offset, size), ok in zip(chunk.grants, read):
            by_token.setdefault(token, []).append((i, offset, size, ok))
        promoted = promoted_bytes = late = misses = 0
        with self._lock:
            self._index.disk_dropped(gone)
            for token, granted in by_token.items():
                read_ok = [(i, offset, size) for i, offset, size, ok in granted if ok]
                self._index.commit(self._owner, token, [(keys[i], offset, None) for i, offset, _ in read_ok],
                                   [offset for _, offset, _, ok in granted if not ok])
                self._index.mark_clean([(keys[i], offset) for i, offset, _ in read_ok])
                for i, _, _ in read_ok:
                    # pinned under the call's lease (or found: a writer committed it meanwhile)
                    out[i] = self._index.extend_pin(self._owner, lease, keys[i])
                promoted += len(read_ok)
                promoted_bytes += sum(size for _, _, size in read_ok)
                unread = sum(ok is None for _, _, _, ok in granted)
                late += unread
                misses += len(granted) - len(read_ok) - unread
        self._count(promoted=promoted, promoted_bytes=promoted_bytes, promote_late=late, promote_misses=misses)
