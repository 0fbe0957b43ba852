"""Entry checksums: taken by the writer, verified by every reader (paranoid mode, the disk tier).

XXH3-64 (``xxhash``): 3.6-4.9x CRC32's speed for whole entries on the CPU box (performance log), so a disk
promotion or a paranoid load spends its time on the bytes' move, not their check. ``Checksum``
streams: an entry scattered over many ranges (layers, K/V halves) sums as its bytes in the
pool do, however they are cut into segments. The value keeps the low 63 bits: the published
index holds it in a signed 64-bit column, where ``NO_CHECKSUM`` (-1) means none.
"""

from __future__ import annotations

import torch
import xxhash

MASK = (1 << 63) - 1
"""A checksum is never negative: -1 stays free for ``NO_CHECKSUM``."""


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, in order (CUDA tensors are staged through the host: paranoid mode
    trades speed for certainty). Each step only where needed: a layer's segment of a block is a
    few KiB, and converting it cost more than summing it (performance log)."""
    if t.is_cuda:
        t = t.cpu()
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype != torch.uint8:  # bfloat16 has no numpy type: its bytes
        t = t.view(-1).view(torch.uint8)
    return memoryview(t.numpy())


class Checksum:
    """A running checksum of segments taken in order: the same value for the same bytes,
    whatever their cut."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, t: torch.Tensor) -> Checksum:
        self._state.update(_bytes(t))
        return self

    def value(self) -> int:
        return self._state.intdigest() & MASK


def checksum(t: torch.Tensor) -> int:
    """The checksum of one contiguous tensor's bytes (an entry in one piece)."""
    return xxhash.xxh3_64_intdigest(_bytes(t)) & MASK
