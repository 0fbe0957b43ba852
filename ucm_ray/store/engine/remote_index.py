"""Another node's published index, read one-sidedly over NIXL: lookups without a Ray call.

A shard exports its published index (``store.published_layout``) with its pool's NIXL agent.
A reader on another node reads, per key, the window of buckets its probe chain starts with
(``WINDOW``; one that runs past the table's end goes on at its start, as the chain does) and the
table's header, in one transfer, and answers as a same-node reader does:
an entry's location and generation, read unpinned. The copy of its bytes is then validated by
reading the key's window again: the copy counts only if the entry is listed with the same
generation, offset and size afterwards (a slot is unlisted before the shard can hand it to a
writer, so the bytes copied in between are the entry's).

A remote read cannot follow a bucket's seqlock as a local reader does (read the sequence,
then the fields, then the sequence again), so a bucket read while the shard rewrote it may mix
two versions. That costs a miss, never wrong bytes: the validation compares every field the
copy relied on with a second read made after the copy, and a torn first read differs from the
entry's settled state in some field it read wrong. What the window cannot settle (a chain
longer than the window, a table that is not complete, a rebuild or a torn bucket) is left
unknown, and the lookup asks the shard through Ray as before.

A read that times out may still land: NIXL cannot cancel an RMA read (releasing its request
frees the handle, not the read; docs/performance-log.md, stop 66). Its buffer is quarantined:
kept registered and used by no other read until the read is over (``Transfer.late``), then
deregistered and freed. A reader keeps at most ``MAX_QUARANTINED`` of them (a stalled node that
keeps timing out costs a bounded ``MAX_QUARANTINED`` buffers, not one per timeout); past that its
lookups answer "unknown" without posting, and ask the shard through Ray. A reader closed while a
read of it may still land hands its transport and buffers to ``_closed_late``, and ``close_finished_readers``
(at every reader's open and close) closes them once every such read is over.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ucm_ray.store.published_layout import (
    BUCKET,
    EMPTY,
    HEADER,
    MAGIC,
    ON_DISK,
    TOMBSTONE,
    buckets_of,
    key_halves,
)
from ucm_ray.store.types import NO_CHECKSUM, Found
from ucm_ray.transport.base import CopyOp, PoolDescriptor, Ranges, Transfer

if TYPE_CHECKING:
    from ucm_ray.transport.nixl import NixlPoolTransport

log = logging.getLogger(__name__)

WINDOW = 8
"""Buckets read per key: at the table's load bound (half full) nearly every chain ends within it."""
READ_TIMEOUT_S = 0.25
"""How long a lookup waits for another node's index: past it the lookup asks the shard instead."""
MAX_QUARANTINED = 4
"""Buffers a reader keeps whose read timed out and may still land (each ``64 + 512 x keys`` bytes,
registered): past it the reader reads nothing more from that node until one of them is over."""


@dataclasses.dataclass(eq=False)
class _Quarantined:
    """A buffer a timed-out read may still land in: neither reused nor freed until it is over."""

    transfer: Transfer
    buffer: torch.Tensor


@dataclasses.dataclass(eq=False)
class _ClosedLate:
    """A closed reader's transport, kept open (its buffers registered and alive) until its late
    reads are over."""

    transport: NixlPoolTransport
    quarantined: list[_Quarantined]


_closed_late: list[_ClosedLate] = []
_closed_late_lock = threading.Lock()


class RemoteIndexReader:
    """Reads one remote shard's published index through a NIXL transport to its exported table."""

    def __init__(self, desc: PoolDescriptor) -> None:
        from ucm_ray.transport.nixl import NixlPoolTransport

        close_finished_readers()
        if not desc.index_bytes:
            raise ValueError(f"shard {desc.shard_id} exports no index")
        region = dataclasses.replace(desc, pool_base_addr=desc.index_base_addr, pool_bytes=desc.index_bytes)
        self._transport = NixlPoolTransport(region, default_timeout_s=READ_TIMEOUT_S)
        self._incarnation = desc.incarnation
        self.buckets = buckets_of(desc.index_bytes)  # sized for the pool and the shard's disk tier
        self._mask = np.uint64(self.buckets - 1)
        self._buffer: torch.Tensor | None = None
        self._quarantined: list[_Quarantined] = []

    @property
    def quarantined(self) -> int:
        """Buffers whose timed-out read may still land in them."""
        return len(self._quarantined)

    def lookup(self, keys: Sequence[bytes]) -> Found | None:
        """Per key, the listed entry as the window read shows it (``known`` False where it
        cannot say); None if the table could not be read or was being rebuilt."""
        read = self._read(keys)
        if read is None:
            return None
        header, windows = read
        n = len(keys)
        found = Found(np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64),
                      np.full(n, NO_CHECKSUM, dtype=np.int64), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool))
        words = key_halves(keys)
        generation = windows["generation"]
        live = (generation != EMPTY) & (generation != TOMBSTONE)
        match = live & (windows["key_lo"] == words[:, :1]) & (windows["key_hi"] == words[:, 1:])
        torn = (windows["seq"] & np.uint64(1)) == 1
        settles = match | (generation == EMPTY) | torn
        first = np.argmax(settles, axis=1)
        rows = np.arange(n)
        settled = settles[rows, first]
        entries = windows[rows, first]
        listed = settled & match[rows, first] & ~torn[rows, first]
        on_disk = listed & (entries["offset"] == ON_DISK)  # not a hit here: the shard promotes it
        hit = listed & ~on_disk
        miss = settled & (generation[rows, first] == EMPTY) & ~torn[rows, first]
        found.generation[hit] = entries["generation"][hit]
        found.offset[hit] = entries["offset"][hit]
        found.size[hit] = entries["size"][hit]
        found.checksum[hit] = entries["checksum"][hit]
        found.known[hit] = True
        found.known[miss] = bool(header["complete"])
        found.on_disk[on_disk] = True
        return found

    def generation_of(self, key: bytes) -> int | None:
        found = self.lookup([key])
        if found is None or not found.known[0]:
            return None
        return int(found.generation[0])

    def validate(self, keys: Sequence[bytes], generations: np.ndarray, offsets: np.ndarray,
                 sizes: np.ndarray) -> np.ndarray:
        """Per key, whether its entry is still listed exactly as the copy read it."""
        found = self.lookup(keys)
        if found is None:
            return np.zeros(len(keys), dtype=bool)
        return (found.known & (found.generation == generations) & (found.offset == offsets)
                & (found.size == sizes))

    def close(self) -> None:
        """Close the transport, unless a read may still land in one of its buffers: then the
        transport (so the buffers' registrations and memory) is kept until that read is over,
        not freed under it (``close_finished_readers``)."""
        self._release_finished()
        if self._quarantined:
            log.info("remote index reader of shard %s closed with %d reads still in flight: its buffers "
                     "are kept until they are over", self._transport.desc.shard_id, len(self._quarantined))
            with _closed_late_lock:
                _closed_late.append(_ClosedLate(self._transport, self._quarantined))
            self._quarantined = []
        else:
            self._transport.close()
        self._buffer = None
        close_finished_readers()

    def _release_finished(self) -> None:
        """Deregister and free each quarantined buffer whose read is over."""
        still = []
        for held in self._quarantined:
            if held.transfer.late():
                still.append(held)
            else:
                self._transport.deregister_local(held.buffer)
        self._quarantined = still

    def _buffer_for(self, need: int) -> torch.Tensor:
        """The buffer for a read of ``need`` bytes; one outgrown is deregistered (no read of
        it is in flight: one that timed out took its buffer to quarantine)."""
        if self._buffer is not None and self._buffer.numel() >= need:
            return self._buffer
        size = max(need, 2 * (self._buffer.numel() if self._buffer is not None else 0))
        if self._buffer is not None:
            self._transport.deregister_local(self._buffer)
        self._buffer = torch.zeros(size, dtype=torch.uint8)
        self._transport.register_local(self._buffer)
        return self._buffer

    def _read(self, keys: Sequence[bytes]) -> tuple[np.void, np.ndarray] | None:
        """The header and each key's window, read in one transfer. A window that runs past the
        table's end is read in two pieces, its tail from the table's start: its chain goes on
        there (before, such a key was unknown, and a prompt with one key whose home was in a
        table's last ``WINDOW - 1`` buckets paid a pin call on the shard for it)."""
        self._release_finished()
        if len(self._quarantined) >= MAX_QUARANTINED:
            return None  # that many reads of this node may still land: ask its shard instead
        words = key_halves(keys)
        home = (words[:, 0] & self._mask).astype(np.int64)
        span = WINDOW * BUCKET.itemsize
        need = HEADER.itemsize + len(keys) * span
        buffer = self._buffer_for(need)
        ops = [CopyOp(0, buffer[:HEADER.itemsize])]
        for i, at in enumerate(home.tolist()):
            start = HEADER.itemsize + i * span
            head = min(WINDOW, self.buckets - at) * BUCKET.itemsize  # the part before the table's end
            ops.append(CopyOp(HEADER.itemsize + at * BUCKET.itemsize, buffer[start:start + head]))
            if head < span:
                ops.append(CopyOp(HEADER.itemsize, buffer[start + head:start + span]))
        transfer: Transfer | None = None
        try:
            transfer = self._transport.read(Ranges.of(ops))
            transfer.wait(READ_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 -- a dead or slow node: the lookup asks the shard
            log.debug("remote index of %s unreadable: %s", self._transport.desc.shard_id, e)
            if transfer is not None and transfer.late():  # it may still land: no read uses it until over
                self._quarantined.append(_Quarantined(transfer, buffer))
                self._buffer = None
            return None
        raw = buffer[:need].numpy()
        header = np.frombuffer(raw[:HEADER.itemsize].tobytes(), dtype=HEADER)[0]
        if (int(header["magic"]) != MAGIC or int(header["incarnation"]) != self._incarnation
                or int(header["epoch"]) & 1):
            return None
        windows = np.frombuffer(raw[HEADER.itemsize:].tobytes(), dtype=BUCKET).reshape(len(keys), WINDOW)
        return header, windows


def close_finished_readers() -> None:
    """Close the transports of closed readers whose late reads are all over."""
    finished = []
    with _closed_late_lock:
        for closed in list(_closed_late):
            if not any(held.transfer.late() for held in closed.quarantined):
                _closed_late.remove(closed)
                finished.append(closed)
    for closed in finished:
        closed.transport.close()
