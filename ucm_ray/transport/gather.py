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
  A part whose pool ranges lie scattered goes so.
- **Staged DMA.** A part whose pool ranges form few regular *strips* is gathered in device
  memory in pool order, at HBM speed, and each strip is one copy on the copy engines, so no SM
  waits on PCIe meanwhile: a stretch of adjacent ranges (every layer of entries in adjacent
  slots: a save, or a load that lands before the forward) is one ``cudaMemcpyAsync``, and
  equal stretches at an equal pitch (one layer of such entries: a range an entry apart) are
  one strided ``cudaMemcpy2DAsync`` (``cudart``). A gather kernel writing host memory holds its
  SMs for the whole transfer, beside the decode steps a prompt's save runs next to: on an
  H200, decode-shaped work beside a 512 MiB save took +102% / +95% longer than alone with the
  kernels, +4% / -1% with staged DMA (two runs; throughput alike, 0.63-0.71x a pinned copy
  with the benchmark's host time). Layer by layer, the loads of a store hit run beside the
  prefill of its uncached tokens the same way.

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
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

import numpy as np
import torch

from ucm_ray.transport.base import Ranges
from ucm_ray.transport.cudart import copy_2d, has_copy_2d

WORD = 8
MAX_LINE = 1 << 20
GATHER_BYTES = 64 << 20
"""Bytes moved per kernel pair, or staged per DMA batch: what is staged in device memory."""
DMA_COPY_BYTES = 1 << 20
"""A part goes by staged DMA when its pool ranges, merged where adjacent, average at least this
many bytes per copy (and the plan has the pool as host memory): each copy costs a launch of
host time, too much for one copy per 16-64 KiB range, little for whole entries side by side or
one strided copy of a layer's ranges an entry apart."""
MAX_PITCH = 1 << 30
"""Bytes between a strided copy's rows at most (the runtime refuses pitches past its limit)."""
MIN_STRIDED_ROW = 4096
"""Bytes of a strided copy's rows at least: the copy engines move narrower rows slowly."""


class DeviceView:
    """A CUDA tensor over ``nbytes`` at ``address`` as ``device`` sees it (zero copy, owns
    nothing): page-locked host memory mapped for the GPU (a kernel's accesses go over PCIe), or
    a span of device memory around buffers that the caller keeps alive."""

    def __init__(self, address: int, nbytes: int, device: torch.device) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
        self.tensor = torch.as_tensor(self, device=device)


def line_bytes(values: np.ndarray) -> int:
    """The row size for these offsets and sizes: 0 when they are not all 8-byte aligned. (The
    largest power of two dividing them all is the lowest bit set in any of them.)"""
    bits = int(np.bitwise_or.reduce(values)) if len(values) else 0
    line = min(bits & -bits, MAX_LINE)
    return line if bits and line >= WORD else 0


def _rows(starts: np.ndarray, counts: np.ndarray, single: bool) -> np.ndarray:
    """Row indices ``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated;
    ``single``: every count is 1 (the caller knows), so ``starts`` already are they."""
    if single:
        return starts
    first = np.cumsum(counts) - counts  # where each range begins in the output
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _as_rows(flat: torch.Tensor, line: int) -> torch.Tensor:
    """``flat`` (uint8) as rows of ``line`` bytes (int64 words), its tail short of a row left out."""
    return flat[: flat.numel() - flat.numel() % line].view(torch.int64).view(-1, line // WORD)


def _span_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 bytes at ``address`` without a copy (kept alive by the plan's buffers)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        return DeviceView(address, nbytes, device).tensor
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _Spans:
    """The local buffers as rows of a few spans: ``views[span_of[b]]`` row ``first_row[b] + r``
    is row ``r`` of buffer ``b``. The views own nothing (``_spans_of`` keeps them after the
    buffers may be gone; a plan keeps its buffers alive)."""

    def __init__(self, buffers: Sequence[torch.Tensor], line: int) -> None:
        classes: dict[tuple[torch.device, int], list[int]] = {}
        for index, buffer in enumerate(buffers):
            classes.setdefault((buffer.device, buffer.data_ptr() % line), []).append(index)
        self.span_of: np.ndarray = np.zeros(len(buffers), dtype=np.int64)
        self.first_row: np.ndarray = np.zeros(len(buffers), dtype=np.int64)
        self.views: list[torch.Tensor] = []
        for (device, _), members in classes.items():
            self.span_of[members] = len(self.views)
            starts = [buffers[b].data_ptr() for b in members]
            base, end = min(starts), max(buffers[b].data_ptr() + buffers[b].numel() for b in members)
            self.first_row[members] = [(start - base) // line for start in starts]
            self.views.append(_as_rows(_span_view(base, end - base, device), line))


SPANS_KEPT = 8
"""Spans of recent buffer sets kept for the next plans: an engine plans over the same KV caches
every step, and making the views cost each plan more than a third of its host time."""
_recent_spans: OrderedDict[tuple[int, torch.device | None, tuple[int, ...], tuple[int, ...]], _Spans] = OrderedDict()


def _spans_of(buffers: Sequence[torch.Tensor], line: int) -> _Spans:
    """``_Spans(buffers, line)``, made once per buffer set (by device, address and size: a view
    of a span owns nothing, so equal keys are the same memory). Safe beside another thread
    doing the same: the worst is a set's spans made twice."""
    key = (line, buffers[0].device if buffers else None, tuple(b.data_ptr() for b in buffers),
           tuple(b.numel() for b in buffers))
    spans = _recent_spans.pop(key, None)
    if spans is None:
        spans = _Spans(buffers, line)
    _recent_spans[key] = spans  # the newest last
    with suppress(KeyError):
        while len(_recent_spans) > SPANS_KEPT:
            _recent_spans.popitem(last=False)
    return spans


@dataclass(frozen=True)
class _Kernels:
    """Gather kernels: these rows of one span <-> these rows of the pool (the mapped view)."""

    span: int
    local_rows: torch.Tensor
    pool_rows: torch.Tensor


@dataclass(frozen=True)
class _Strip:
    """``height`` stretches of ``rows`` rows, ``pitch`` rows apart in the pool from ``pool_row``,
    packed side by side in staging from ``staging_row``: one (strided) copy."""

    pool_row: int
    staging_row: int
    rows: int
    pitch: int
    height: int


@dataclass(frozen=True)
class _Staged:
    """Staged DMA: these rows of one span, gathered in pool order in device memory; then each
    strip is one copy with the pool as host memory."""

    span: int
    local_rows: torch.Tensor
    strips: list[_Strip]


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
        spans = _spans_of(ranges.buffers, line)
        self._spans = spans.views
        limit = max(1, run_bytes // line)
        pool_at: np.ndarray = ranges.pool_offsets // line
        counts: np.ndarray = ranges.sizes // line
        span_of: np.ndarray = spans.span_of[ranges.buffer_index]
        local_at: np.ndarray = spans.first_row[ranges.buffer_index] + ranges.local_offsets // line
        # a load posted layer by layer: every part the first one moved by whole rows, on both
        # sides; planned once, each part moved by its bases (``_template``)
        template = _template(local_at, pool_at, counts, ends) if len(spans.views) == 1 else None
        self._bases: list[tuple[int, int]] | None = None
        if template is not None:
            self._bases, local_at, pool_at, counts = template
            ends, span_of = [len(counts)], span_of[: len(counts)]
        # ranges are grouped per part, per span (None: one part over one span, as a save or a
        # load of every layer at once is: the pool rows alone order them)
        group: np.ndarray | None = None
        if len(ends) > 1 or len(spans.views) > 1:
            bounds = np.concatenate([[0], np.asarray(ends, dtype=np.int64)])
            part_of: np.ndarray = np.repeat(np.arange(len(ends)), np.diff(bounds))
            group = part_of * len(spans.views) + span_of
        order = _pool_order(group, pool_at)  # per part, per span, in pool order

        def ordered(values: np.ndarray) -> np.ndarray:
            return values if order is None else values[order]

        counts = ordered(counts)
        single = bool((counts == 1).all())  # the usual case, a range one row: nothing to expand
        local = _rows(ordered(local_at), counts, single)
        pooled = _rows(ordered(pool_at), counts, single)
        total = len(pooled)
        span_rows: np.ndarray
        part_rows: np.ndarray
        group_first: np.ndarray
        if group is None:
            span_rows = part_rows = np.zeros(total, dtype=np.int64)
            group_first = np.zeros(min(total, 1), dtype=np.int64)
        else:
            span_rows = ordered(span_of) if single else np.repeat(ordered(span_of), counts)
            part_rows = ordered(part_of) if single else np.repeat(ordered(part_of), counts)
            group_first = _starts(ordered(group) if single else np.repeat(ordered(group), counts))
        # staging batches: rows of one part and one span, at most ``limit`` of them
        batch_first = _batch_starts(group_first, total, limit)
        # stretches: adjacent pool rows within a batch; strips: copies of stretches
        begins_batch: np.ndarray = np.zeros(total, dtype=bool)
        begins_batch[batch_first] = True
        breaks = begins_batch.copy()
        breaks[1:] |= pooled[1:] - pooled[:-1] != 1
        stretch_first = np.flatnonzero(breaks)
        widths = np.diff(np.append(stretch_first, total))
        starts = pooled[stretch_first]
        strided = not (pool.is_cuda or ranges.device.type == "cuda") or has_copy_2d()
        first = strip_starts(starts, widths, line, strided, apart=begins_batch[stretch_first[1:]])
        heights = np.diff(np.append(first, len(starts)))
        pitches = np.where(heights > 1, starts[np.minimum(first + 1, len(starts) - 1)] - starts[first], widths[first])
        strip_at = stretch_first[first]  # the row where each strip begins
        part_at = np.searchsorted(part_rows, np.arange(len(ends) + 1))  # where each part's rows begin
        strips_in = np.diff(np.searchsorted(strip_at, part_at))
        staged = (np.diff(part_at) >= max(1, DMA_COPY_BYTES // line) * strips_in) & (self._host is not None)
        self.indexed_rows = total
        """Rows of the index tensors uploaded: one part's when its parts share a template."""
        index = torch.from_numpy(np.stack([local, pooled]))
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        strip_bounds: list[int] = np.append(np.searchsorted(strip_at, batch_first), len(strip_at)).tolist()
        strip_rows = list(zip(starts[first].tolist(), strip_at.tolist(), widths[first].tolist(), pitches.tolist(),
                              heights.tolist()))
        local_rows, pool_rows = _cut(index[0], batch_first), _cut(index[1], batch_first)
        self._parts: list[list[_Kernels | _Staged]] = [[] for _ in ends]
        for batch, (at, part, span) in enumerate(zip(batch_first.tolist(), part_rows[batch_first].tolist(),
                                                     span_rows[batch_first].tolist())):
            if not staged[part]:
                self._parts[part].append(_Kernels(span, local_rows[batch], pool_rows[batch]))
                continue
            self._parts[part].append(_Staged(span, local_rows[batch], [
                _Strip(pool_row, row - at, rows, pitch, height)
                for pool_row, row, rows, pitch, height in strip_rows[strip_bounds[batch]:strip_bounds[batch + 1]]]))

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
        return any(isinstance(step, _Staged) for step in self._parts[0 if self._bases else part])

    def move(self, part: int, *, to_pool: bool) -> None:
        """Queue part ``part``'s copies on the current stream."""
        local_base = pool_base = 0
        if self._bases is None:
            steps = self._parts[part]
        else:  # the first part's rows, from this part's bases
            steps, (local_base, pool_base) = self._parts[0], self._bases[part]
        for step in steps:
            local = self._spans[step.span]
            local = local[local_base:] if local_base else local
            if isinstance(step, _Kernels):
                pool = self._pool[pool_base:] if pool_base else self._pool
                if to_pool:
                    pool.index_copy_(0, step.pool_rows, local.index_select(0, step.local_rows))
                else:
                    local.index_copy_(0, step.local_rows, pool.index_select(0, step.pool_rows))
                continue
            host = self._host
            assert host is not None
            if to_pool:
                staging = local.index_select(0, step.local_rows)
                for strip in step.strips:
                    _copy(_strided(host, strip, pool_base), _packed(staging, strip))
            else:
                staging = local.new_empty((len(step.local_rows), local.shape[1]))
                for strip in step.strips:
                    _copy(_packed(staging, strip), _strided(host, strip, pool_base))
                local.index_copy_(0, step.local_rows, staging)


def _template(local_at: np.ndarray, pool_at: np.ndarray, counts: np.ndarray, ends: Sequence[int],
              ) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray] | None:
    """Parts of equal length whose every range is the first part's moved by one number of rows
    on the local side and one on the pool side (a load posted layer by layer: each layer's
    buffer holds the same blocks, each entry the layer at the same place): per part the rows
    its template rows start from (its lowest local and pool rows), and the template (the first
    part's start rows less its bases, its row counts). None for any other shape. Planning 32
    layers as one (index arrays, strips, the upload) instead of each is most of a 256-block
    load's host time."""
    parts = len(ends)
    size = len(counts) // parts if parts else 0
    if parts < 2 or not size or not np.array_equal(np.asarray(ends), size * np.arange(1, parts + 1)):
        return None
    local, pooled, widths = (values.reshape(parts, size) for values in (local_at, pool_at, counts))
    if not (widths == widths[0]).all():
        return None
    local_moved, pool_moved = local - local[:, :1], pooled - pooled[:, :1]
    if not ((local_moved == local_moved[0]).all() and (pool_moved == pool_moved[0]).all()):
        return None
    local_base, pool_base = local.min(axis=1), pooled.min(axis=1)
    return (list(zip(local_base.tolist(), pool_base.tolist())), local[0] - local_base[0], pooled[0] - pool_base[0],
            widths[0])


def _batch_starts(group_first: np.ndarray, total: int, limit: int) -> np.ndarray:
    """Where each staging batch's rows begin: every group (starting at ``group_first``, the rows
    ``total``) cut into batches of at most ``limit`` rows. One group that fits one batch (a
    save of up to ``GATHER_BYTES``) is the usual case, taken without the arithmetic."""
    if len(group_first) == 1 and total <= limit:
        return group_first
    batches = -(-np.diff(np.append(group_first, total)) // limit)
    return np.repeat(group_first, batches) + limit * (
        np.arange(int(batches.sum())) - np.repeat(np.cumsum(batches) - batches, batches))


def _cut(rows: torch.Tensor, batch_first: np.ndarray) -> tuple[torch.Tensor, ...]:
    """``rows`` cut where each batch begins (one call per side; one batch: no cut)."""
    return (rows,) if len(batch_first) <= 1 else torch.tensor_split(rows, batch_first[1:].tolist())


def _starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal ``values`` begins (0 first; none when empty)."""
    if not len(values):
        return np.zeros(0, dtype=np.int64)
    out = np.flatnonzero(values[1:] != values[:-1]) + 1
    return np.concatenate(([0], out)) if len(out) else np.zeros(1, dtype=np.int64)


def _pool_order(group: np.ndarray | None, pool_row: np.ndarray) -> np.ndarray | None:
    """The stable order by (``group``, ``pool_row``), both non-negative (``group`` None: all in
    one); None when they are in that order already (the worker lists a step's ranges so: the
    sort and every reordering of a 16k-range plan's columns were ~40% of its host time). One
    sort of a packed key where both fit in 63 bits (a two-key ``lexsort`` of a step's 8,192
    ranges took 160 us, ten times as long, most of it even when they were in order already)."""
    if not len(pool_row):
        return None
    if group is None:
        key = pool_row
    else:
        row_bits = int(pool_row.max()).bit_length()
        if int(group.max()).bit_length() + row_bits > 63:
            return np.lexsort((pool_row, group))
        key = (group << row_bits) | pool_row
    return None if bool((key[1:] >= key[:-1]).all()) else np.argsort(key, kind="stable")


def strip_starts(starts: np.ndarray, widths: np.ndarray, line: int, strided: bool = True,
                 apart: np.ndarray | None = None) -> np.ndarray:
    """Where strips begin among stretches (pool rows ``starts``, ``widths`` rows each, in pool
    order, packed in that order in staging). A strip is stretches of one width at one pitch (the
    gap from one to the next): one strided copy. Without ``strided`` copies every stretch is its
    own strip, and ``apart[i]`` keeps stretches i and i + 1 in strips of their own (stretch
    i + 1 begins another staging batch). Links
    (stretch i to i+1) are runs of equal pitch; where two runs meet, one of the two links is cut:
    a lone link (one odd gap between two runs) rather than a run's first link."""
    count = len(starts)
    if not strided or count < 2:
        return np.arange(count)
    pitch = np.diff(starts)
    link = ((widths[1:] == widths[:-1]) & (pitch >= widths[:-1]) & (pitch * line <= MAX_PITCH)
            & (widths[:-1] * line >= MIN_STRIDED_ROW))
    if apart is not None:
        link &= ~apart
    run_start = link.copy()
    run_start[1:] &= ~(link[:-1] & (pitch[1:] == pitch[:-1]))
    run_of = np.cumsum(run_start) - 1
    run_length = np.bincount(run_of[link], minlength=int(run_of[-1]) + 1)
    meet = np.flatnonzero(run_start[1:] & link[:-1]) + 1  # link i begins a run right after link i-1's
    keep = link.copy()
    keep[np.where(run_length[run_of[meet - 1]] == 1, meet - 1, meet)] = False
    return np.concatenate([[0], np.flatnonzero(~keep) + 1])


def _strided(host: torch.Tensor, strip: _Strip, pool_base: int = 0) -> torch.Tensor:
    """The strip's stretches in the pool (rows of words), ``pool_base`` rows on, as one strided
    2-D view."""
    words = host.shape[1]
    return host.as_strided((strip.height, strip.rows * words), (strip.pitch * words, 1),
                           host.storage_offset() + (pool_base + strip.pool_row) * words)


def _packed(staging: torch.Tensor, strip: _Strip) -> torch.Tensor:
    """The strip's rows in staging, packed, as the same 2-D shape."""
    rows = strip.rows * strip.height
    return staging[strip.staging_row: strip.staging_row + rows].view(strip.height, -1)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """An asynchronous copy of one strip; one stretch or CPU tensors by torch, a strided copy to
    or from the GPU by the CUDA runtime (torch would pack it on the host first)."""
    if dst.shape[0] > 1 and (dst.is_cuda or src.is_cuda):
        copy_2d(dst, src)
    else:
        dst.copy_(src, non_blocking=True)
