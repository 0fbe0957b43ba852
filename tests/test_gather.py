"""The batched range copy the CUDA shm path uses, checked with CPU tensors (same code)."""

from __future__ import annotations

import numpy as np
import torch

from ucm_ray.transport.gather import RowPlans, copy_ranges, line_bytes


def test_line_is_the_largest_common_power_of_two():
    assert line_bytes(np.asarray([65536, 131072, 4096 * 3])) == 4096
    assert line_bytes(np.asarray([64, 65536])) == 64
    assert line_bytes(np.asarray([65536, 12])) == 0  # not 8-byte aligned: copied one by one


def test_ranges_move_both_ways_and_nothing_else():
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    local = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8)
    spans = [(0, 4096, 8192), (65536, 40960, 4096), (200000 - 200000 % 64, 128, 65536)]  # pool, local, size
    pool_at, local_at, sizes = (np.asarray(column, dtype=np.int64) for column in zip(*spans))
    assert copy_ranges(pool, local, pool_at, local_at, sizes, to_pool=True)
    for p, lo, n in spans:
        assert torch.equal(pool[p: p + n], local[lo: lo + n])
    assert int(pool.count_nonzero()) == int(sum((local[lo: lo + n] != 0).sum() for _, lo, n in spans))
    back = torch.zeros_like(local)
    assert copy_ranges(pool, back, pool_at, local_at, sizes, to_pool=False)
    for _, lo, n in spans:
        assert torch.equal(back[lo: lo + n], local[lo: lo + n])
    outside = torch.ones(len(back), dtype=torch.bool)
    for _, lo, n in spans:
        outside[lo: lo + n] = False
    assert int(back[outside].count_nonzero()) == 0


def test_misaligned_ranges_are_refused():
    pool, local = (_page_aligned(torch.zeros(1 << 17, dtype=torch.uint8)) for _ in range(2))
    assert not copy_ranges(pool, local, *(np.asarray([v]) for v in (3, 0, 4096)), to_pool=False)
    assert not local.any()


def test_a_plan_serves_the_same_ranges_shifted_in_the_pool_and_only_where_its_rows_fit():
    """A step's layers move the same blocks to the same entries, each shifted by its place in an
    entry: one plan (one upload) serves them all; a shift its rows do not divide gets a new one."""
    plans = RowPlans()
    pool = _page_aligned(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    pool_at, local_at, sizes = (np.asarray(v, dtype=np.int64) for v in ([8192, 0], [4096, 16384], [4096, 8192]))
    for shift in (0, 65536, 131072, 65536 + 64):
        local = _page_aligned(torch.zeros(1 << 17, dtype=torch.uint8))
        assert copy_ranges(pool, local, pool_at + shift, local_at, sizes, to_pool=False, plans=plans)
        for p, lo, n in zip(pool_at + shift, local_at, sizes):
            assert torch.equal(local[lo: lo + n], pool[p: p + n]), shift
        assert int(local.count_nonzero()) == int(sum((pool[p: p + n] != 0).sum() for p, n in
                                                     zip(pool_at + shift, sizes)))
    built = []
    counting = RowPlans()
    original = counting.get

    def get(key, aligned, build):
        return original(key, aligned, lambda: built.append(1) or build())

    counting.get = get
    for shift in (0, 65536, 131072):  # three layers: one plan
        copy_ranges(pool, _page_aligned(torch.zeros(1 << 17, dtype=torch.uint8)), pool_at + shift, local_at, sizes,
                    to_pool=False, plans=counting)
    assert len(built) == 1
    # 4 KiB rows do not fit a 64-byte shift: rebuilt with 64-byte rows
    copy_ranges(pool, _page_aligned(torch.zeros(1 << 17, dtype=torch.uint8)), pool_at + 64, local_at, sizes,
                to_pool=False, plans=counting)
    assert len(built) == 2


def _page_aligned(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` from its first 4 KiB-aligned byte, so 4 KiB rows fit its ends."""
    return flat[-flat.data_ptr() % 4096:]
