"""Entry checksums (``ucm_ray.store.checksum``): a writer sums an entry segment by segment (layers,
K/V halves) and a reader sums it whole, or cut otherwise: the value must not depend on the cut."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_ray.store.checksum import Checksum, checksum
from ucm_ray.store.types import NO_CHECKSUM


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), cuts=st.lists(st.integers(min_value=0, max_value=4096), max_size=8))
def test_the_sum_does_not_depend_on_how_the_entry_is_cut(data, cuts):
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    running = Checksum()
    for lo, hi in zip(bounds, bounds[1:]):
        running.update(whole[lo:hi])
    assert running.value() == checksum(whole)
    assert 0 <= running.value() < 1 << 63 and running.value() != NO_CHECKSUM


def test_non_uint8_and_strided_tensors_sum_as_their_bytes():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    column = t[:, 1]  # strided: summed as its contiguous copy
    assert checksum(column) == checksum(column.contiguous().view(torch.uint8))
    assert Checksum().update(t[:4]).update(t[4:]).value() == checksum(t)


def test_a_flipped_bit_changes_the_sum():
    t = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    before = checksum(t)
    t[12345] ^= 4
    assert checksum(t) != before
