"""Property tests of ``GatherPlan`` (hypothesis): random steps over one or several buffers and
spans, split into parts that are translates of the first or almost so (one range's width,
start or order changed, a range dropped or repeated, a part empty), moved in any order, by
kernels or staged copies, both ways; and parts given as one part's ranges repeated
(``RepeatedRanges``, a load posted layer by layer, which the plan indexes once), two steps in a
row over the same buffers with other rows the second time (the parts' views are reused across
steps; their rows never are). Every byte of the buffers and the pool, guards around them
included, must equal a reference that copies range by range."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ucm_ray.transport import gather
from ucm_ray.transport.base import Ranges, RepeatedRanges
from ucm_ray.transport.gather import GatherPlan

POOL_ROWS = 96
GAP_ROWS = 2
"""Rows between buffers (never indexed: a write there is a plan writing outside its ranges)."""

Row = tuple[int, int, int, int]
"""(buffer, local row, pool row, rows) in units of the step's ``unit`` bytes."""


@dataclass(frozen=True)
class Step:
    unit: int
    buffers: int
    buffer_rows: int
    split: bool
    """Odd buffers start 8 bytes off: a span of their own (no template)."""
    parts: list[list[Row]]
    order: list[int]
    to_pool: bool
    run_units: int
    dma_units: int
    host: bool

    @property
    def translates(self) -> bool:
        """Whether every part is the first moved by one number of rows on each side (in span
        rows: buffers lie ``buffer_rows + GAP_ROWS`` apart), and there are several, non-empty."""
        first = self.parts[0]
        if len(self.parts) < 2 or not first or any(len(part) != len(first) for part in self.parts):
            return False
        stride = self.buffer_rows + GAP_ROWS

        def at(row: Row) -> tuple[int, int]:
            return row[0] * stride + row[1], row[2]

        for part in self.parts[1:]:
            (l0, p0), (m0, q0) = at(first[0]), at(part[0])
            for a, b in zip(first, part):
                (la, pa), (lb, pb) = at(a), at(b)
                if a[3] != b[3] or lb - la != m0 - l0 or pb - pa != q0 - p0:
                    return False
        return True


def _consistent(part: list[Row], stride: int) -> bool:
    """No row of either side meets two different rows of the other within one part (so the
    reference is one answer whatever order a part's copies take)."""
    pairs: dict[tuple[str, int], int] = {}
    for buffer, local, pooled, rows in part:
        for r in range(rows):
            here, there = buffer * stride + local + r, pooled + r
            if pairs.setdefault(("local", here), there) != there or pairs.setdefault(("pool", there), here) != here:
                return False
    return True


def _near_miss(draw: st.DrawFn, part: list[Row], a_range: Callable[[], Row], buffer_rows: int) -> None:
    """Change ``part`` a little: one range's width, local or pool start, dropped, repeated or
    swapped with another; a range added; the part emptied."""
    kind = draw(st.sampled_from(["width", "local", "pool", "drop", "repeat", "swap", "empty", "new"]))
    if kind == "empty":
        part.clear()
        return
    if kind == "new" or not part:
        part.append(a_range())
        return
    i = draw(st.integers(0, len(part) - 1))
    b, lo, p, n = part[i]
    if kind == "width":
        n2 = draw(st.integers(1, 3))
        part[i] = (b, min(lo, buffer_rows - n2), min(p, POOL_ROWS - n2), n2)
    elif kind == "local":
        part[i] = (b, draw(st.integers(0, buffer_rows - n)), p, n)
    elif kind == "pool":
        part[i] = (b, lo, draw(st.integers(0, POOL_ROWS - n)), n)
    elif kind == "drop":
        del part[i]
    elif kind == "repeat":
        part.insert(draw(st.integers(0, len(part))), part[i])
    else:
        j = draw(st.integers(0, len(part) - 1))
        part[i], part[j] = part[j], part[i]


def _local_shape(draw: st.DrawFn) -> tuple[int, int, int, bool]:
    """A step's row size, buffer count, rows a buffer, and whether every other buffer starts off a row."""
    unit = draw(st.sampled_from([8, 64, 4096]))
    buffers = draw(st.integers(1, 3))
    buffer_rows = draw(st.integers(4, 24))
    split = buffers > 1 and unit > 8 and draw(st.booleans())
    return unit, buffers, buffer_rows, split


@st.composite
def steps(draw: st.DrawFn) -> Step:
    unit, buffers, buffer_rows, split = _local_shape(draw)
    stride = buffer_rows + GAP_ROWS

    def a_range() -> Row:
        rows = draw(st.integers(1, 3))
        return (draw(st.integers(0, buffers - 1)), draw(st.integers(0, buffer_rows - rows)),
                draw(st.integers(0, POOL_ROWS - rows)), rows)

    template = [a_range() for _ in range(draw(st.integers(1, 6)))]
    parts = [template]
    for _ in range(draw(st.integers(0, 4))):  # translates, where one fits
        low = min(b * stride + lo for b, lo, _, _ in template)
        local_moves = [d for d in range(-low, buffers * stride)
                       if all(0 <= (b * stride + lo + d) % stride <= buffer_rows - n
                              and (b * stride + lo + d) // stride < buffers for b, lo, _, n in template)]
        pool_low, pool_high = min(p for _, _, p, _ in template), max(p + n for _, _, p, n in template)
        d = draw(st.sampled_from(local_moves))
        q = draw(st.integers(-pool_low, POOL_ROWS - pool_high))
        parts.append([((b * stride + lo + d) // stride, (b * stride + lo + d) % stride, p + q, n)
                      for b, lo, p, n in template])
    for _ in range(draw(st.integers(0, 2))):  # near misses
        _near_miss(draw, parts[draw(st.integers(0, len(parts) - 1))], a_range, buffer_rows)
    if not all(_consistent(part, stride) for part in parts) or not any(parts):
        return draw(st.nothing())
    order = draw(st.lists(st.integers(0, len(parts) - 1), min_size=1, max_size=2 * len(parts)))
    order += list(range(len(parts)))
    return Step(unit, buffers, buffer_rows, split, parts, order, draw(st.booleans()),
                draw(st.sampled_from([1, 2, 3, 5, 1 << 20])), draw(st.sampled_from([0, 1, 4, 1 << 20])),
                draw(st.booleans()))


def _aligned(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(1, 256, (nbytes + 8192,), dtype=torch.uint8, generator=g)
    return flat[-flat.data_ptr() % 4096:][:nbytes]


def _memory(step: Step | Repeat) -> tuple[torch.Tensor, list[int], tuple[torch.Tensor, ...], torch.Tensor]:
    """The step's local memory, where each of its buffers starts in it (``buffer_rows`` rows each,
    ``GAP_ROWS`` apart, every other one 8 bytes off a row when ``split``), the buffers, and a pool
    of ``POOL_ROWS`` rows, random bytes."""
    u, stride = step.unit, step.buffer_rows + GAP_ROWS
    whole = _aligned((step.buffers * stride + GAP_ROWS) * u + 64, seed=1)
    starts = [b * stride * u + (8 if step.split and b % 2 else 0) for b in range(step.buffers)]
    return whole, starts, tuple(whole[s: s + step.buffer_rows * u] for s in starts), _aligned(POOL_ROWS * u, seed=2)


@settings(max_examples=250, deadline=None)
@given(steps())
def test_a_plan_part_by_part_moves_exactly_the_reference_bytes(step: Step):
    u = step.unit
    whole, starts, buffers, pool = _memory(step)
    flat = [(b, lo * u, p * u, n * u) for part in step.parts for b, lo, p, n in part]
    ends = np.cumsum([len(part) for part in step.parts]).tolist()
    ranges = Ranges(buffers, *(np.asarray(column, dtype=np.int64) for column in zip(*flat)))
    expected_whole, expected_pool = whole.clone(), pool.clone()
    saved = gather.DMA_COPY_BYTES
    gather.DMA_COPY_BYTES = step.dma_units * u
    try:
        plan = GatherPlan.build(pool, ranges, ends, run_bytes=step.run_units * u,
                                host_pool=pool if step.host else None)
    finally:
        gather.DMA_COPY_BYTES = saved
    assert plan is not None
    bytes_of = [sum(n * u for *_, n in part) for part in step.parts]
    line = gather.line_bytes(np.concatenate([ranges.sizes, ranges.pool_offsets, ranges.local_offsets]))
    assert plan.indexed_rows * line == sum(bytes_of), "every part planned"
    event(f"translates={step.translates} staged={any(plan.staged(k) for k in range(len(step.parts)))}")
    for part in step.order:
        plan.move(part, to_pool=step.to_pool)
        for b, lo, p, n in step.parts[part]:
            local = slice(starts[b] + lo * u, starts[b] + (lo + n) * u)
            if step.to_pool:
                expected_pool[p * u: (p + n) * u] = expected_whole[local]
            else:
                expected_whole[local] = expected_pool[p * u: (p + n) * u]
        assert torch.equal(pool, expected_pool) and torch.equal(whole, expected_whole), part


@dataclass(frozen=True)
class Repeat:
    unit: int
    buffers: int
    buffer_rows: int
    split: bool
    template: list[tuple[int, int, int]]
    """(local row, pool row, rows) in buffer ``parts[0][0]``."""
    next_template: list[tuple[int, int, int]]
    """The next step's: the same ranges with their local rows dealt out again."""
    parts: list[tuple[int, int, int]]
    """(buffer, local shift, pool shift) in rows; the first (home, 0, 0)."""
    order: list[int]
    to_pool: bool
    run_units: int
    dma_units: int
    host: bool


@st.composite
def repeats(draw: st.DrawFn) -> Repeat:
    unit, buffers, buffer_rows, split = _local_shape(draw)
    home = draw(st.integers(0, buffers - 1))
    template = []
    for _ in range(draw(st.integers(1, 6))):
        rows = draw(st.integers(1, 3))
        template.append((draw(st.integers(0, buffer_rows - rows)), draw(st.integers(0, POOL_ROWS - rows)), rows))
    dealt = draw(st.permutations(range(len(template))))
    next_template = [(template[j][0], pooled, rows) if template[j][2] == rows else (local, pooled, rows)
                     for j, (local, pooled, rows) in zip(dealt, template)]
    low = min(min(lo for lo, _, _ in t) for t in (template, next_template))
    high = max(max(lo + n for lo, _, n in t) for t in (template, next_template))
    pool_low, pool_high = min(p for _, p, _ in template), max(p + n for _, p, n in template)
    parts = [(home, 0, 0)]
    for _ in range(draw(st.integers(0, 4))):
        parts.append((draw(st.integers(0, buffers - 1)), draw(st.integers(-low, buffer_rows - high)),
                      draw(st.integers(-pool_low, POOL_ROWS - pool_high))))
    stride = buffer_rows + GAP_ROWS
    for t in (template, next_template):
        for b, d, q in parts:
            if not _consistent([(b, lo + d, p + q, n) for lo, p, n in t], stride):
                return draw(st.nothing())
    order = draw(st.lists(st.integers(0, len(parts) - 1), min_size=1, max_size=2 * len(parts)))
    order += list(range(len(parts)))
    return Repeat(unit, buffers, buffer_rows, split, template, next_template, parts, order, draw(st.booleans()),
                  draw(st.sampled_from([1, 2, 3, 5, 1 << 20])), draw(st.sampled_from([0, 1, 4, 1 << 20])),
                  draw(st.booleans()))


@settings(max_examples=250, deadline=None)
@given(repeats())
def test_repeated_parts_planned_once_move_exactly_the_reference_bytes_step_after_step(step: Repeat):
    u = step.unit
    whole, starts, buffers, pool = _memory(step)
    expected_whole, expected_pool = whole.clone(), pool.clone()
    home = step.parts[0][0]
    column = [np.asarray(values, dtype=np.int64) for values in zip(*step.parts)]
    for template in (step.template, step.next_template):  # two steps in a row, over the same buffers
        ranges = Ranges(buffers, np.full(len(template), home, dtype=np.int64),
                        *(u * np.asarray(values, dtype=np.int64) for values in zip(*template)))
        ranges = Ranges(buffers, ranges.buffer_index, ranges.local_offsets, ranges.pool_offsets, ranges.sizes)
        repeated = RepeatedRanges(ranges, column[0], u * column[1], u * column[2])
        saved = gather.DMA_COPY_BYTES
        gather.DMA_COPY_BYTES = step.dma_units * u
        try:
            plan = GatherPlan.build_repeated(pool, repeated, run_bytes=step.run_units * u,
                                             host_pool=pool if step.host else None)
            if plan is None:  # a part's rows before its span's or the pool's: every range planned instead
                assert (column[1] < 0).any() or (column[2] < 0).any()
                plan = GatherPlan.build(pool, repeated.expand(), repeated.ends(), run_bytes=step.run_units * u,
                                        host_pool=pool if step.host else None)
                assert plan is not None
            else:
                line = gather.line_bytes(np.concatenate([ranges.sizes, ranges.pool_offsets, ranges.local_offsets,
                                                         repeated.local_shifts, repeated.pool_shifts]))
                assert plan.indexed_rows * line == int(ranges.sizes.sum()), "one part planned"
        finally:
            gather.DMA_COPY_BYTES = saved
        event(f"repeated staged={plan.staged(0)} parts={len(step.parts)}")
        for part in step.order:
            plan.move(part, to_pool=step.to_pool)
            b, d, q = step.parts[part]
            for lo, p, n in template:
                local = slice(starts[b] + (lo + d) * u, starts[b] + (lo + d + n) * u)
                if step.to_pool:
                    expected_pool[(p + q) * u: (p + q + n) * u] = expected_whole[local]
                else:
                    expected_whole[local] = expected_pool[(p + q) * u: (p + q + n) * u]
            assert torch.equal(pool, expected_pool) and torch.equal(whole, expected_whole), part
