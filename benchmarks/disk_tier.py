"""Disk-tier benchmark: demotion and promotion through the shard's own code against the disk's raw
direct-I/O speed measured in the same run, and lookups with ten pools' worth on disk.

The shard's parts run as the actor holds them, without Ray: a pool (an anonymous mapping, as the
shard's segment is), its ``BlockIndex`` with the published index same-node readers map, a
``DiskStore`` under ``--dir`` and the ``DiskTier`` that moves entries between them. Write-through,
so every committed entry is demoted; each demotion batch ends with the tier's checkpoint (data
fsynced, manifest replaced), as in the shard. Per entry size:

- ``raw``: the same bytes written with ``O_DIRECT`` from a pool-sized aligned mapping to successive,
  never-written offsets of a preallocated file as large as the tier's writes (as the tier's land
  while it fills), one ``fsync`` per batch, then read back the same way: the disk's speed with
  nothing of ours in the way, depth 1 as the tier's I/O is.
- ``demote``: ``--disk-pools`` pools' worth committed a quarter pool at a time, each followed by the
  tier's ``demote()``; the figure is bytes over the time inside ``demote()`` (checksums, writes, fsyncs,
  manifests). ``disk_demote_vs_raw`` divides it by the raw write speed.
- ``promote``: ``--promote-pools`` pools' worth of keys evicted from the pool, read back with
  ``DiskTier.promote`` an eighth of a pool per call (a prompt's blocks), each read verified against
  its checksum; over the raw read speed. Four pools (1 GiB, about a second of reads here) by default:
  with two, one burst of another process's load on either side moved a run's ratio by 0.3.
- ``lookup``: 1,024 keys (half held, half never written) looked up in the published index as a
  same-node reader does, and by the shard's ``contains`` path (index, then disk membership),
  with the pool full and nothing on disk, then with ``--disk-pools`` pools' worth on disk;
  the ratio says what the disk costs a lookup.

Entries hold distinct bytes in every 4 KiB page (as KV blocks do): with one pattern repeated,
reads into the pool ran at a third to half the speed of reads into fresh memory here, whatever the
tier did, and the ratios measured the page pattern.

The last line: ``disk_promote_vs_raw=`` and ``disk_demote_vs_raw=`` for 2 MiB entries (targets
>= 0.7; >= 0.5 at 64 KiB, printed with a ``_64k`` suffix). ``--baseline PATH`` also measures another
checkout's ``ucm_ray`` in the same run (each size in a fresh process per checkout, alternating) and
prints its ratios with a ``_baseline`` suffix.

Run: ``make bench`` or ``python benchmarks/disk_tier.py [--dir /mnt/nvme --pool-mib 256] [--baseline ../main]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT_ENV = "DISK_TIER_BENCH_CHECKOUT"
sys.path.insert(0, os.environ.get(CHECKOUT_ENV) or HERE)  # whose ucm_ray is timed: this checkout, or --baseline's

import torch  # noqa: E402

from benchmarks.measure import best, keys_for  # noqa: E402
from ucm_ray.config import parse_size  # noqa: E402
from ucm_ray.store.engine.published_reader import IndexReader  # noqa: E402
from ucm_ray.store.shard.disk import DiskStore  # noqa: E402
from ucm_ray.store.shard.disk.fileops import aligned_buffer, round_up  # noqa: E402
from ucm_ray.store.shard.disk.store import shard_dir  # noqa: E402
from ucm_ray.store.shard.disk.tier import DiskTier  # noqa: E402
from ucm_ray.store.shard.index import BlockIndex  # noqa: E402
from ucm_ray.store.shard.published_writer import PublishedIndex  # noqa: E402

log = logging.getLogger("disk_tier")
OWNER = 7
LOOKUP_KEYS = 1024
GIB = float(1 << 30)
PAGE = 4096


@dataclass
class SizeFigures:
    raw_write_gbs: float
    raw_read_gbs: float
    demote_gbs: float
    promote_gbs: float
    lookup_empty_ms: float
    lookup_full_ms: float
    contains_empty_ms: float
    contains_full_ms: float
    table_complete: bool


class RawDisk:
    """The baseline: plain ``O_DIRECT`` I/O of the same sizes at depth 1, from and into a pool-sized
    mapping of its own at successive offsets (as the tier moves pool slots: one hot buffer would
    flatter the baseline by a fifth to a half here). Writes go to a preallocated file as large as
    all the writes, each offset written once, as the tier's writes land in its preallocated files
    while it fills: rewriting one pool-sized region (the baseline until 2026-12-06) overwrote
    extents already written, which ext4 takes 1.4-1.6x faster than its first write into an
    allocated-but-unwritten extent here (performance log), and flattered raw against the tier."""

    def __init__(self, directory: str, entry: int, pool_bytes: int, file_bytes: int) -> None:
        self.path = os.path.join(directory, "raw-baseline")
        self.entry = entry
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0), 0o600)
        self.file_bytes = round_up(file_bytes)
        os.posix_fallocate(self.fd, 0, self.file_bytes)
        self.size = pool_bytes
        self.memory = aligned_buffer(pool_bytes)
        self.memory.write(os.urandom(pool_bytes))
        self.at = 0
        self.file_at = 0

    def _next(self, size: int) -> memoryview:
        if self.at + size > self.size:
            self.at = 0
        view = memoryview(self.memory)[self.at:self.at + size]
        self.at += size
        return view

    def write(self, count: int) -> float:
        """Seconds to write ``count`` entries at the file's next unwritten offsets and fsync them."""
        started = time.perf_counter()
        for _ in range(count):
            if self.file_at + self.entry > self.file_bytes:
                self.file_at = 0  # only if asked for more than the file holds
            os.pwritev(self.fd, [self._next(self.entry)], self.file_at)
            self.file_at += self.entry
        os.fsync(self.fd)
        return time.perf_counter() - started

    def read(self, fd: int, extents: list[tuple[int, int]]) -> float:
        """Seconds to read ``extents`` (offset, size) of ``fd`` (another file: the tier's)."""
        started = time.perf_counter()
        for offset, size in extents:
            os.preadv(fd, [self._next(round_up(size))], offset)
        return time.perf_counter() - started

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


class ShardParts:
    """A pool, its index and published index, a disk store and the tier: what the shard holds."""

    def __init__(self, directory: str, pool_bytes: int, disk_bytes: int, index_file: str) -> None:
        # sized as the shard sizes it (a baseline checkout's table may take the pool only)
        takes_disk = "disk_bytes" in inspect.signature(PublishedIndex).parameters
        self.published = PublishedIndex(index_file, pool_bytes, 1, *([disk_bytes] if takes_disk else []))
        self.mapping = mmap.mmap(-1, pool_bytes)
        self.pool = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.index = BlockIndex(pool_bytes, lease_s=600, reserve_timeout_s=600, prefer_clean=True,
                                published=self.published)
        self.lock = threading.Lock()
        self.root = directory
        self.store = DiskStore([directory], "bench", disk_bytes)
        self.tier = DiskTier(self.index, self.pool, self.store, self.lock, write_through=True, wait_s=600.0)
        self.reader = IndexReader(index_file, 1)

    def commit(self, keys: list[bytes], entry: int, source: torch.Tensor, first: int) -> None:
        """Commit ``keys`` as entries of ``source``'s bytes, each stamped with its number."""
        with self.lock:
            token, offsets = self.index.reserve(OWNER, entry, len(keys))
            assert len(offsets) == len(keys), "the pool had no room (demotion fell behind?)"
            for n, offset in enumerate(offsets):
                self.pool[offset:offset + entry].copy_(source)
                stamps = self.pool[offset:offset + entry].view(torch.int64)[::PAGE // 8]
                stamps.copy_(torch.arange(stamps.numel(), dtype=torch.int64) + (first + n) * (entry // PAGE + 1))
            self.index.commit(OWNER, token, [(k, o, None) for k, o in zip(keys, offsets)])

    def contains(self, keys: list[bytes]) -> list[bool]:
        """The shard's ``contains`` call without Ray: the index, then the disk for the rest."""
        with self.lock:
            found = self.index.contains(keys)
        if not all(found):
            found = [f or d for f, d in zip(found, self.tier.on_disk(keys))]
        return found

    def close(self) -> None:
        self.tier.close()
        self.reader.close()
        self.published.close()


def fill(parts: ShardParts, keys: list[bytes], entry: int, pool_bytes: int, raw: RawDisk) -> tuple[float, float]:
    """Commit ``keys`` a quarter pool at a time, demoting after each, and as many raw writes
    between (the disk drifts from minute to minute here): seconds inside ``demote``, raw seconds."""
    source = torch.randint(0, 256, (entry,), dtype=torch.uint8, generator=torch.Generator().manual_seed(entry))
    chunk = max(1, pool_bytes // 4 // entry)
    demoting = raw_s = 0.0
    before = parts.tier.stats.demoted_bytes
    next_log = time.monotonic() + 10
    for start in range(0, len(keys), chunk):
        parts.commit(keys[start:start + chunk], entry, source, start)
        raw_s += raw.write(len(keys[start:start + chunk]))
        started = time.perf_counter()
        parts.tier.demote()
        demoting += time.perf_counter() - started
        if time.monotonic() > next_log:
            next_log = time.monotonic() + 10
            done = parts.tier.stats.demoted_bytes - before
            log.info("  demoted %.2f of %.2f GiB", done / GIB, len(keys) * entry / GIB)
    return demoting, raw_s


def promote(parts: ShardParts, keys: list[bytes], entry: int, pool_bytes: int, raw: RawDisk) -> tuple[float, float]:
    """Promote ``keys`` (on disk only) an eighth of a pool per call, each call after a raw read
    of the same extents of the tier's file: seconds inside ``promote``, raw seconds. Logs the
    spread of the calls' own ratios (bursts of load on a shared box show there)."""
    per_call = max(1, pool_bytes // 8 // entry)
    promoting = raw_s = 0.0
    ratios = []
    data_fd = os.open(os.path.join(shard_dir(parts.root, "bench"), "data-0"),
                      os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
    for start in range(0, len(keys), per_call):
        batch = keys[start:start + per_call]
        slots = [parts.store.slot_of(k) for k in batch]
        raw_call = raw.read(data_fd, [(s.offset, s.size) for s in slots if s is not None])
        started = time.perf_counter()
        out = parts.tier.promote(batch)
        call = time.perf_counter() - started
        assert all(out), f"{out.count(False)} of {len(batch)} keys were not promoted"
        raw_s += raw_call
        promoting += call
        ratios.append(raw_call / call)
    os.close(data_fd)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    log.info("  %d promote calls, each against its raw read: quartiles %s", len(ratios),
             " / ".join(f"{q:.2f}" for q in quartiles))
    return promoting, raw_s


def lookup_ms(parts: ShardParts, held: list[bytes], absent: list[bytes], repeat: int) -> tuple[float, float]:
    """Best-of milliseconds for ``LOOKUP_KEYS`` keys: published-index lookup, shard's contains."""
    keys = (held[-LOOKUP_KEYS // 2:] + absent[:LOOKUP_KEYS // 2])
    published = best(lambda: parts.reader.lookup(keys), repeat) * 1e3
    contains = best(lambda: parts.contains(keys), repeat) * 1e3
    return published, contains


def measure_size(directory: str, entry: int, pool_bytes: int, disk_pools: int, promote_pools: int,
                 repeat: int) -> SizeFigures:
    on_disk = disk_pools * pool_bytes
    log.info("entry %d KiB: %d pools of %d MiB through the tier, raw direct I/O between", entry >> 10,
             disk_pools, pool_bytes >> 20)
    index_file = f"/dev/shm/ucmray-bench-disk-index-{os.getpid()}"
    store_dir = tempfile.mkdtemp(prefix="tier-", dir=directory)
    parts = ShardParts(store_dir, pool_bytes, on_disk + on_disk // 8, index_file)
    raw = RawDisk(directory, entry, pool_bytes, on_disk)
    try:
        keys = keys_for(f"disk-{entry}", on_disk // entry)
        absent = keys_for(f"absent-{entry}", LOOKUP_KEYS)
        pool_keys = pool_bytes // entry
        fill(parts, keys[:pool_keys], entry, pool_bytes, raw)
        lookup_empty, contains_empty = lookup_ms(parts, keys[:pool_keys], absent, repeat * 20)
        before = parts.tier.stats.demoted_bytes
        demoting, raw_written = fill(parts, keys[pool_keys:], entry, pool_bytes, raw)
        demoted = parts.tier.stats.demoted_bytes - before
        lookup_full, contains_full = lookup_ms(parts, keys, absent, repeat * 20)
        complete = parts.published.complete
        evicted = [k for k, held in zip(keys, parts.index.contains(keys)) if not held]
        promoted_keys = evicted[:promote_pools * pool_keys]
        log.info("  promoting %d entries (%.2f GiB)", len(promoted_keys), len(promoted_keys) * entry / GIB)
        promoting, raw_read = promote(parts, promoted_keys, entry, pool_bytes, raw)
        stats = parts.store.snapshot()
        assert stats.corrupt == 0 and stats.io_errors == 0 and stats.enabled, stats
    finally:
        raw.close()
        parts.close()
        shutil.rmtree(store_dir, ignore_errors=True)
        if os.path.exists(index_file):  # PublishedIndex.close unlinks it
            os.unlink(index_file)
    promoted = len(promoted_keys) * entry
    return SizeFigures(demoted / raw_written / 1e9, promoted / raw_read / 1e9, demoted / demoting / 1e9,
                       promoted / promoting / 1e9, lookup_empty, lookup_full, contains_empty, contains_full, complete)


def measure_in(checkout: str, entry: int, args: argparse.Namespace) -> SizeFigures:
    """``measure_size`` in a fresh process importing ``checkout``'s ``ucm_ray``."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir, "--pool-mib", str(args.pool_mib),
            "--disk-pools", str(args.disk_pools), "--promote-pools", str(args.promote_pools),
            "--sizes", str(entry), "--repeat", str(args.repeat)]
    env = {**os.environ, CHECKOUT_ENV: checkout}
    out = subprocess.run(argv, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return SizeFigures(**json.loads(out.stdout.strip().splitlines()[-1]))


def report(entry: int, f: SizeFigures, suffix: str = "") -> None:
    tag = ("" if entry == 2 << 20 else f"_{entry >> 10}k") + suffix
    log.info("entry %d KiB%s: demote %.2f GB/s (raw write %.2f), promote %.2f GB/s (raw read %.2f)",
             entry >> 10, suffix, f.demote_gbs, f.raw_write_gbs, f.promote_gbs, f.raw_read_gbs)
    log.info("entry %d KiB%s: %d-key lookup, published index %.3f ms empty disk -> %.3f ms full (table %s); "
             "shard contains %.3f -> %.3f ms", entry >> 10, suffix, LOOKUP_KEYS, f.lookup_empty_ms, f.lookup_full_ms,
             "complete" if f.table_complete else "INCOMPLETE: misses ask the shard", f.contains_empty_ms,
             f.contains_full_ms)
    print(f"disk_promote_vs_raw{tag}={f.promote_gbs / f.raw_read_gbs:.3f} "
          f"disk_demote_vs_raw{tag}={f.demote_gbs / f.raw_write_gbs:.3f} "
          f"disk_lookup_full_vs_empty{tag}={f.lookup_full_ms / f.lookup_empty_ms:.3f} "
          f"disk_contains_full_vs_empty{tag}={f.contains_full_ms / f.contains_empty_ms:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a directory on the disk to measure (not tmpfs: O_DIRECT)")
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--disk-pools", type=int, default=10, help="pools' worth written to disk")
    parser.add_argument("--promote-pools", type=int, default=4, help="pools' worth promoted (< --disk-pools)")
    parser.add_argument("--sizes", default="64KiB,2MiB")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="another checkout whose ucm_ray is measured in the same run")
    parser.add_argument("--rounds", type=int, default=1, help="with --baseline: processes per checkout and size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)  # the shard's threads copy single-threaded; a shared box's spinning pool is noise
    pool_bytes = args.pool_mib << 20
    for entry in (parse_size(s, "--sizes") for s in args.sizes.split(",")):
        if args.child or args.baseline is None:
            figures = measure_size(args.dir, entry, pool_bytes, args.disk_pools, args.promote_pools, args.repeat)
            if args.child:
                print(json.dumps(dataclasses.asdict(figures)))
            else:
                report(entry, figures)
        else:
            for _ in range(args.rounds):
                report(entry, measure_in(args.baseline, entry, args), "_baseline")
                report(entry, measure_in(HERE, entry, args))


if __name__ == "__main__":
    main()
