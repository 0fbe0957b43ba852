"""The disk tier's read-cost fit: a fixed part per chunk plus a part per byte."""

from __future__ import annotations

import pytest

from ucm_ray.store.shard.disk.read_cost import ReadCost


def test_two_sizes_give_the_fixed_part_and_the_rate():
    cost = ReadCost(0.3)
    for _ in range(4):
        cost.add(8 << 10, 0.020 + (8 << 10) / 1e9)  # 20 ms a chunk, 1 GB/s
        cost.add(2 << 20, 0.020 + (2 << 20) / 1e9)
    fixed, per_byte = cost.fit()
    assert fixed == pytest.approx(0.020, rel=1e-6) and per_byte == pytest.approx(1e-9, rel=1e-6)
    assert cost.seconds(1 << 20) == pytest.approx(0.020 + (1 << 20) / 1e9, rel=1e-6)


def test_one_size_is_bytes_per_second_and_nothing_measured_costs_nothing():
    cost = ReadCost(0.3)
    assert cost.fit() == (0.0, 0.0)
    cost.add(0, 1.0)  # nothing read: ignored
    cost.add(1 << 20, 0.0)  # no time: ignored
    assert cost.samples == 0
    cost.add(1 << 20, 0.002)
    cost.add(1 << 20, 0.002)
    assert cost.fit() == (0.0, pytest.approx(0.002 / (1 << 20)))


def test_larger_chunks_no_slower_is_a_fixed_cost_and_never_a_negative_one():
    flat = ReadCost(0.5)
    flat.add(8 << 10, 0.030)
    flat.add(1 << 20, 0.020)
    assert flat.fit() == (pytest.approx(0.025), 0.0)
    steep = ReadCost(0.5)  # the line would cross below zero: the best one through zero instead
    steep.add(1 << 20, 0.001)
    steep.add(2 << 20, 0.010)
    fixed, per_byte = steep.fit()
    assert fixed == 0.0 and per_byte > 0
