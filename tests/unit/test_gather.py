"""The gather plan the CUDA shm path uses, checked with CPU tensors (the same code: only the
index upload, the stream and the strided copy's call differ on CUDA); the strided-copy tests
also run on CUDA tensors where a GPU is present."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from ucm_ray.transport import gather
from ucm_ray.transport.base import Ranges, RepeatedRanges
from ucm_ray.transport.gather import DeviceView, GatherPlan, line_bytes, strip_starts


def test_pool_order_is_the_order_of_a_two_key_lexsort():
    """Ranges are ordered by (part and span, pool row) through one packed sort key; where the
    two do not fit in 63 bits it falls back to ``lexsort``. Ties keep their order either way;
    ranges already in that order (ties included) need none (None)."""
    rng = np.random.default_rng(3)
    for groups, rows in ((4, 1 << 20), (64, 1 << 40), (1 << 40, 1 << 40), (4, 8)):
        group, row = rng.integers(0, groups, 5000), rng.integers(0, rows, 5000)
        assert (gather._pool_order(group, row) == np.lexsort((row, group))).all()
        in_order = np.lexsort((row, group))
        order = gather._pool_order(group[in_order], row[in_order])
        assert order is None or (order == np.arange(5000)).all()
    assert gather._pool_order(np.zeros(5, np.int64), np.asarray([0, 1, 1, 2, 7])) is None
    assert gather._pool_order(np.asarray([0, 0, 1]), np.asarray([5, 6, 0])) is None
    assert gather._pool_order(np.asarray([1, 0]), np.asarray([0, 5])).tolist() == [1, 0]
    assert gather._pool_order(np.zeros(0, np.int64), np.zeros(0, np.int64)) is None


@pytest.mark.parametrize("count", [1, 2])
def test_plans_over_the_same_buffers_share_their_views_and_keep_no_buffer_alive(count):
    """An engine plans over the same KV caches every step, so the spans' views are made once
    (they cost a plan more than a third of its host time); they own nothing, so a cached view
    never keeps an engine's caches alive after it let them go (say a vLLM engine shut down in
    a process that goes on), and a plan over new buffers moves their bytes."""
    pool, _ = _pool(1 << 16, "cpu", fill=True)
    for _ in range(2):
        memory = [np.zeros(3 << 12, dtype=np.uint8) for _ in range(count)]  # weakref-able owners of the bytes
        buffers = tuple(_page_aligned(torch.from_numpy(array)) for array in memory)
        rows = [(0, 0, 4096, 4096), (count - 1, 4096, 0, 4096)]
        plans = [GatherPlan.build(pool, _ranges(buffers, rows), [2]) for _ in range(2)]
        assert plans[0] is not None and plans[1] is not None
        assert plans[0]._spans is plans[1]._spans
        plans[1].move(0, to_pool=False)
        _expect(pool, buffers, rows, to_pool=False)
        alive = [weakref.ref(array) for array in memory]
        del memory, buffers, plans
        gc.collect()
        assert not any(ref() is not None for ref in alive), "a cached view kept a buffer alive"


def test_an_empty_buffer_alone_in_its_span_is_planned():
    """A buffer of no bytes (none of its rows is ever indexed) gets an empty view."""
    pool, _ = _pool(1 << 16, "cpu")
    whole = torch.zeros(1 << 15, dtype=torch.uint8)
    local = whole[(-whole.data_ptr() % 4096) + 64:]  # 64 bytes past a page: a span of its own
    ranges = _ranges((local, torch.empty(0, dtype=torch.uint8)), [(0, 0, 0, 4096)])
    plan = GatherPlan.build(pool, ranges, [1])
    assert plan is not None
    local[:4096] = 7
    plan.move(0, to_pool=True)
    _expect(pool, (local,), [(0, 0, 0, 4096)], to_pool=True)


def test_line_is_the_largest_common_power_of_two():
    assert line_bytes(np.asarray([65536, 131072, 4096 * 3])) == 4096
    assert line_bytes(np.asarray([65536, 131072])) == 65536  # a 64 KiB page: one row per range
    assert line_bytes(np.asarray([64, 65536])) == 64
    assert line_bytes(np.asarray([65536, 12])) == 0  # not 8-byte aligned: copied one by one
    rng = np.random.default_rng(2)
    for count in (3, 5000):  # columns reduced concatenated, and each alone
        columns = [rng.integers(1, 1 << 20, count) << int(rng.integers(0, 24)) for _ in range(3)]
        assert line_bytes(*columns) == line_bytes(np.concatenate(columns))


def _page_aligned(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` from its first 4 KiB-aligned byte, so 4 KiB rows fit its ends."""
    return flat[-flat.data_ptr() % 4096:]


def _ranges(buffers: tuple[torch.Tensor, ...], rows: list[tuple[int, int, int, int]]) -> Ranges:
    """rows: (buffer, local offset, pool offset, size)."""
    return Ranges(buffers, *(np.asarray(column, dtype=np.int64) for column in zip(*rows)))


def _expect(pool: torch.Tensor, buffers: tuple[torch.Tensor, ...], rows, *, to_pool: bool) -> None:
    if pool.is_cuda or buffers[0].is_cuda:
        torch.cuda.synchronize()
    for b, lo, p, n in rows:
        assert torch.equal(pool[p: p + n].cpu(), buffers[b][lo: lo + n].cpu()), (b, lo, p, n, to_pool)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (none present)")])]


def _pool(nbytes: int, device: str, fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool as the plan takes it: (what kernels address, the host memory DMA copies use). On
    CUDA, page-locked host memory and its mapped view, as a shard's pool."""
    host = torch.randint(1, 256, (nbytes,), dtype=torch.uint8) if fill else torch.zeros(nbytes, dtype=torch.uint8)
    if device == "cpu":
        host = _page_aligned(host)
        return host, host
    host = _page_aligned(host.pin_memory())
    return DeviceView(host.data_ptr(), host.numel(), torch.device("cuda")).tensor, host


@pytest.mark.parametrize("run_bytes", [64 << 20, 8192])
def test_parts_move_both_ways_exactly_and_nothing_else(run_bytes):
    """Three parts, as a step's layers: one buffer each, then a part whose ranges alternate
    between two buffers (grouped per buffer), then an empty part. A small ``run_bytes`` splits
    the parts into several kernel pairs; the bytes are the same."""
    buffers = tuple(_page_aligned(torch.randint(1, 256, (1 << 18,), dtype=torch.uint8)) for _ in range(2))
    rows = [(0, 4096, 8192, 8192), (0, 40960, 65536, 4096),            # part 0: buffer 0
            (1, 0, 131072, 16384), (1, 65536, 200704, 4096),           # part 1: buffer 1
            (0, 131072, 262144, 4096), (1, 131072, 270336, 8192), (0, 200704, 290816, 4096)]  # part 2: mixed
    ends = [2, 4, 7, 7]
    pool = _page_aligned(torch.zeros(1 << 20, dtype=torch.uint8))
    plan = GatherPlan.build(pool, _ranges(buffers, rows), ends, run_bytes=run_bytes)
    assert plan is not None
    for part in range(len(ends)):
        plan.move(part, to_pool=True)
    _expect(pool, buffers, rows, to_pool=True)
    assert int(pool.count_nonzero()) == sum(n for *_, n in rows)  # no other byte written
    back = tuple(_page_aligned(torch.zeros(1 << 18, dtype=torch.uint8)) for _ in range(2))
    plan = GatherPlan.build(pool, _ranges(back, rows), ends, run_bytes=run_bytes)
    assert plan is not None
    plan.move(1, to_pool=False)  # one part: only its ranges land
    assert int(back[0].count_nonzero()) == 0
    assert int(back[1].count_nonzero()) == 16384 + 4096
    for part in (0, 2):
        plan.move(part, to_pool=False)
    _expect(pool, back, rows, to_pool=False)
    assert sum(int(b.count_nonzero()) for b in back) == sum(n for *_, n in rows)


def test_misaligned_ranges_or_buffers_get_no_plan():
    pool, local = (_page_aligned(torch.zeros(1 << 17, dtype=torch.uint8)) for _ in range(2))
    assert GatherPlan.build(pool, _ranges((local,), [(0, 0, 3, 4096)]), [1]) is None
    assert GatherPlan.build(pool[1:], _ranges((local,), [(0, 0, 8, 4096)]), [1]) is None  # pool start
    assert GatherPlan.build(pool, _ranges((local[4:],), [(0, 0, 8, 4096)]), [1]) is None  # buffer start
    assert GatherPlan.build(pool[8:], _ranges((local[8:],), [(0, 0, 8, 4096)]), [1]) is not None
    assert GatherPlan.build(pool, _ranges((local,), [(0, 0, 8, 4096)]), [1], host_pool=pool[4:]) is None


def test_parts_that_leave_ranges_out_are_refused():
    pool, local = (_page_aligned(torch.zeros(1 << 17, dtype=torch.uint8)) for _ in range(2))
    ranges = _ranges((local,), [(0, 0, 0, 4096), (0, 4096, 8192, 4096)])
    for ends in ([1], [], [1, 3]):
        with pytest.raises(ValueError, match="must end at the last of the 2 ranges"):
            GatherPlan.build(pool, ranges, ends)


SEGMENT = 64 << 10
LAYERS = 3


def _entry_rows(slots: list[int], blocks: list[int]) -> list[tuple[int, int, int, int]]:
    """A step's copies as the worker plans them: per layer (buffer), each block's segment, its
    entry in slot ``slots[i]`` holding every layer in order (entries side by side when their
    slots are)."""
    return [(layer, block * SEGMENT, slot * LAYERS * SEGMENT + layer * SEGMENT, SEGMENT)
            for layer in range(LAYERS) for slot, block in zip(slots, blocks)]


def _layer_buffers(fill: bool, blocks: int = 16, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """One buffer per layer, carved from one allocation as vLLM's per-layer caches may lie: at
    addresses a whole number of rows apart, so the plan addresses them as one span."""
    size = blocks * SEGMENT
    whole = _page_aligned((torch.randint(1, 256, (LAYERS * size + 8192,), dtype=torch.uint8) if fill
                           else torch.zeros(LAYERS * size + 8192, dtype=torch.uint8)).to(device))
    return tuple(whole[layer * size: (layer + 1) * size] for layer in range(LAYERS))


def _cut_into_batches(run_bytes: int, monkeypatch) -> None:
    """Below 1 MiB staging batches, a copy of a stretch cut by them carries less than the
    default bar for DMA: lower it with them, so that such parts still take that path."""
    if run_bytes < 2 * gather.DMA_COPY_BYTES:
        monkeypatch.setattr(gather, "DMA_COPY_BYTES", run_bytes // 3)


@pytest.mark.parametrize("run_bytes", [64 << 20, 3 * SEGMENT])
def test_every_layer_of_adjacent_entries_goes_by_dma_and_moves_exactly(run_bytes, monkeypatch):
    """A save's part (every layer of entries in slots 0-5 and 9-14: two stretches of the pool,
    ~1.1 MiB each) is staged and copied stretch by stretch; small ``run_bytes`` cuts stretches
    across staging batches. A part of one layer (ranges an entry apart, 384 KiB a copy) stays
    on the kernels unless the bar is lowered. Whatever the path, the bytes land where they
    belong and nowhere else, both ways."""
    _cut_into_batches(run_bytes, monkeypatch)
    slots, blocks = [*range(6), *range(9, 15)], [5, 1, 12, 7, 0, 3, 9, 15, 2, 11, 4, 8]
    rows = _entry_rows(slots, blocks)
    buffers = _layer_buffers(fill=True)
    pool = _page_aligned(torch.zeros(1 << 22, dtype=torch.uint8))
    plan = GatherPlan.build(pool, _ranges(buffers, rows), [len(rows)], run_bytes=run_bytes, host_pool=pool)
    assert plan is not None and plan.staged(0)
    plan.move(0, to_pool=True)
    _expect(pool, buffers, rows, to_pool=True)
    assert int(pool.count_nonzero()) == sum(n for *_, n in rows)
    back = _layer_buffers(fill=False)
    per_layer = [len(slots) * (layer + 1) for layer in range(LAYERS)]
    layered = GatherPlan.build(pool, _ranges(back, rows), per_layer, run_bytes=run_bytes, host_pool=pool)
    assert layered is not None and any(layered.staged(part) for part in range(LAYERS)) == (run_bytes < 1 << 20)
    layered.move(1, to_pool=False)
    _expect(pool, back, [row for row in rows if row[0] == 1], to_pool=False)
    assert sum(int(b.count_nonzero()) for b in back) == len(slots) * SEGMENT  # that layer only
    back = _layer_buffers(fill=False)
    plan = GatherPlan.build(pool, _ranges(back, rows), [len(rows)], run_bytes=run_bytes, host_pool=pool)
    assert plan is not None and plan.staged(0)
    plan.move(0, to_pool=False)
    _expect(pool, back, rows, to_pool=False)
    assert sum(int(b.count_nonzero()) for b in back) == sum(n for *_, n in rows)


def test_scattered_entries_stay_on_the_kernels():
    """Entries at irregular gaps: each stretch is one entry (192 KiB) and no two gaps agree, so
    every copy would carry one entry, too little for a copy of its own to pay."""
    slots = [0, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77]
    rows = _entry_rows(slots, list(range(len(slots))))
    pool = _page_aligned(torch.zeros(1 << 24, dtype=torch.uint8))
    plan = GatherPlan.build(pool, _ranges(_layer_buffers(fill=True), rows), [len(rows)], host_pool=pool)
    assert plan is not None and not plan.staged(0)


A = 6  # a pitch, in rows


@pytest.mark.parametrize(("starts", "widths", "strips"), [
    ([0, 6, 12, 18], [2, 2, 2, 2], [0]),                            # one strided copy
    ([0, 6, 12, 18, 40, 46, 52], [2] * 7, [0, 4]),                  # one odd gap between two runs
    ([0, 6, 12, 20, 28], [2] * 5, [0, 3]),                          # two pitches: each run its own
    ([0, 6, 12, 18], [2, 2, 3, 3], [0, 2]),                         # widths differ
    ([0, 0, 6, 6], [2] * 4, [0, 1, 3]),                             # the same rows twice: never in one copy
    ([0, 1, 2], [2] * 3, [0, 1, 2]),                                # rows overlap: no copy reads them twice
])
def test_strips_are_runs_of_one_width_at_one_pitch(starts, widths, strips):
    line = 4096
    got = strip_starts(np.asarray(starts), np.asarray(widths), line)
    assert got.tolist() == strips


def test_the_one_strip_shortcut_agrees_with_the_general_rule(monkeypatch):
    """Stretches of one width at one pitch (a load's layer of entries in adjacent slots) are one
    strip without the general rule's ~20 numpy calls; wherever the shortcut answers, and wherever
    it does not, the strips are what the general rule makes (random stretches, ``apart`` or not)."""
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(400):
        count = int(rng.integers(2, 12))
        width = int(rng.integers(1, 4))
        pitch = int(rng.choice([width, width + 1, 4 * width, 1 << 18]))
        starts = pitch * np.arange(count, dtype=np.int64)
        widths = np.full(count, width, dtype=np.int64)
        if rng.random() < 0.5:  # break the uniformity somewhere
            at = int(rng.integers(0, count))
            widths[at] += int(rng.integers(0, 2))
            starts[at:] += int(rng.integers(0, 3))
        apart = rng.random(count - 1) < 0.1 if rng.random() < 0.3 else None
        line = int(rng.choice([1024, 4096, 8192]))
        cases.append((starts, widths, line, apart))
    fast = [strip_starts(*case).tolist() for case in cases]
    monkeypatch.setattr(gather, "_one_strip", lambda *_: False)
    assert fast == [strip_starts(*case).tolist() for case in cases]
    assert sum(got == [0] for got in fast) > 50  # the shortcut was taken often


def _plan_shape(plan: GatherPlan) -> list[tuple]:
    """What a plan moves, step by step: its kind, span, local rows, pool rows or staging rows and
    copies (staging addresses from the staging's start), and the pool view it keeps."""
    out: list[tuple] = [(plan.indexed_rows, plan._pool is None)]
    for part in plan._parts:
        for step in part:
            if isinstance(step, gather._Staged):
                base = step.staging.data_ptr()
                out.append(("staged", step.span, step.local_rows.tolist(), tuple(step.staging.shape),
                            [(at - base, *rest) for at, *rest in step.copies]))
            else:
                out.append(("kernels", step.span, step.local_rows.tolist(), step.pool_rows.tolist()))
    return out


def test_the_one_stretch_shortcut_plans_what_the_general_planning_does(monkeypatch):
    """A part over one span whose ranges lie side by side in the pool, in pool order (a save of
    entries in adjacent slots: a decode step's few blocks, a prompt's many) is staging batches
    of one copy each, planned without the general planning's ~40 numpy calls and passes over
    every row; wherever the shortcut answers (one batch or several), and wherever it does not
    (gaps, another order, too few rows a copy, several parts or spans), the plan is the general
    planning's, and it moves the same bytes."""
    monkeypatch.setattr(gather, "DMA_COPY_BYTES", 3 * 4096)
    rng = np.random.default_rng(5)
    buffers = _layer_buffers(fill=True)
    odd = _page_aligned(torch.randint(1, 256, (1 << 20,), dtype=torch.uint8))[64:]  # a span of its own
    pool = _page_aligned(torch.zeros(1 << 20, dtype=torch.uint8))
    cases = []
    for _ in range(300):
        count = int(rng.integers(1, 24 if rng.random() < 0.7 else 48))
        sizes = 4096 * rng.integers(1, 3 if rng.random() < 0.5 else 2, count)
        pool_at = int(rng.integers(0, 64)) * 4096 + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        if rng.random() < 0.2:  # a gap somewhere
            pool_at[int(rng.integers(0, count)):] += 4096
        if rng.random() < 0.2:  # not in pool order
            order = rng.permutation(count)
            sizes, pool_at = sizes[order], pool_at[order]
        buffer = rng.integers(0, LAYERS, count)
        local = 4096 * rng.integers(0, 16 * SEGMENT // 4096 - 2, count)
        rows = list(zip(buffer.tolist(), local.tolist(), pool_at.tolist(), sizes.tolist()))
        mixed = rng.random() < 0.1  # a range in a buffer of another span
        if mixed:
            rows[0] = (LAYERS, 0, rows[0][2], rows[0][3])
        ends = [len(rows)] if rng.random() < 0.8 else [len(rows) // 2, len(rows)]
        run_bytes = int(rng.choice([64 << 20, 8 * 4096, 8 * 4096, 2 * 4096]))  # 2 rows: too few a copy
        cases.append((_ranges((*buffers, odd) if mixed else buffers, rows), ends, run_bytes))

    taken = []
    shortcut = GatherPlan._stage_one_stretch
    monkeypatch.setattr(GatherPlan, "_stage_one_stretch",  # (self, pool, local rows, pool row, rows a batch)
                        lambda *args: taken.append(len(args[2]) > args[4]) or shortcut(*args))

    def planned() -> list[tuple[list[tuple], torch.Tensor]]:
        out = []
        for ranges, ends, run_bytes in cases:
            plan = GatherPlan(pool, ranges, ends, 4096, run_bytes, host_pool=pool)
            pool.zero_()
            for part in range(len(ends)):
                plan.move(part, to_pool=True)
            out.append((_plan_shape(plan), pool.clone()))
        return out

    fast = planned()
    monkeypatch.setattr(gather, "_one_stretch", lambda *_: False)
    assert [shape for shape, _ in fast] == [shape for shape, _ in planned()]
    assert 50 < len(taken) < len(cases) - 50  # the shortcut answered often, and declined often
    assert sum(taken) > 30  # often one stretch in several staging batches, as the general planning cuts it
    for (_, moved), (ranges, _, _) in zip(fast, cases):
        rows = list(zip(*(column.tolist() for column in (ranges.buffer_index, ranges.local_offsets,
                                                           ranges.pool_offsets, ranges.sizes))))
        if len(set(p for _, _, p, _ in rows)) == len(rows):  # no two ranges write one pool row
            pool.copy_(moved)
            _expect(pool, ranges.buffers, rows, to_pool=True)


def test_strips_respect_the_pitch_limit_and_narrow_rows():
    starts, widths = np.asarray([0, 1 << 18, 2 << 18]), np.asarray([1, 1, 1])
    assert strip_starts(starts, widths, 4096).tolist() == [0]  # 1 GiB apart
    assert strip_starts(starts, widths, 8192).tolist() == [0, 1, 2]  # 2 GiB apart: past MAX_PITCH
    assert strip_starts(np.asarray([0, 4, 8]), widths, 1024).tolist() == [0, 1, 2]  # 1 KiB rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run_bytes", [64 << 20, 5 * SEGMENT])
def test_one_layer_of_entries_an_entry_apart_goes_by_strided_copies(run_bytes, device, monkeypatch):
    """One layer's ranges of entries in slots 0-19 and 25-44 lie an entry apart: two strided
    copies of 1.25 MiB each (a small ``run_bytes`` cuts them across staging batches). Each
    layer's part lands exactly its own bytes, both ways; every other slot is one strip too."""
    _cut_into_batches(run_bytes, monkeypatch)
    slots = [*range(20), *range(25, 45)]
    blocks = list(np.random.default_rng(5).permutation(48)[:len(slots)])
    rows = _entry_rows(slots, blocks)
    buffers = _layer_buffers(fill=True, blocks=48, device=device)
    mapped, pool = _pool(1 << 24, device)
    per_layer = [len(slots) * (layer + 1) for layer in range(LAYERS)]
    plan = GatherPlan.build(mapped, _ranges(buffers, rows), per_layer, run_bytes=run_bytes, host_pool=pool)
    assert plan is not None and all(plan.staged(part) for part in range(LAYERS))
    for part in range(LAYERS):
        plan.move(part, to_pool=True)
    _expect(pool, buffers, rows, to_pool=True)
    assert int(pool.count_nonzero()) == sum(n for *_, n in rows)
    back = _layer_buffers(fill=False, blocks=48, device=device)
    plan = GatherPlan.build(mapped, _ranges(back, rows), per_layer, run_bytes=run_bytes, host_pool=pool)
    assert plan is not None
    plan.move(1, to_pool=False)
    _expect(pool, back, [row for row in rows if row[0] == 1], to_pool=False)
    assert sum(int(b.count_nonzero()) for b in back) == len(slots) * SEGMENT  # that layer only
    for part in (0, 2):
        plan.move(part, to_pool=False)
    _expect(pool, back, rows, to_pool=False)
    every_other = _entry_rows(list(range(0, 80, 2)), blocks)
    plan = GatherPlan.build(mapped, _ranges(back, every_other), per_layer, run_bytes=run_bytes, host_pool=pool)
    assert plan is not None and all(plan.staged(part) for part in range(LAYERS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(8))
def test_random_steps_move_exactly_whatever_the_path(seed, device, monkeypatch):
    """Random slots (runs, gaps, a slot loaded into two blocks), parts per layer or all at
    once, small staging batches, a low bar for DMA (so that parts take either path): loads
    and saves land the reference's bytes. Every fourth step lists its ranges in pool order, as
    the worker does for a part of every layer: planned without a sort."""
    monkeypatch.setattr(gather, "DMA_COPY_BYTES", SEGMENT * (1 + seed % 3))
    rng = np.random.default_rng(seed)
    count = int(rng.integers(8, 40))
    slots = np.cumsum(rng.choice([0, 1, 1, 1, 2, 5], size=count)).tolist()
    blocks = rng.permutation(48)[:count].tolist()
    in_pool_order = seed % 4 == 0  # one part (``ends`` below)

    def listed(rows: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        return sorted(rows, key=lambda row: row[2]) if in_pool_order else rows

    rows = listed(_entry_rows(slots, blocks))
    if in_pool_order:
        assert gather._pool_order(None, np.asarray([row[2] for row in rows]) // SEGMENT) is None
    ends = [count * (layer + 1) for layer in range(LAYERS)] if seed % 2 else [len(rows)]
    run_bytes = int(rng.choice([3 * SEGMENT, 64 << 20]))
    mapped, pool = _pool(1 << 26, device, fill=True)
    back = _layer_buffers(fill=False, blocks=48, device=device)
    plan = GatherPlan.build(mapped, _ranges(back, rows), ends, run_bytes=run_bytes, host_pool=pool)
    assert plan is not None
    for part in range(len(ends)):
        plan.move(part, to_pool=False)
    _expect(pool, back, rows, to_pool=False)  # a slot loaded twice lands in both blocks
    distinct = {slot: block for slot, block in zip(slots, blocks)}  # a save writes each slot once
    saves = listed(_entry_rows(list(distinct), list(distinct.values())))
    fresh_mapped, fresh = _pool(1 << 26, device)
    save_ends = [len(saves)] if len(ends) == 1 else [len(distinct) * (layer + 1) for layer in range(LAYERS)]
    plan = GatherPlan.build(fresh_mapped, _ranges(back, saves), save_ends, run_bytes=run_bytes, host_pool=fresh)
    assert plan is not None
    for part in range(len(save_ends)):
        plan.move(part, to_pool=True)
    _expect(fresh, back, saves, to_pool=True)  # synchronizes
    assert int(fresh.count_nonzero()) == sum(n for *_, n in saves)  # loaded bytes are never 0


def _repeated(buffers: tuple[torch.Tensor, ...], slots: list[int], blocks: list[int]) -> RepeatedRanges:
    """``_entry_rows(slots, blocks)`` as the worker hands a load posted layer by layer: layer 0's
    ranges, and each layer's buffer and its place in an entry."""
    return RepeatedRanges(_ranges(buffers, _entry_rows(slots, blocks)[:len(slots)]),
                          np.arange(LAYERS, dtype=np.int64), np.zeros(LAYERS, dtype=np.int64),
                          SEGMENT * np.arange(LAYERS, dtype=np.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_layer_by_layer_is_planned_once_for_every_layer_and_lands_exactly(device, monkeypatch):
    """A load posted layer by layer: every layer holds the same blocks and every entry holds the
    layer at the same place, so the worker hands one layer's ranges and each layer's shifts.
    The plan indexes one layer's rows (not every layer's), and each part lands exactly its own
    bytes, both ways, by kernels and by staged DMA; a second step over the same buffers with
    other blocks (the layers' views reused) lands its own blocks, not the first step's."""
    slots = [*range(20), *range(25, 45)]
    blocks = list(np.random.default_rng(7).permutation(48)[:len(slots)])
    rows = _entry_rows(slots, blocks)
    for dma_bytes in (gather.DMA_COPY_BYTES, 1 << 40):  # staged DMA, then kernels only
        monkeypatch.setattr(gather, "DMA_COPY_BYTES", dma_bytes)
        mapped, pool = _pool(1 << 24, device, fill=True)
        back = _layer_buffers(fill=False, blocks=48, device=device)
        plan = GatherPlan.build_repeated(mapped, _repeated(back, slots, blocks), host_pool=pool)
        assert plan is not None and plan.indexed_rows == len(slots)
        assert all(plan.staged(part) == (dma_bytes < 1 << 40) for part in range(LAYERS))
        assert (plan._pool is None) == (dma_bytes < 1 << 40), "pool rows made only for the kernels"
        plan.move(2, to_pool=False)  # one layer: only its ranges land
        _expect(pool, back, [row for row in rows if row[0] == 2], to_pool=False)
        assert sum(int(b.count_nonzero()) for b in back) == len(slots) * SEGMENT
        for part in (0, 1):
            plan.move(part, to_pool=False)
        _expect(pool, back, rows, to_pool=False)
        other = [int(b) for b in np.random.default_rng(8).permutation(48)[:len(slots)]]  # the next step's blocks
        again = GatherPlan.build_repeated(mapped, _repeated(back, slots, other), host_pool=pool)
        assert again is not None
        for buffer in back:
            buffer.zero_()
        for part in range(LAYERS):
            again.move(part, to_pool=False)
        _expect(pool, back, _entry_rows(slots, other), to_pool=False)
        assert sum(int(b.count_nonzero()) for b in back) == len(rows) * SEGMENT
        fresh_mapped, fresh = _pool(1 << 24, device)
        plan = GatherPlan.build_repeated(fresh_mapped, _repeated(back, slots, other), host_pool=fresh)
        assert plan is not None and plan.indexed_rows == len(slots)
        for part in range(LAYERS):
            plan.move(part, to_pool=True)
        _expect(fresh, back, _entry_rows(slots, other), to_pool=True)
        assert int(fresh.count_nonzero()) == sum(n for *_, n in rows)


def test_repeated_ranges_expand_and_check_as_every_part_s_ranges():
    """``expand`` lists every part's ranges part after part, and ``check`` refuses a part that
    a shift moves outside its buffer or the pool, naming it, as ``Ranges.check`` would."""
    buffers = _layer_buffers(fill=False)
    repeated = _repeated(buffers, [0, 1, 4], [3, 0, 9])
    expanded = repeated.expand()
    assert list(zip(*(column.tolist() for column in (expanded.buffer_index, expanded.local_offsets,
                                                      expanded.pool_offsets, expanded.sizes)))) == \
        _entry_rows([0, 1, 4], [3, 0, 9])
    assert repeated.ends() == [3, 6, 9] and len(repeated) == 9
    repeated.check(5 * LAYERS * SEGMENT, "the pool")
    with pytest.raises(ValueError, match="part 2: .* outside the pool"):
        repeated.check(5 * LAYERS * SEGMENT - 1, "the pool")
    moved = RepeatedRanges(repeated.template, repeated.buffer_index, np.asarray([0, 0, 7 * SEGMENT]),
                           repeated.pool_shifts)
    with pytest.raises(ValueError, match="part 2: .* outside the pool or its buffer"):
        moved.check(1 << 30, "the pool")


def test_repeated_ranges_in_more_than_one_buffer_or_of_negative_size_are_refused():
    buffers = _layer_buffers(fill=False)
    repeated = _repeated(buffers, [0, 1], [3, 0])
    t = repeated.template
    two = RepeatedRanges(Ranges(t.buffers, np.asarray([0, 1]), t.local_offsets, t.pool_offsets, t.sizes),
                         repeated.buffer_index, repeated.local_shifts, repeated.pool_shifts)
    with pytest.raises(ValueError, match="more than one buffer"):
        two.check(1 << 30, "the pool")
    negative = RepeatedRanges(Ranges(t.buffers, t.buffer_index, t.local_offsets, t.pool_offsets, -t.sizes),
                              repeated.buffer_index, repeated.local_shifts, repeated.pool_shifts)
    with pytest.raises(ValueError, match="size is negative"):
        negative.check(1 << 30, "the pool")


def test_the_range_check_from_extremes_passes_and_refuses_what_the_check_of_every_range_does(monkeypatch):
    """``Ranges.check`` passes ranges inside the pool and their buffers from each column's
    extremes (``_inside``: a few reductions); wherever that decides nothing, every range is
    checked. Over random ranges (inside, or one range past the pool, past its buffer, negative,
    in no buffer; buffers of equal or unequal sizes, ranges of one size or not), it passes and refuses (naming the same
    range) exactly what checking every range does."""
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(400):
        buffers = tuple(torch.zeros(int(n), dtype=torch.uint8) for n in
                        (rng.integers(1, 4) * [4096] if rng.random() < 0.5 else rng.integers(1024, 8192, 3)))
        count = int(rng.integers(1, 20))
        sizes = rng.integers(0, 1024, count) if rng.random() < 0.5 else np.full(count, 512)  # segments alike
        index = rng.integers(0, len(buffers), count)
        local = np.asarray([int(rng.integers(0, buffers[b].numel() - s + 1)) for b, s in zip(index, sizes)])
        pool = rng.integers(0, 65536 - sizes + 1)
        columns = [index, local, pool, sizes]
        if rng.random() < 0.5:  # one range broken somehow
            at, column = int(rng.integers(0, count)), int(rng.integers(0, 4))
            columns[column] = columns[column].copy()
            columns[column][at] = [len(buffers), buffers[index[at]].numel(), 65536, -1][column] + \
                int(rng.integers(0, 3)) * (-1 if column == 3 else 1)
        cases.append(Ranges(buffers, *(np.asarray(c, dtype=np.int64) for c in columns)))

    def outcomes() -> list[str]:
        out = []
        for ranges in cases:
            try:
                ranges.check(65536, "the pool")
                out.append("passed")
            except ValueError as e:
                out.append(str(e))
        return out

    fast = outcomes()
    inside = [Ranges._inside(ranges, 65536, np.asarray([b.numel() for b in ranges.buffers])) for ranges in cases]
    monkeypatch.setattr(Ranges, "_inside", lambda *_: False)
    assert fast == outcomes()
    assert 60 < sum(inside) and 30 < fast.count("passed") - sum(inside)  # it decided often, and left some
    assert 100 < len(fast) - fast.count("passed")


NEAR_INT64 = (1 << 63) - 4096
"""An offset or shift whose sum with a range's size wraps around int64 (to a negative number)."""


@pytest.mark.parametrize("column", ["pool_offsets", "local_offsets"])
def test_a_range_whose_end_wraps_around_int64_is_refused(column):
    """A range at an offset near int64's limit ends past the pool or its buffer, though the sum
    of its offset and size, in int64, wraps to a negative number: the check refuses it, naming
    it (it passed, and a plan would have copied past the pool or the buffer)."""
    buffers = (torch.zeros(1 << 16, dtype=torch.uint8),)
    rows = {"buffer_index": [0, 0], "local_offsets": [0, 4096], "pool_offsets": [0, 4096], "sizes": [4096, 8192]}
    rows[column][1] = NEAR_INT64
    ranges = Ranges(buffers, *(np.asarray(rows[f], dtype=np.int64)
                               for f in ("buffer_index", "local_offsets", "pool_offsets", "sizes")))
    with pytest.raises(ValueError, match="copy 1: .* outside the pool or its buffer"):
        ranges.check(1 << 20, "the pool")


@pytest.mark.parametrize("case", ["pool shift", "local shift", "negative shift", "template offset"])
def test_repeated_ranges_whose_parts_wrap_around_int64_are_refused(case):
    """As ``Ranges.check``: a part shifted (or a template range placed) so far that its end, in
    int64, wraps to a negative number lies past the pool or its buffer, and is refused."""
    buffers = (torch.zeros(1 << 16, dtype=torch.uint8),)
    offsets = [0, 4096]
    if case == "template offset":
        offsets[1] = NEAR_INT64
    template = Ranges(buffers, np.zeros(2, np.int64), np.asarray(offsets, np.int64), np.asarray(offsets, np.int64),
                      np.full(2, 8192, np.int64))
    shifts = {"pool shift": ([0, 0], [0, NEAR_INT64]), "local shift": ([0, NEAR_INT64], [0, 0]),
              "negative shift": ([0, 0], [0, -(1 << 63) + 1]), "template offset": ([0, 0], [0, 0])}[case]
    repeated = RepeatedRanges(template, np.zeros(2, np.int64), *(np.asarray(s, np.int64) for s in shifts))
    with pytest.raises(ValueError):
        repeated.check(1 << 20, "the pool")
