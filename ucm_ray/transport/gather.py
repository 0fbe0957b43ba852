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

from ucm_ray.transport.base import Ranges, RepeatedRanges, local_buffers
from ucm_ray.transport.cudart import copy_rows, has_copy_rows

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


CONCAT_BELOW = 8192
"""Values in all, below which ``line_bytes`` reduces its columns concatenated (one call's fixed
cost, not one a column); from it on, each column alone (a prompt's save: no copy of its
16k-131k ranges' columns)."""


def line_bytes(*columns: np.ndarray) -> int:
    """The row size for these offsets and sizes: 0 when they are not all 8-byte aligned. (The
    largest power of two dividing them all is the lowest bit set in any of them.)"""
    if len(columns) > 1 and sum(map(len, columns)) < CONCAT_BELOW:
        columns = (np.concatenate(columns),)
    bits = 0
    for values in columns:
        bits |= int(np.bitwise_or.reduce(values)) if len(values) else 0
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
        self._from: dict[tuple[int, int], torch.Tensor] = {}

    def rows_from(self, span: int, row: int) -> torch.Tensor:
        """``views[span]`` from row ``row`` on, made once: a layer's rows in a load posted layer
        by layer start at the same row every step (its buffer's), so each post reuses its view."""
        view = self._from.get((span, row))
        if view is None:
            view = self._from[(span, row)] = self.views[span][row:]
        return view


SPANS_KEPT = 8
"""Spans of recent buffer sets kept for the next plans: an engine plans over the same KV caches
every step, and making the views cost each plan more than a third of its host time."""
_recent_spans: OrderedDict[tuple[int, torch.device | None, tuple[int, ...], tuple[int, ...]], _Spans] = OrderedDict()


def _spans_of(buffers: Sequence[torch.Tensor], line: int) -> _Spans:
    """``_Spans(buffers, line)``, made once per buffer set (by device, address and size: a view
    of a span owns nothing, so equal keys are the same memory). Safe beside another thread
    doing the same: the worst is a set's spans made twice."""
    known = local_buffers(buffers)
    key = (line, known[0].device if known else None, known.addresses, known.numels)
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
class _Staged:
    """Staged DMA: these rows of one span, gathered in pool order in device memory (``staging``,
    the plan's one buffer); then each copy (``copies``: addresses and bytes, made once) moves
    one strip with the pool as host memory."""

    span: int
    local_rows: torch.Tensor
    staging: torch.Tensor
    copies: list[tuple[int, int, int, int, int]]
    """Per strip: (its address in staging, its offset in the pool from the part's base, the
    pool's pitch, a row's bytes, rows)."""


class GatherPlan:
    """The copies of ``ranges`` as rows, split into parts (``ends[k]`` is where part k's ranges
    end), each part into kernel pairs or DMA batches of one span and at most ``run_bytes``. Built
    on the stream that will move it (the index upload is queued there, and its DMA copies go
    there). ``host_pool``: the pool as host memory (page-locked), which enables the DMA path;
    ``pool`` is what kernels address. ``repeats``: ``ranges`` are one part's, and every part is
    them from rows of its own (``build_repeated``)."""

    def __init__(self, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int], line: int,
                 run_bytes: int = GATHER_BYTES, host_pool: torch.Tensor | None = None,
                 repeats: list[tuple[int, int, int]] | None = None, spans: _Spans | None = None) -> None:
        if not len(ends) or ends[-1] != len(ranges):
            raise ValueError(f"part ends {list(ends)[-3:]} must end at the last of the {len(ranges)} ranges")
        self._line = line
        self._host_address = host_pool.data_ptr() if host_pool is not None else 0
        self._buffers = ranges.buffers  # the spans' views own nothing: these keep the memory alive
        self._spans = _spans_of(ranges.buffers, line) if spans is None else spans
        self._repeats = repeats
        """Per part (span, local row, pool row): where its rows start, when every part repeats
        the one part planned (whose rows then count from there)."""
        limit = max(1, run_bytes // line)
        shift = line.bit_length() - 1  # a line is a power of two: rows by a shift, not a division
        local_at = self._local_rows(ranges)
        span_count = len(self._spans.views) if repeats is None else 1
        dma = host_pool is not None and self._dma_on(pool, ranges.device)
        per_strip = max(1, DMA_COPY_BYTES // line)  # rows a copy must move on average
        if dma and len(ends) == 1 and span_count == 1 and \
                _one_stretch(ranges.pool_offsets, ranges.sizes, line, per_strip, limit):
            one_row = int(ranges.sizes.min()) == line == int(ranges.sizes.max())
            self._stage_one_stretch(pool, local_at if one_row else _rows(local_at, ranges.sizes >> shift, False),
                                    int(ranges.pool_offsets[0]) >> shift, limit)
            return
        pool_at: np.ndarray = ranges.pool_offsets >> shift
        counts: np.ndarray = ranges.sizes >> shift
        # ranges are grouped per part, per span (None: one part over one span, as a save, a
        # load of every layer at once or a repeated part is: the pool rows alone order them)
        group: np.ndarray | None = None
        if len(ends) > 1 or span_count > 1:
            bounds = np.concatenate([[0], np.asarray(ends, dtype=np.int64)])
            part_of: np.ndarray = np.repeat(np.arange(len(ends)), np.diff(bounds))
            span_of = self._spans.span_of[ranges.buffer_index] if span_count > 1 else np.zeros(len(ranges), np.int64)
            group = part_of * span_count + span_of
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
        begins_batch: np.ndarray | None = None  # None: one batch, beginning at row 0
        breaks: np.ndarray = np.ones(total, dtype=bool)
        np.not_equal(pooled[1:] - pooled[:-1], 1, out=breaks[1:])
        if len(batch_first) > 1:
            begins_batch = np.zeros(total, dtype=bool)
            begins_batch[batch_first] = True
            breaks |= begins_batch
        stretch_first = np.flatnonzero(breaks)
        widths = np.diff(stretch_first, append=total)
        starts = pooled[stretch_first]
        first = strip_starts(starts, widths, line,
                             apart=None if begins_batch is None else begins_batch[stretch_first[1:]])
        heights = np.diff(first, append=len(starts))
        pitches = np.where(heights > 1, starts[np.minimum(first + 1, len(starts) - 1)] - starts[first], widths[first])
        strip_at = stretch_first[first]  # the row where each strip begins
        staged: list[bool]
        if len(ends) == 1:  # one part (a save, every layer at once, a repeated part): every row and strip
            staged = [dma and total >= per_strip * len(first)]
        else:
            part_at = np.searchsorted(part_rows, np.arange(len(ends) + 1))  # where each part's rows begin
            strips_in = np.diff(np.searchsorted(strip_at, part_at))
            staged = ((np.diff(part_at) >= per_strip * strips_in) & dma).tolist()
        kernels = not all(staged)
        self._pool = _as_rows(pool, line) if kernels else None
        """The pool as rows for the gather kernels (None: every part staged, none needs it)."""
        self.indexed_rows = total
        """Rows of the index tensors uploaded: one part's when its parts repeat it."""
        # the local rows always (a staged part scatters from staging by them); the pool rows
        # only for the kernels (a staged part's pool side is its strips' addresses)
        index = torch.from_numpy(np.stack([local, pooled]) if kernels else local)
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        strip_bounds: list[int]
        batch_rows: list[int]
        if len(batch_first) == 1:  # one batch (a load's layer, a save up to ``run_bytes``): every strip, row
            strip_bounds, batch_rows = [0, len(strip_at)], [total]
        else:
            strip_bounds = np.append(np.searchsorted(strip_at, batch_first), len(strip_at)).tolist()
            batch_rows = np.diff(np.append(batch_first, total)).tolist()
        strip_rows = list(zip(starts[first].tolist(), strip_at.tolist(), widths[first].tolist(), pitches.tolist(),
                              heights.tolist()))
        batch_parts: list[int] = part_rows[batch_first].tolist()
        local_rows = _cut(index[0] if kernels else index, batch_first)
        pool_rows = _cut(index[1], batch_first) if kernels else ()
        # one staging buffer for the plan: its parts move one after another on its stream
        staged_rows = [rows for rows, part in zip(batch_rows, batch_parts) if staged[part]]
        staging = self._spans.views[0].new_empty((max(staged_rows), line // WORD)) if staged_rows else None
        self._parts: list[list[_Kernels | _Staged]] = [[] for _ in ends]
        for batch, (at, part, span) in enumerate(zip(batch_first.tolist(), batch_parts,
                                                     span_rows[batch_first].tolist())):
            if not staged[part]:
                self._parts[part].append(_Kernels(span, local_rows[batch], pool_rows[batch]))
                continue
            assert staging is not None
            address = staging.data_ptr()
            rows_in = staging if len(staging) == batch_rows[batch] else staging[:batch_rows[batch]]
            self._parts[part].append(_Staged(span, local_rows[batch], rows_in, [
                (address + (row - at) * line, pool_row * line, pitch * line, rows * line, height)
                for pool_row, row, rows, pitch, height in strip_rows[strip_bounds[batch]:strip_bounds[batch + 1]]]))

    def _local_rows(self, ranges: Ranges) -> np.ndarray:
        """The first local row of each range: in its span's view, or, when the parts repeat one
        part, from a part's own first rows (no span of their own)."""
        rows = ranges.local_offsets >> (self._line.bit_length() - 1)
        if self._repeats is not None:
            return rows
        rows += self._spans.first_row[ranges.buffer_index]
        return rows

    def _dma_on(self, pool: torch.Tensor, device: torch.device) -> bool:
        """Set how the plan's DMA copies go (on CUDA, on the current stream), and tell whether
        they can here (given the pool as host memory)."""
        on_gpu = pool.is_cuda or device.type == "cuda"
        self._copy_rows = copy_rows if on_gpu else _memmove_rows
        self._stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        return not on_gpu or has_copy_rows()

    def _stage_one_stretch(self, pool: torch.Tensor, local: np.ndarray, pool_row: int, limit: int) -> None:
        """The plan of one part over one span whose pool rows are one stretch from ``pool_row``
        on (``_one_stretch``: a save of entries in adjacent slots): staging batches of ``limit``
        rows, each one copy. What the general planning makes of it, without its ~40 numpy calls
        and its passes over every row (order, stretches, strips): a decode step's save (4-8
        entries of 64 ranges) spent most of its plan's host time in their fixed costs, a
        prompt's (256 entries, 16k ranges) in the passes."""
        total = len(local)
        index = torch.from_numpy(local)
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        most = min(total, limit)
        staging = self._spans.views[0].new_empty((most, self._line // WORD))
        address = staging.data_ptr()
        self._pool = None
        self.indexed_rows = total
        firsts = range(0, total, limit)
        cuts = torch.tensor_split(index, list(firsts[1:])) if total > limit else (index,)
        steps: list[_Kernels | _Staged] = []
        for first, rows in zip(firsts, cuts):
            height = min(most, total - first)
            steps.append(_Staged(0, rows, staging if height == most else staging[:height],
                                 [(address, (pool_row + first) * self._line, height * self._line,
                                   height * self._line, 1)]))
        self._parts = [steps]

    @classmethod
    def build(cls, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int], run_bytes: int = GATHER_BYTES,
              host_pool: torch.Tensor | None = None) -> GatherPlan | None:
        """The plan, or None when the ranges or a tensor's start share no 8-byte alignment."""
        line = _line(pool, host_pool, ranges, ranges.sizes, ranges.pool_offsets, ranges.local_offsets)
        return cls(pool, ranges, ends, line, run_bytes, host_pool) if line else None

    @classmethod
    def build_repeated(cls, pool: torch.Tensor, repeated: RepeatedRanges, run_bytes: int = GATHER_BYTES,
                       host_pool: torch.Tensor | None = None) -> GatherPlan | None:
        """The plan of parts that repeat one part's ranges (a load posted layer by layer): that
        part's index arrays, strips and upload, made once, each part moved from rows of its own
        (its buffer's first row and its shifts; the same rows every step, so a post reuses its
        views). None as ``build``, or when the template's ranges lie in more than one buffer or
        a part's first rows would lie before its span's (then ``build`` of
        ``repeated.expand()``)."""
        template = repeated.template
        line = _line(pool, host_pool, template, template.sizes, template.pool_offsets, template.local_offsets,
                     repeated.local_shifts, repeated.pool_shifts)
        if not line or not len(template):
            return None
        home = int(repeated.buffer_index[0])
        if template.buffer_index.min() != home or template.buffer_index.max() != home:
            return None
        spans = _spans_of(template.buffers, line)
        local_base: np.ndarray = spans.first_row[repeated.buffer_index] + repeated.local_shifts // line
        pool_base: np.ndarray = repeated.pool_shifts // line
        if local_base.min() < 0 or pool_base.min() < 0:
            return None
        repeats = list(zip(spans.span_of[repeated.buffer_index].tolist(), local_base.tolist(), pool_base.tolist()))
        return cls(pool, template, [len(template)], line, run_bytes, host_pool, repeats, spans)

    def staged(self, part: int) -> bool:
        """Whether part ``part`` moves by staged DMA."""
        return any(isinstance(step, _Staged) for step in self._parts[0 if self._repeats else part])

    def move(self, part: int, *, to_pool: bool) -> None:
        """Queue part ``part``'s copies on the current stream (the one the plan was built on)."""
        local: torch.Tensor | None = None
        pool_base = 0
        if self._repeats is None:
            steps = self._parts[part]
        else:  # the one part planned, from this part's rows
            span, local_base, pool_base = self._repeats[part]
            steps, local = self._parts[0], self._spans.rows_from(span, local_base)
        for step in steps:
            rows = self._spans.views[step.span] if local is None else local
            if isinstance(step, _Kernels):
                assert self._pool is not None  # made for any plan with kernels
                pool = self._pool[pool_base:] if pool_base else self._pool
                if to_pool:
                    pool.index_copy_(0, step.pool_rows, rows.index_select(0, step.local_rows))
                else:
                    rows.index_copy_(0, step.local_rows, pool.index_select(0, step.pool_rows))
                continue
            host = self._host_address + pool_base * self._line
            if to_pool:
                torch.index_select(rows, 0, step.local_rows, out=step.staging)
                for staging, at, pitch, width, height in step.copies:
                    self._copy_rows(host + at, pitch, staging, width, width, height, self._stream)
            else:
                for staging, at, pitch, width, height in step.copies:
                    self._copy_rows(staging, width, host + at, pitch, width, height, self._stream)
                rows.index_copy_(0, step.local_rows, step.staging)


def _line(pool: torch.Tensor, host_pool: torch.Tensor | None, ranges: Ranges, *values: np.ndarray) -> int:
    """The plan's row size (``line_bytes`` of ``values``), or 0 when a tensor's start or a value
    shares no 8-byte alignment."""
    hosts = () if host_pool is None else (host_pool,)
    if any(t.data_ptr() % WORD for t in (pool, *hosts)) or \
            any(address % WORD for address in local_buffers(ranges.buffers).addresses):
        return 0
    return line_bytes(*values)


def _memmove_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """``copy_rows`` between CPU addresses (a plan over CPU tensors: tests, benchmarks)."""
    for row in range(height):
        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)


def _one_stretch(pool_offsets: np.ndarray, sizes: np.ndarray, line: int, least: int, most: int) -> bool:
    """Whether ranges at ``pool_offsets`` of ``sizes`` bytes each (multiples of ``line``) lie
    side by side in pool order, as one stretch whose staging batches of ``most`` rows (one copy
    each) move ``least`` rows a copy on average, as the general planning stages a part. In
    bytes, with one temporary: the rows are made only for a plan that needs them."""
    if not len(sizes):
        return False
    span = int(pool_offsets[-1]) - int(pool_offsets[0]) + int(sizes[-1])
    total = span // line
    if total <= 0 or least * -(-total // most) > total or int(sizes.sum()) != span:
        return False  # (ranges with gaps between, as a load's layer of entries: a reduction, not a pass)
    gaps = np.subtract(pool_offsets[1:], pool_offsets[:-1])
    gaps -= sizes[:-1]
    return not gaps.any()


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


def strip_starts(starts: np.ndarray, widths: np.ndarray, line: int, apart: np.ndarray | None = None) -> np.ndarray:
    """Where strips begin among stretches (pool rows ``starts``, ``widths`` rows each, in pool
    order, packed in that order in staging). A strip is stretches of one width at one pitch (the
    gap from one to the next): one strided copy. ``apart[i]`` keeps stretches i and i + 1 in
    strips of their own (stretch i + 1 begins another staging batch). Links
    (stretch i to i+1) are runs of equal pitch; where two runs meet, one of the two links is cut:
    a lone link (one odd gap between two runs) rather than a run's first link."""
    count = len(starts)
    if count < 2:
        return np.arange(count)
    pitch = np.diff(starts)
    if _one_strip(pitch, widths, line) and (apart is None or not apart.any()):
        return np.zeros(1, dtype=np.int64)  # a load's layer of entries in adjacent slots: ~20 numpy calls spared
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


def _one_strip(pitch: np.ndarray, widths: np.ndarray, line: int) -> bool:
    """Whether stretches of these ``widths`` (rows), ``pitch`` apart, are one strided copy:
    one width, one pitch, within the copy's limits (``strip_starts``'s links, every one kept)."""
    step, width = int(pitch[0]), int(widths[0])
    return (step >= width and step * line <= MAX_PITCH and width * line >= MIN_STRIDED_ROW
            and bool((pitch == step).all()) and bool((widths == width).all()))
