"""Byte-extent allocation inside one shard's pool.

Blocks of one namespace share a size, but a shard serves many namespaces
(models, tp ranks, mamba states), so slots are variable-sized extents. A
first-fit free list with coalescing keeps that simple and byte-accurate.

An extent whose size is a multiple of 4 KiB starts at a multiple of 4 KiB, whatever odd-sized
state was placed before it; smaller or odd sizes pack at ``align``. A GPU step moves its blocks
as rows of the largest size dividing every offset (``transport.gather``): one block at a
64-byte offset would make every row of the step 64 bytes.
"""

from __future__ import annotations

import bisect

PAGE_ALIGN = 4096
"""Where extents of a multiple of this size start."""


class ExtentAllocator:
    """First-fit allocator over ``[0, capacity)``; offsets are ``align``-aligned."""

    def __init__(self, capacity: int, align: int = 64) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"capacity must be > 0 and align a power of two, got {capacity}, {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._starts: list[int] = [0]
        self._lengths: list[int] = [self.capacity]
        self.free_bytes = self.capacity

    def rounded(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def alloc(self, size: int) -> int | None:
        """Offset of a fresh extent of ``size`` bytes, or None when no hole fits."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        need = self.rounded(size)
        natural = max(self.align, PAGE_ALIGN) if need % PAGE_ALIGN == 0 else self.align
        for i, length in enumerate(self._lengths):
            hole = self._starts[i]
            start = -(-hole // natural) * natural
            if start + need > hole + length:
                continue
            rest = hole + length - (start + need)
            del self._starts[i], self._lengths[i]
            for at, span in ((start + need, rest), (hole, start - hole)):  # keeps _starts sorted
                if span:
                    self._starts.insert(i, at)
                    self._lengths.insert(i, span)
            self.free_bytes -= need
            return start
        return None

    def take(self, offset: int, size: int) -> None:
        """Mark the extent at ``offset`` used: a restarted owner re-adopting extents a record
        (the disk tier's manifest) says are in use. Raises ValueError unless the whole extent
        is free and aligned, so two records claiming one byte cannot both be adopted."""
        length = self.rounded(size)
        if size <= 0 or offset < 0 or offset % self.align:
            raise ValueError(f"cannot take offset {offset} size {size} (align {self.align})")
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + length > self._starts[i] + self._lengths[i]:
            raise ValueError(f"offset {offset} size {size} is not inside one free hole")
        hole, span = self._starts[i], self._lengths[i]
        del self._starts[i], self._lengths[i]
        for at, rest in ((offset + length, hole + span - offset - length), (hole, offset - hole)):
            if rest:
                self._starts.insert(i, at)
                self._lengths.insert(i, rest)
        self.free_bytes -= length

    def free(self, offset: int, size: int) -> None:
        length = self.rounded(size)
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + length) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > offset
        ):
            raise ValueError(f"double free or overlap at offset {offset} size {size}")
        self._starts.insert(i, offset)
        self._lengths.insert(i, length)
        self.free_bytes += length
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._starts) and offset + length == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            self._lengths[i - 1] += self._lengths[i]
            del self._starts[i], self._lengths[i]

    @property
    def largest_hole(self) -> int:
        return max(self._lengths, default=0)
