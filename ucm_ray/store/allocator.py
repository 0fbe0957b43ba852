"""Byte-extent allocation inside one shard's pool.

Blocks of one namespace share a size, but a shard serves many namespaces
(models, tp ranks, mamba states), so slots are variable-sized extents. A
first-fit free list with coalescing keeps that simple and byte-accurate.
"""

from __future__ import annotations

import bisect


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
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[i] = length - need
                self.free_bytes -= need
                return start
        return None

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
