"""Checksums for paranoid mode: computed by the writer, verified by every reader."""

from __future__ import annotations

import zlib

import torch


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a contiguous tensor's bytes (CUDA tensors are staged through the host)."""
    data = t.detach()
    if data.is_cuda:
        data = data.cpu()
    return zlib.crc32(memoryview(data.contiguous().view(-1).view(torch.uint8).numpy()))
