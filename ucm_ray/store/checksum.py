"""Checksums for paranoid mode: computed by the writer, verified by every reader."""

from __future__ import annotations

import zlib

import torch


def checksum(t: torch.Tensor, value: int = 0) -> int:
    """CRC32 of a contiguous tensor's bytes, continuing from ``value`` so that an entry
    scattered over many ranges (layers, K/V halves) checksums as its bytes in the pool
    (CUDA tensors are staged through the host: paranoid mode trades speed for certainty)."""
    data = t.detach()
    if data.is_cuda:
        data = data.cpu()
    return zlib.crc32(memoryview(data.contiguous().view(-1).view(torch.uint8).numpy()), value)
