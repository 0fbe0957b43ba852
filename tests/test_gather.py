"""The gather plan the CUDA shm path uses, checked with CPU tensors (the same code: only the
index upload and the stream differ on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_ray.transport.base import Ranges
from ucm_ray.transport.gather import GatherPlan, line_bytes


def test_line_is_the_largest_common_power_of_two():
    assert line_bytes(np.asarray([65536, 131072, 4096 * 3])) == 4096
    assert line_bytes(np.asarray([65536, 131072])) == 65536  # a 64 KiB page: one row per range
    assert line_bytes(np.asarray([64, 65536])) == 64
    assert line_bytes(np.asarray([65536, 12])) == 0  # not 8-byte aligned: copied one by one


def _page_aligned(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` from its first 4 KiB-aligned byte, so 4 KiB rows fit its ends."""
    return flat[-flat.data_ptr() % 4096:]


def _ranges(buffers: tuple[torch.Tensor, ...], rows: list[tuple[int, int, int, int]]) -> Ranges:
    """rows: (buffer, local offset, pool offset, size)."""
    return Ranges(buffers, *(np.asarray(column, dtype=np.int64) for column in zip(*rows)))


def _expect(pool: torch.Tensor, buffers: tuple[torch.Tensor, ...], rows, *, to_pool: bool) -> None:
    for b, lo, p, n in rows:
        assert torch.equal(pool[p: p + n], buffers[b][lo: lo + n]), (b, lo, p, n, to_pool)


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


def _layer_buffers(fill: bool) -> tuple[torch.Tensor, ...]:
    """One buffer per layer, carved from one allocation as vLLM's per-layer caches may lie: at
    addresses a whole number of rows apart, so the plan addresses them as one span."""
    size = 16 * SEGMENT
    whole = _page_aligned(torch.randint(1, 256, (LAYERS * size + 8192,), dtype=torch.uint8) if fill
                          else torch.zeros(LAYERS * size + 8192, dtype=torch.uint8))
    return tuple(whole[layer * size: (layer + 1) * size] for layer in range(LAYERS))


@pytest.mark.parametrize("run_bytes", [64 << 20, 3 * SEGMENT])
def test_every_layer_of_adjacent_entries_goes_by_dma_and_moves_exactly(run_bytes):
    """A save's part (every layer of entries in slots 0-5 and 9-14: two stretches of the pool,
    ~1.1 MiB each) is staged and copied stretch by stretch; small ``run_bytes`` cuts stretches
    across staging batches. A part of one layer (ranges an entry apart) stays on the kernels.
    Whatever the path, the bytes land where they belong and nowhere else, both ways."""
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
    assert layered is not None and not any(layered.staged(part) for part in range(LAYERS))
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
    """Entries an empty slot apart: each stretch is one entry (192 KiB), too short for a copy
    of its own to pay."""
    slots = list(range(0, 24, 2))
    rows = _entry_rows(slots, list(range(len(slots))))
    pool = _page_aligned(torch.zeros(1 << 23, dtype=torch.uint8))
    plan = GatherPlan.build(pool, _ranges(_layer_buffers(fill=True), rows), [len(rows)], host_pool=pool)
    assert plan is not None and not plan.staged(0)
