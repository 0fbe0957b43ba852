"""One shard's disk tier: large preallocated files, fixed slots, LRU, a manifest, adoption.

Why it looks like this:
- A few large files per shard (one per root, ``files_per_root`` each), slots handed out by the
  pool's own ``ExtentAllocator`` at 4 KiB alignment: no file per block, no per-block metadata
  I/O; a lookup is a dict probe and never touches the disk.
- The bound: the files are preallocated to ``capacity`` bytes in all (rounded down to 4 KiB per
  file) and never grow; slots live inside them, so the tier cannot pass ``disk_bytes``.
- Crash consistency without a journal: the manifest lists (key, slot, checksum) as of one
  generation and is replaced atomically (data files fsynced, manifest written to a temporary
  name and fsynced, renamed over the old one, directory fsynced). A restarted store adopts what
  the manifest lists, in a new generation; whatever was written after it is not listed and its
  slots are free again: lost, never leaked. A slot the current manifest lists is not reused
  before the next manifest is durable (an entry evicted meanwhile *retires* its slot), so a
  manifest never names bytes that were overwritten after it.
- Every read verifies the entry's checksum before a byte is served (``store.checksum``), adopted
  or not: a flipped byte on disk is a miss and the entry is dropped. Reads land in a staging
  buffer of the reading thread, are checked there and only then copied to the caller's memory
  (unchecked bytes never reach the pool; and ``O_DIRECT`` reads straight into pool pages ran at
  half the rate of reads into a reused buffer here, performance log). Entries next to each
  other in a file are one read (``coalesce``), each still checked on its own.
- A failing disk (ENOSPC, EIO, any OSError on the tier's files) turns the tier off with one log
  line and a counter; the caller goes on with DRAM only. Files are left for the operator.
- One store per directory: an exclusive ``flock`` on a lock file; a second store (another shard
  configured on the same files, or a stale copy of this one) is refused with ``DiskInUse``.

Not thread-safe: the owner serialises calls (the shard's demotion thread).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ucm_ray.store.checksum import checksum
from ucm_ray.store.shard.allocator import ExtentAllocator
from ucm_ray.store.shard.disk.fileops import DIRECT_ALIGN, FileOps, aligned_buffer, round_up
from ucm_ray.store.shard.disk.manifest import DiskSlot, Layout, Manifest, ManifestError, decode, encode

log = logging.getLogger(__name__)

MANIFEST = "manifest"
LOCK = "lock"
EVICT_AHEAD = 16
"""When a write finds no room, evict until 1/16 of the tier is free (or retired) and write one
manifest: evicted slots that the durable manifest lists are reusable only after the next one,
so evicting ahead keeps that to one manifest per 1/16 of the capacity written, not one per write."""


class DiskInUse(RuntimeError):
    """Another store (in this process or another) holds this directory's lock."""


@dataclass
class DiskStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    """Bytes of slots holding entries, plus retired slots awaiting the next manifest."""
    entries: int = 0
    enabled: bool = True
    direct_io: bool = True
    writes: int = 0
    written_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    dropped_writes: int = 0
    """Writes refused: the entry is larger than one data file."""
    corrupt: int = 0
    """Reads whose bytes did not match the entry's checksum (the entry was dropped)."""
    io_errors: int = 0
    adopted: int = 0
    """Entries re-adopted from the manifest at start."""
    refused_at_adoption: int = 0
    """Manifest records that were out of bounds or overlapped another (never served)."""
    manifests: int = 0
    generation: int = 0


READ_DEPTH = 4
"""Reads one promotion keeps in flight: at depth 1, 64 KiB entries spent more time in the
shard's per-entry work than in the disk (performance log); threads overlap the two."""

COALESCE_BYTES = 1 << 20
"""Adjacent entries are read together up to this many bytes a read: 64 KiB entries read one by
one spent more time per entry in Python, system calls and thread hand-offs than in the disk
(performance log, 2026-12-05 night)."""

WRITE_RUN_BYTES = 8 << 20
"""Entries in adjacent slots are written together up to this many bytes a write: at depth 1 this
disk took 64 KiB writes at 0.40-0.48 GB/s and 4-8 MiB ones at 1.6-1.9 GB/s, vectored from scattered
64 KiB buffers alike (performance log, 2026-12-06 disk9)."""

IOV_MAX = 1024
"""Buffers one ``pwritev`` takes on Linux."""

DIR_PREFIX = "ucm-ray-disk-"


def coalesce(slots: Sequence[DiskSlot | None], limit: int | None = None, most: int = IOV_MAX) -> list[list[int]]:
    """Indices of ``slots`` grouped into reads (or writes): runs of slots that follow each other in
    one file (in file order; demotion writes a prompt's blocks tail first, so a prompt's slots run
    backwards), at most ``limit`` bytes (``COALESCE_BYTES`` unless given) and ``most`` slots a run
    unless one slot is larger. Runs are ordered by their first index in ``slots``, so the head of
    a prompt is read first. None is skipped."""
    limit = COALESCE_BYTES if limit is None else limit
    present = sorted(((i, s) for i, s in enumerate(slots) if s is not None), key=lambda p: (p[1].file, p[1].offset))
    runs: list[list[int]] = []
    file = start = end = -1
    for i, slot in present:
        if (runs and (slot.file, slot.offset) == (file, end) and end + round_up(slot.size) - start <= limit
                and len(runs[-1]) < most):
            runs[-1].append(i)
        else:
            runs.append([i])
            file, start = slot.file, slot.offset
        end = slot.offset + round_up(slot.size)
    runs.sort(key=min)
    return runs


def shard_dir(root: str, shard_id: str) -> str:
    return os.path.join(root, f"{DIR_PREFIX}{shard_id}")


def purge(roots: Sequence[str], shard_prefix: str) -> int:
    """Delete the disk tier files of every shard whose id starts with ``shard_prefix`` under
    ``roots`` (``ucm-ray down --purge-disk``; nothing else deletes them, so a restarted shard
    adopts what they hold). A shard whose lock is held (a running store) is left alone. Returns
    how many shards' files went."""
    shards = {name[len(DIR_PREFIX):] for root in roots if os.path.isdir(root)
              for name in os.listdir(root) if name.startswith(DIR_PREFIX + shard_prefix)}
    purged = 0
    for shard_id in sorted(shards):
        dirs = [shard_dir(r, shard_id) for r in roots]
        lock = os.path.join(dirs[0], LOCK)
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC) if os.path.exists(lock) else None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    log.warning("disk tier %s is in use by a running shard: not purged", dirs[0])
                    continue
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            purged += 1
        finally:
            if fd is not None:
                os.close(fd)
    return purged


class DiskStore:
    def __init__(self, roots: Sequence[str], shard_id: str, capacity: int, *,
                 files_per_root: int = 1, ops: FileOps | None = None) -> None:
        """Open (creating and preallocating) ``shard_id``'s files under each of ``roots``, lock
        them, and adopt what the last manifest lists. Raises ``DiskInUse`` when another store
        holds them, ValueError when ``capacity`` leaves a file under 4 KiB; a disk error while
        preallocating leaves the tier off (``enabled`` False), as one later would."""
        if not roots or files_per_root < 1:
            raise ValueError("the disk tier needs at least one root and one file per root")
        self._ops = ops or FileOps()
        self._shard_id = shard_id
        self._dirs = [shard_dir(r, shard_id) for r in roots]
        self._home = self._dirs[0]
        nfiles = len(roots) * files_per_root
        file_bytes = capacity // nfiles // DIRECT_ALIGN * DIRECT_ALIGN
        if file_bytes < DIRECT_ALIGN:
            raise ValueError(f"disk_bytes {capacity} leaves less than {DIRECT_ALIGN} bytes for each of {nfiles} files")
        self._layout = Layout(nfiles, file_bytes)
        self.stats = DiskStats(capacity_bytes=nfiles * file_bytes)
        self._entries: OrderedDict[bytes, DiskSlot] = OrderedDict()  # LRU first
        self._gone: list[bytes] = []  # keys dropped since take_gone(): the pool's copies are dirty again
        self._listed: set[tuple[int, int]] = set()  # (file, offset) of slots the durable manifest lists
        self._retired: list[DiskSlot] = []
        self._allocs = [ExtentAllocator(file_bytes, DIRECT_ALIGN) for _ in range(nfiles)]
        self._fds: list[int] = []
        self._next_file = 0
        self._dirty = False
        self._bounce = aligned_buffer(DIRECT_ALIGN)  # writes of unaligned data
        self._staging = threading.local()  # reads: one aligned buffer per reading thread
        self._readers: ThreadPoolExecutor | None = None
        self._lock_fd = -1
        try:
            for d in self._dirs:
                os.makedirs(d, exist_ok=True)
            self._lock_fd = self._lock()
        except DiskInUse:
            raise
        except OSError as e:  # a full, read-only or failing disk: the shard starts with DRAM only
            self._turn_off(e, "creating its directory")
            return
        try:
            self._open_files(files_per_root)
            if self.stats.enabled:
                self._adopt()
        except BaseException:
            self.close(checkpoint=False)
            raise

    # --- set-up --------------------------------------------------------------------------

    def _lock(self) -> int:
        fd = os.open(os.path.join(self._home, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskInUse(f"disk tier {self._home} is in use by another shard (its lock is held)") from None
        return fd

    def _open_files(self, files_per_root: int) -> None:
        direct_all = True
        try:
            for d in self._dirs:
                for i in range(files_per_root):
                    fd, direct = self._ops.open_data(os.path.join(d, f"data-{i}"), self._layout.file_bytes)
                    self._fds.append(fd)
                    direct_all &= direct
        except OSError as e:
            self._turn_off(e, "preallocating its files")
            return
        self.stats.direct_io = direct_all
        if not direct_all:
            log.info("disk tier %s: O_DIRECT refused by the file system, using buffered I/O", self._home)

    def _adopt(self) -> None:
        path = os.path.join(self._home, MANIFEST)
        try:
            os.unlink(path + ".tmp")  # a manifest that was being written when the last store died
        except FileNotFoundError:
            pass
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        try:
            manifest = decode(data)
        except (ManifestError, ValueError, IndexError) as e:
            log.warning("disk tier %s: manifest unreadable (%s); starting empty", self._home, e)
            return
        if manifest.layout != self._layout:
            log.warning("disk tier %s: manifest describes %s, configured %s; starting empty",
                        self._home, manifest.layout, self._layout)
            return
        for key, slot in manifest.entries:
            if key in self._entries or not self._fits(slot, manifest.generation):
                self.stats.refused_at_adoption += 1
                continue
            try:
                self._allocs[slot.file].take(slot.offset, slot.size)
            except ValueError:
                self.stats.refused_at_adoption += 1
                continue
            self._entries[key] = slot
            self._listed.add((slot.file, slot.offset))
            self.stats.used_bytes += round_up(slot.size)
        self.stats.adopted = len(self._entries)
        self.stats.generation = manifest.generation + 1
        log.info("disk tier %s: adopted %d entries from generation %d", self._home, len(self._entries),
                 manifest.generation)

    def _fits(self, slot: DiskSlot, generation: int) -> bool:
        return (0 <= slot.file < self._layout.files and slot.size > 0 and slot.offset % DIRECT_ALIGN == 0
                and slot.offset + round_up(slot.size) <= self._layout.file_bytes and slot.generation <= generation)

    # --- reads ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.stats.enabled

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """No I/O: a dict probe per key (lookups must not wait on the disk)."""
        return [k in self._entries for k in keys]

    def size_of(self, key: bytes) -> int | None:
        slot = self._entries.get(key)
        return None if slot is None else slot.size

    def slot_of(self, key: bytes) -> DiskSlot | None:
        """Where ``key``'s bytes are (file number in root order, offset, size): benchmarks read
        the same extents raw to compare."""
        return self._entries.get(key)

    def keys(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._entries)

    def get(self, key: bytes, out: torch.Tensor) -> bool:
        """Read ``key``'s bytes into ``out`` (contiguous uint8, the entry's size) and verify them;
        False for a miss, a corrupt entry (then dropped) or a tier that is off."""
        return self.get_many([key], [out])[0] is True

    def get_many(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> list[bool | None]:
        """``get`` of each key into its ``out``, up to ``READ_DEPTH`` reads in flight, head first;
        None for a key whose read had not started by ``deadline`` (on ``clock``). Threads do the
        reads and checksums only (both release the GIL); the store's state changes here."""
        return self.start_many(keys, outs, deadline, clock)()

    def start_many(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], deadline: float | None = None,
                   clock: Callable[[], float] = time.monotonic) -> Callable[[], list[bool | None]]:
        """``get_many`` in two halves: the reads start now, and the call returned waits for them
        and applies their outcome (``get_many``'s answer). Between the two the owner may do other
        work but call nothing else of the store's (the tier commits the previous chunk of a
        promotion meanwhile). Entries lying next to each other in one file are read together
        (``coalesce``). Head first: each reader takes the next run in order and looks at the
        deadline as it takes it, so the runs started are a head of the list, whichever reader
        the host ran first (a reader that took run 1 could start it while run 0's reader, not
        yet run, found the deadline passed: a key read behind one not read is no hit)."""
        slots = self._slots_for(keys, outs)
        runs = coalesce(slots)
        results: list[bool | None | OSError] = [False] * len(keys)
        taking = threading.Lock()
        untaken = iter(range(len(runs)))

        def take() -> int | None:
            """The next run to read, or None: none left, or the deadline passed (then this run
            and every later one are late: None in ``results``)."""
            with taking:
                at = next(untaken, None)
                if at is None or deadline is None or clock() <= deadline:
                    return at
                for late in (at, *untaken):
                    for i in runs[late]:
                        results[i] = None
                return None

        def read_runs() -> None:
            while (at := take()) is not None:
                self._read_run(runs[at], slots, outs, results)

        depth = max(1, min(READ_DEPTH, len(runs)))
        stripes: list[Future] = []
        if depth <= 1:
            read_runs()
        else:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="ucm-ray-disk-read")
            stripes = [self._readers.submit(read_runs) for _ in range(depth)]  # a task per thread, not per run

        def finish() -> list[bool | None]:
            for stripe in stripes:
                stripe.result()
            return [self._after_read(k, slot, r) for k, slot, r in zip(keys, slots, results)]

        return finish

    def _read_run(self, run: list[int], slots: Sequence[DiskSlot | None], outs: Sequence[torch.Tensor],
                  results: list[bool | None | OSError]) -> None:
        """On a reader thread: read the run ``run`` (indices of adjacent ``slots``) and set each
        index's outcome in ``results``: checked (True) or not (False), or the error that stopped it."""
        try:
            checked: list[bool | None | OSError] = list(
                self._read_checked([slots[i] for i in run], [outs[i] for i in run]))  # type: ignore[misc]  # coalesce skips None
        except OSError as e:
            checked = [e] * len(run)
        for i, outcome in zip(run, checked):
            results[i] = outcome

    def _slots_for(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[DiskSlot | None]:
        """Each key's slot (None: not here, or the tier is off), checking its ``out`` fits it."""
        slots = [self._entries.get(k) if self.stats.enabled else None for k in keys]
        for slot, out in zip(slots, outs):
            if slot is not None and (out.dtype != torch.uint8 or out.numel() != slot.size or not out.is_contiguous()):
                raise ValueError(f"out must be {slot.size} contiguous bytes, got {out.dtype} x {out.numel()}")
        return slots

    def _after_read(self, key: bytes, slot: DiskSlot | None, result: bool | None | OSError) -> bool | None:
        if isinstance(result, OSError):
            self._turn_off(result, "reading")
            return False
        if slot is None:
            self.stats.misses += 1
            return False
        if result is None or not self.stats.enabled:  # late, or an earlier read of the batch failed
            return None if result is None else False
        self.stats.reads += 1
        self.stats.read_bytes += slot.size
        if not result:
            self.stats.corrupt += 1
            log.warning("disk tier %s: entry at file %d offset %d failed its checksum; dropped",
                        self._home, slot.file, slot.offset)
            self._drop(key)
            return False
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return True

    # --- writes --------------------------------------------------------------------------

    def put(self, key: bytes, data: torch.Tensor) -> bool:
        """Write ``data`` (contiguous uint8) under ``key``, evicting least recently used entries
        for room. True when the entry is now on disk (written now or already there)."""
        return self.put_many([key], [data])[0]

    def put_many(self, keys: Sequence[bytes], datas: Sequence[torch.Tensor]) -> list[bool]:
        """``put`` of each key, entering the LRU in the order given. Why a batch: its slots are
        allocated together, so entries landing next to each other in one file (as a filling file,
        or one freed by evicting ahead, hands them out) are written with one ``pwritev``
        (``coalesce``, up to ``WRITE_RUN_BYTES``). Allocation goes a group of at most
        ``1/EVICT_AHEAD`` of the tier at a time: slots of a group are not yet entries, so evicting
        for room never takes them."""
        for data in datas:
            if data.dtype != torch.uint8 or not data.is_contiguous() or data.numel() <= 0:
                raise ValueError(f"data must be contiguous, non-empty uint8, got {data.dtype} x {data.numel()}")
        done = [False] * len(keys)
        if not self.stats.enabled:
            return done
        fresh: dict[bytes, int] = {}  # a key twice in one batch is written once
        for i, key in enumerate(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
                done[i] = True
            elif key not in fresh:
                fresh[key] = i
        group: list[int] = []
        group_bytes = 0
        most = max(DIRECT_ALIGN, self.stats.capacity_bytes // EVICT_AHEAD)
        for i in fresh.values():
            size = round_up(datas[i].numel())
            if group and group_bytes + size > most:
                if not self._put_group(group, keys, datas, done):
                    return done
                group, group_bytes = [], 0
            group.append(i)
            group_bytes += size
        if group:
            self._put_group(group, keys, datas, done)
        for i, key in enumerate(keys):  # the later copies of a key given twice
            done[i] = done[i] or (key in fresh and done[fresh[key]])
        return done

    def _put_group(self, group: list[int], keys: Sequence[bytes], datas: Sequence[torch.Tensor],
                   done: list[bool]) -> bool:
        """Allocate, write and list ``group`` (indices of fresh keys), setting ``done``; False
        once the tier is off."""
        placed: dict[int, tuple[int, int]] = {}
        for i in group:
            at = self._allocate(datas[i].numel())
            if not self.stats.enabled:  # its checkpoint failed
                return False
            if at is None:
                self.stats.dropped_writes += 1
            else:
                placed[i] = at
        try:
            slots = self._write_placed(placed, datas)
        except BaseException as e:
            for i, (file, offset) in placed.items():
                self._allocs[file].free(offset, datas[i].numel())
            if isinstance(e, OSError):
                self._turn_off(e, "writing")
                return False
            raise
        for i in group:
            slot = slots.get(i)
            if slot is None:
                continue
            self._entries[keys[i]] = slot
            self.stats.used_bytes += round_up(slot.size)
            self.stats.writes += 1
            self.stats.written_bytes += slot.size
            done[i] = True
        self._dirty = self._dirty or bool(slots)
        return True

    def _write_placed(self, placed: dict[int, tuple[int, int]], datas: Sequence[torch.Tensor]) -> dict[int, DiskSlot]:
        """Write each ``datas[i]`` at its ``placed[i]`` (file, offset): adjacent slots of directly
        writable data (aligned address and size) as one run each, the rest one by one through the
        bounce buffer. Returns the slots written; raises the first ``OSError``."""
        order = list(placed)
        views = {i: self._direct_view(datas[i]) for i in order}
        slots = {i: DiskSlot(*placed[i], datas[i].numel(), checksum(datas[i]), self.stats.generation) for i in order}
        runs = [[order[n] for n in run]
                for run in coalesce([slots[i] if views[i] is not None else None for i in order], WRITE_RUN_BYTES)]
        runs += [[i] for i in order if views[i] is None]
        for run in runs:
            buffers = [v for i in run if (v := views[i]) is not None] or [self._bounced(datas[run[0]])]
            self._write_run(*placed[run[0]], buffers)
        return slots

    def _write_run(self, file: int, offset: int, buffers: list[memoryview]) -> None:
        need = sum(len(b) for b in buffers)
        done = self._ops.pwritev(self._fds[file], buffers, offset)
        if done != need:
            raise OSError(errno.EIO, f"short write: {done} of {need} bytes")

    def remove(self, key: bytes) -> bool:
        if key not in self._entries:
            return False
        self._drop(key)
        return True

    def take_gone(self) -> list[bytes]:
        """Keys evicted or dropped since the last call (the owner's pool must stop counting on
        the disk copies of these)."""
        gone, self._gone = self._gone, []
        return gone

    def checkpoint(self) -> None:
        """Make every entry written so far survive a crash, and reuse retired slots: data files
        fsynced, then the manifest replaced atomically. A no-op when nothing changed."""
        if not self.stats.enabled or not (self._dirty or self._retired):
            return
        entries = list(self._entries.items())
        manifest = Manifest(self._layout, self.stats.generation, entries)
        path = os.path.join(self._home, MANIFEST)
        try:
            for fd in self._fds:
                self._ops.fsync(fd)
            self._ops.write_synced(path + ".tmp", encode(manifest))
            self._ops.replace(path + ".tmp", path)
            self._ops.fsync_dir(self._home)
        except OSError as e:
            self._turn_off(e, "writing its manifest")
            return
        self._listed = {(s.file, s.offset) for _, s in entries}
        for slot in self._retired:
            self._allocs[slot.file].free(slot.offset, slot.size)
            self.stats.used_bytes -= round_up(slot.size)
        self._retired.clear()
        self._dirty = False
        self.stats.manifests += 1
        self.stats.generation += 1

    def close(self, *, checkpoint: bool = True) -> None:
        """Write a last manifest (unless told not to), close the files, release the lock."""
        if checkpoint and self._fds:
            self.checkpoint()
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def snapshot(self) -> DiskStats:
        s = DiskStats(**vars(self.stats))
        s.entries = len(self._entries)
        return s

    # --- internals -----------------------------------------------------------------------

    def _allocate(self, size: int) -> tuple[int, int] | None:
        if round_up(size) > self._layout.file_bytes:
            return None
        placed = self._alloc_any(size)
        if placed is not None:
            return placed
        # No room: evict ahead, make the retired slots reusable with one manifest, retry.
        target = max(round_up(size), self.stats.capacity_bytes // EVICT_AHEAD)
        while placed is None:
            free = sum(a.free_bytes for a in self._allocs)
            retired = sum(round_up(s.size) for s in self._retired)
            while self._entries and free + retired < target:
                slot = self._evict()
                if (slot.file, slot.offset) in self._listed:
                    retired += round_up(slot.size)
                else:
                    free += round_up(slot.size)
            if self._retired:
                self.checkpoint()
                if not self.stats.enabled:
                    return None
            placed = self._alloc_any(size)
            if placed is None and not self._entries:
                return None  # fragmented beyond use: cannot happen with one entry size
            target += round_up(size)
        return placed

    def _alloc_any(self, size: int) -> tuple[int, int] | None:
        n = len(self._allocs)
        for i in range(n):
            file = (self._next_file + i) % n
            off = self._allocs[file].alloc(size)
            if off is not None:
                self._next_file = (file + 1) % n  # spread writes over the roots' disks
                return file, off
        return None

    def _evict(self) -> DiskSlot:
        key = next(iter(self._entries))
        slot = self._entries[key]
        self._drop(key)
        self.stats.evictions += 1
        return slot

    def _drop(self, key: bytes) -> None:
        slot = self._entries.pop(key)
        self._gone.append(key)
        self._dirty = True
        if (slot.file, slot.offset) in self._listed:
            self._retired.append(slot)  # the durable manifest names it: keep it until the next one
            return
        self._allocs[slot.file].free(slot.offset, slot.size)
        self.stats.used_bytes -= round_up(slot.size)

    def _bounced(self, data: torch.Tensor) -> memoryview:
        """``data``'s bytes copied into the bounce buffer, zero-padded to the alignment (for data
        whose address or size ``O_DIRECT`` refuses)."""
        size = data.numel()
        need = round_up(size)
        if len(self._bounce) < need:
            self._bounce = aligned_buffer(need)  # the old one goes with its last view (a traceback may hold one)
        view = memoryview(self._bounce)[:need]
        view[:size] = memoryview(data.numpy()).cast("B")
        view[size:] = bytes(need - size)
        return view

    @staticmethod
    def _direct_view(t: torch.Tensor) -> memoryview | None:
        """The tensor's own bytes when they can go to the disk as they are (aligned address and
        length), else None (they go through the bounce buffer)."""
        if t.data_ptr() % DIRECT_ALIGN or t.numel() % DIRECT_ALIGN:
            return None
        return memoryview(t.numpy()).cast("B")

    def _read_checked(self, slots: Sequence[DiskSlot], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read ``slots`` (adjacent in one file, in file order) with one ``preadv`` into this
        thread's staging buffer and check each there: per slot, whether it matched its checksum
        (then, and only then, its bytes are copied into its ``out``). Runs on reader threads:
        the read, the checksums and the copies all release the GIL."""
        first, last = slots[0], slots[-1]
        need = last.offset + round_up(last.size) - first.offset
        staging: torch.Tensor | None = getattr(self._staging, "buffer", None)
        if staging is None or staging.numel() < need:
            # the old buffer goes with its last view (a traceback may hold one)
            staging = self._staging.buffer = torch.frombuffer(aligned_buffer(need), dtype=torch.uint8)
        view = memoryview(staging[:need].numpy())
        done = self._ops.preadv(self._fds[first.file], [view], first.offset)
        if done != need:
            raise OSError(errno.EIO, f"short read: {done} of {need} bytes")
        checked = []
        for slot, out in zip(slots, outs):
            at = slot.offset - first.offset
            data = staging[at:at + slot.size]
            ok = checksum(data) == slot.checksum
            if ok:
                out.copy_(data)
            checked.append(ok)
        return checked

    def _turn_off(self, e: OSError, doing: str) -> None:
        self.stats.io_errors += 1
        if not self.stats.enabled:
            return
        self.stats.enabled = False
        self._gone.extend(self._entries)  # the pool's copies are the only ones again
        self._entries.clear()
        self._retired.clear()
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        log.error("disk tier %s turned off: %s while %s (%s); the DRAM tier goes on", self._home, name, doing, e)

