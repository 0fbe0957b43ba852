"""The layout of a shard's published index: the shared-memory table one shard writes
(``store.shard.published_writer``) and same-node readers map read-only
(``store.engine.published_reader``).

The table: open addressing with linear probing over 64-byte buckets after a
64-byte header, keys are 16-byte digests (``keys.KEY_BYTES``, uniformly
spread, so their low word picks the bucket). One writer, the shard, under its
lock; any number of readers in other processes, never blocked:
- per bucket a seqlock: ``seq`` odd while the writer changes it; a reader
  takes a bucket only if ``seq`` was even and the same before and after;
- a rebuild (dropping tombstones) makes the header's ``epoch`` odd until done;
  a reader whose lookup saw the epoch change looks again;
- when the table is too full to take an entry, ``complete`` is cleared: a miss
  is then not an answer, and the reader asks the shard through Ray;
- an entry at offset ``ON_DISK`` is held by the shard's disk tier, not its pool: the
  reader asks the shard, whose ``acquire`` promotes it into the pool and pins it.

These rules rely on x86's ordering of plain loads and stores (total store
order); elsewhere (aarch64) no reader maps the table and lookups go through
Ray, as between nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ucm_ray.keys import KEY_BYTES

BUCKET: np.dtype = np.dtype([("seq", "<u8"), ("key_lo", "<u8"), ("key_hi", "<u8"), ("offset", "<i8"),
                   ("size", "<i8"), ("generation", "<u8"), ("checksum", "<i8"), ("unused", "<u8")])
HEADER: np.dtype = np.dtype([("magic", "<u8"), ("epoch", "<u8"), ("buckets", "<u8"), ("complete", "<u8"),
                   ("incarnation", "<u8"), ("unused", "<u8", 3)])
MAGIC = 0x31584449_59415255  # "URAYIDX1"
EMPTY = 0
TOMBSTONE = np.uint64(2**64 - 1)
ON_DISK = -1
"""The offset listed for a key only the shard's disk tier holds: no bytes to copy here, ask."""
MAX_LOAD = 0.5
"""Live entries per bucket beyond which the table takes no more (probe chains stay short)."""
BYTES_PER_BUCKET = 16 << 10
"""Pool bytes per bucket: entries of 32 KiB and up all fit at ``MAX_LOAD``; smaller ones fit
until the table is full, then lookups of what did not fit go through Ray."""
DISK_BYTES_PER_BUCKET = 32 << 10
"""Disk-tier bytes per bucket (its keys are listed too, as "ask the shard"): entries of 64 KiB
and up all fit, at half the pool's cost in memory (a disk is 10-100x its pool: 1/512 to 1/256
of the disk's bytes in shared memory)."""


def table_buckets(pool_bytes: int, disk_bytes: int = 0) -> int:
    """Buckets for a pool of ``pool_bytes`` with a disk tier of ``disk_bytes`` behind it: a
    power of two, at least 1024. Sized for the disk too: a table that fills up stops being an
    answer for misses, and every lookup of an absent key then asks the shard."""
    want = max(1024, 2 * pool_bytes // BYTES_PER_BUCKET + 2 * disk_bytes // DISK_BYTES_PER_BUCKET)
    return 1 << (want - 1).bit_length()


def index_bytes(pool_bytes: int, disk_bytes: int = 0) -> int:
    """Size of the index file of a pool of ``pool_bytes`` (1/128 to 1/64 of it, at least 64 KiB)
    and its disk tier's ``disk_bytes`` (1/512 to 1/256 of those)."""
    return HEADER.itemsize + table_buckets(pool_bytes, disk_bytes) * BUCKET.itemsize


def buckets_of(index_bytes: int) -> int:
    """The buckets of an index file of ``index_bytes`` (a reader of another node's table)."""
    return (index_bytes - HEADER.itemsize) // BUCKET.itemsize


def index_path(pool_path: str) -> str:
    """The index file of a pool file (same directory and prefix: stale-pool cleanup covers it)."""
    return pool_path + "-index"


def key_halves(keys: Sequence[bytes]) -> np.ndarray:
    """Keys as an ``[n, 2]`` array of little-endian words, as a bucket's ``key_lo``/``key_hi``."""
    blob = b"".join(keys)
    if len(blob) != KEY_BYTES * len(keys):
        raise ValueError(f"published index keys must be {KEY_BYTES} bytes each")
    return np.frombuffer(blob, dtype="<u8").reshape(-1, 2)
