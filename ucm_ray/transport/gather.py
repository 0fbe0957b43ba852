"""Many small copies between a pool and local buffers as a few kernels or DMA copies per part.

A step moves one 16-64 KiB range per block per layer; issued one ``copy_`` each, the launch
cost dominates (4.5 GB/s measured on an H200 against 53 GB/s for one large pinned copy). So a
``GatherPlan`` computes the row indices of a whole step (every layer) at once and uploads them
in one copy; moving one part (a layer, or every layer) is then a few launches and no host work.
On an H200 engine the per-layer planning this replaces (Python and numpy on a copy thread) cost
more host time than the copies took on the link, and its thread fought the engine's for the
GIL: a 4k-token store hit's step took ~20 ms of host time for ~4 ms of PCIe.

A part moves one of two ways, chosen from its shape:

- **Gather kernels.** The shard's page-locked pool is also addressable from the GPU (unified
  addressing), so the ranges become rows of a word matrix and one ``index_select`` +
  ``index_copy_`` moves them, reading or writing host memory over PCIe from the kernel itself.
  A part whose pool ranges lie apart (one layer of many entries: a range an entry apart) goes
  so.
- **Staged DMA.** A part whose pool ranges lie side by side in long stretches (every layer of
  entries in adjacent slots: a save, or a load that lands before the forward) is gathered in
  device memory in pool order, at HBM speed, and each stretch is one ``cudaMemcpyAsync``: the
  copy engines move it, and no SM waits on PCIe meanwhile. A gather kernel writing host memory
  holds its SMs for the whole transfer, beside the decode steps a prompt's save runs next to:
  on an H200, decode-shaped work beside a 512 MiB save took +102% / +95% longer than alone with
  the kernels, +4% / -1% with staged DMA (two runs; throughput alike, 0.63-0.71x a pinned copy
  with the benchmark's host time).

Rows are ``line`` bytes: the largest power of two up to ``MAX_LINE`` dividing every offset and
size, so a 16-64 KiB range is one row and the index tensors stay small (with 4 KiB rows a 512
MiB step took 131k indices, ~3 ms of numpy to build); ranges that share no 8-byte alignment
are not eligible (``build`` returns None and the caller copies range by range).

Local buffers are addressed through *spans*: buffers whose addresses agree modulo ``line``
share one rows view from the lowest of them to the end of the highest (only rows inside a
buffer are ever indexed), so a part over every layer's buffer (vLLM allocates one per layer)
is one kernel pair, not one per layer, and a plan makes one view per span, not one per buffer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ucm_ray.transport.base import Ranges

WORD = 8
MAX_LINE = 1 << 20
GATHER_BYTES = 64 << 20
"""Bytes moved per kernel pair, or staged per DMA batch: what is staged in device memory."""
DMA_STRETCH_BYTES = 1 << 20
"""A part goes by staged DMA when its pool ranges, merged where adjacent, average at least this
many bytes per stretch (and the plan has the pool as host memory): each stretch costs a copy's
launch of host time, too much for a layer's 16-64 KiB ranges an entry apart (those stay on the
kernels), little for whole entries side by side."""


class DeviceView:
    """A CUDA tensor over ``nbytes`` at ``address`` as ``device`` sees it (zero copy, owns
    nothing): page-locked host memory mapped for the GPU (a kernel's accesses go over PCIe), or
    a span of device memory around buffers that the caller keeps alive."""

    def __init__(self, address: int, nbytes: int, device: torch.device) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
        self.tensor = torch.as_tensor(self, device=device)


def line_bytes(values: np.ndarray) -> int:
    """The row size for these offsets and sizes: 0 when they are not all 8-byte aligned."""
    common = int(np.gcd.reduce(values)) if len(values) else 0
    if common == 0 or common % WORD:
        return 0
    line = WORD
    while line * 2 <= MAX_LINE and common % (line * 2) == 0:
        line *= 2
    return line


def _rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices ``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated."""
    first = np.cumsum(counts) - counts  # where each range begins in the output
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _as_rows(flat: torch.Tensor, line: int) -> torch.Tensor:
    """``flat`` (uint8) as rows of ``line`` bytes (int64 words), its tail short of a row left out."""
    return flat[: flat.numel() - flat.numel() % line].view(torch.int64).view(-1, line // WORD)


def _span_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 bytes at ``address`` without a copy (kept alive by the plan's buffers)."""
    if device.type == "cuda":
        return DeviceView(address, nbytes, device).tensor
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _Spans:
    """The local buffers as rows of a few spans: ``views[span_of[b]]`` row ``first_row[b] + r``
    is row ``r`` of buffer ``b``. A buffer alone in its span is its own view."""

    def __init__(self, buffers: Sequence[torch.Tensor], line: int) -> None:
        classes: dict[tuple[torch.device, int], list[int]] = {}
        for index, buffer in enumerate(buffers):
            classes.setdefault((buffer.device, buffer.data_ptr() % line), []).append(index)
        self.span_of: np.ndarray = np.zeros(len(buffers), dtype=np.int64)
        self.first_row: np.ndarray = np.zeros(len(buffers), dtype=np.int64)
        self.views: list[torch.Tensor] = []
        for (device, _), members in classes.items():
            self.span_of[members] = len(self.views)
            if len(members) == 1:
                self.views.append(_as_rows(buffers[members[0]], line))
                continue
            starts = [buffers[b].data_ptr() for b in members]
            base, end = min(starts), max(buffers[b].data_ptr() + buffers[b].numel() for b in members)
            self.first_row[members] = [(start - base) // line for start in starts]
            self.views.append(_as_rows(_span_view(base, end - base, device), line))


@dataclass(frozen=True)
class _Kernels:
    """Gather kernels: these rows of one span <-> these rows of the pool (the mapped view)."""

    span: int
    local_rows: torch.Tensor
    pool_rows: torch.Tensor


@dataclass(frozen=True)
class _Staged:
    """Staged DMA: these rows of one span, gathered in pool order in device memory; then each
    stretch (pool row, staging row, rows) is one copy with the pool as host memory."""

    span: int
    local_rows: torch.Tensor
    stretches: list[tuple[int, int, int]]


class GatherPlan:
    """The copies of ``ranges`` as rows, split into parts (``ends[k]`` is where part k's ranges
    end), each part into kernel pairs or DMA batches of one span and at most ``run_bytes``. Built
    on the stream that will move it (the index upload is queued there). ``host_pool``: the pool
    as host memory (page-locked), which enables the DMA path; ``pool`` is what kernels address."""

    def __init__(self, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int], line: int,
                 run_bytes: int = GATHER_BYTES, host_pool: torch.Tensor | None = None) -> None:
        if not len(ends) or ends[-1] != len(ranges):
            raise ValueError(f"part ends {list(ends)[-3:]} must end at the last of the {len(ranges)} ranges")
        self._pool = _as_rows(pool, line)
        self._host = _as_rows(host_pool, line) if host_pool is not None else None
        self._buffers = ranges.buffers  # the spans' views own nothing: these keep the memory alive
        spans = _Spans(ranges.buffers, line)
        self._spans = spans.views
        limit = max(1, run_bytes // line)
        stretch_rows = max(1, DMA_STRETCH_BYTES // line)
        bounds = np.concatenate([[0], np.asarray(ends, dtype=np.int64)])
        part_of: np.ndarray = np.repeat(np.arange(len(ends)), np.diff(bounds))
        span_of = spans.span_of[ranges.buffer_index]
        pool_at: np.ndarray = ranges.pool_offsets // line
        counts: np.ndarray = ranges.sizes // line
        order = np.lexsort((pool_at, span_of, part_of))  # per part, per span, in pool order
        counts = counts[order]
        local = _rows(spans.first_row[ranges.buffer_index[order]] + ranges.local_offsets[order] // line, counts)
        pooled = _rows(pool_at[order], counts)
        span_rows: np.ndarray = np.repeat(span_of[order], counts)
        part_rows: np.ndarray = np.repeat(part_of[order], counts)
        new_group = (np.diff(span_rows) != 0) | (np.diff(part_rows) != 0)
        groups = np.flatnonzero(new_group) + 1  # where rows of one part and one span begin
        cuts = np.flatnonzero(new_group | (np.diff(pooled) != 1)) + 1  # where stretches of the pool begin
        part_at = np.concatenate([[0], np.cumsum(np.bincount(part_rows, minlength=len(ends)))])  # where parts begin
        self._parts: list[list[_Kernels | _Staged]] = []
        index = torch.from_numpy(np.stack([local, pooled]))
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        for begin, end in _pairs(part_at.tolist()):
            if begin == end:
                self._parts.append([])
                continue
            inner = cuts[np.searchsorted(cuts, begin, "right"):np.searchsorted(cuts, end, "left")]
            staged = self._host is not None and end - begin >= stretch_rows * (len(inner) + 1)
            part: list[_Kernels | _Staged] = []
            within = groups[np.searchsorted(groups, begin, "right"):np.searchsorted(groups, end, "left")]
            for first, last in _pairs([begin, *within.tolist(), end]):
                span = int(span_rows[first])
                for at in range(first, last, limit):
                    stop = min(last, at + limit)
                    if not staged:
                        part.append(_Kernels(span, index[0, at:stop], index[1, at:stop]))
                        continue
                    edges = inner[np.searchsorted(inner, at, "right"):np.searchsorted(inner, stop, "left")]
                    part.append(_Staged(span, index[0, at:stop], [(int(pooled[a]), a - at, b - a)
                                                                  for a, b in _pairs([at, *edges.tolist(), stop])]))
            self._parts.append(part)

    @classmethod
    def build(cls, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int], run_bytes: int = GATHER_BYTES,
              host_pool: torch.Tensor | None = None) -> GatherPlan | None:
        """The plan, or None when the ranges or a tensor's start share no 8-byte alignment."""
        hosts = () if host_pool is None else (host_pool,)
        if any(t.data_ptr() % WORD for t in (pool, *hosts, *ranges.buffers)):
            return None
        line = line_bytes(np.concatenate([ranges.sizes, ranges.pool_offsets, ranges.local_offsets]))
        return cls(pool, ranges, ends, line, run_bytes, host_pool) if line else None

    def staged(self, part: int) -> bool:
        """Whether part ``part`` moves by staged DMA."""
        return any(isinstance(step, _Staged) for step in self._parts[part])

    def move(self, part: int, *, to_pool: bool) -> None:
        """Queue part ``part``'s copies on the current stream."""
        for step in self._parts[part]:
            local = self._spans[step.span]
            if isinstance(step, _Kernels):
                if to_pool:
                    self._pool.index_copy_(0, step.pool_rows, local.index_select(0, step.local_rows))
                else:
                    local.index_copy_(0, step.local_rows, self._pool.index_select(0, step.pool_rows))
                continue
            assert self._host is not None
            if to_pool:
                staging = local.index_select(0, step.local_rows)
                for pool_row, at, rows in step.stretches:
                    self._host[pool_row: pool_row + rows].copy_(staging[at: at + rows], non_blocking=True)
            else:
                staging = local.new_empty((len(step.local_rows), local.shape[1]))
                for pool_row, at, rows in step.stretches:
                    staging[at: at + rows].copy_(self._host[pool_row: pool_row + rows], non_blocking=True)
                local.index_copy_(0, step.local_rows, staging)


def _pairs(points: list[int]) -> zip[tuple[int, int]]:
    """Consecutive (start, end) pairs of ``points``."""
    return zip(points[:-1], points[1:])
