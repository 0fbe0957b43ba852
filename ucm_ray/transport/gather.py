"""Many small copies between a pool and local buffers as one gather (or scatter) kernel per part.

A step moves one 16-64 KiB range per block per layer; issued one ``copy_`` each, the launch
cost dominates (4.5 GB/s measured on an H200 against 53 GB/s for one large pinned copy). On
CUDA the shard's page-locked pool is also addressable from the GPU (unified addressing), so
the ranges become rows of a word matrix and one ``index_select`` + ``index_copy_`` moves them
all, reading or writing host memory over PCIe from the kernel itself.

A ``GatherPlan`` computes the row indices of a whole step (every layer) at once and uploads
them in one copy; moving one part (a layer) is then two kernel launches and no host work. On
an H200 engine the per-layer planning this replaces (Python and numpy on a copy thread) cost
more host time than the copies took on the link, and its thread fought the engine's for the
GIL: a 4k-token store hit's step took ~20 ms of host time for ~4 ms of PCIe.

Rows are ``line`` bytes: the largest power of two up to ``MAX_LINE`` dividing every offset and
size, so a 16-64 KiB range is one row and the index tensors stay small (with 4 KiB rows a 512
MiB step took 131k indices, ~3 ms of numpy to build); ranges that share no 8-byte alignment
are not eligible (``build`` returns None and the caller copies range by range). Rows count
from each tensor's start, which need only be 8-byte aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ucm_ray.transport.base import Ranges

WORD = 8
MAX_LINE = 1 << 20
GATHER_BYTES = 64 << 20
"""Bytes moved per gather: the kernel stages them in device memory."""


class UvaView:
    """A CUDA tensor over page-locked host memory at ``address`` (zero copy): what a kernel
    reads or writes there goes over PCIe. Needs memory registered with the mapped flag on a
    device that can use host pointers for it (every GPU with unified addressing)."""

    def __init__(self, address: int, nbytes: int, device: torch.device) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
        self.tensor = torch.as_tensor(self, device=device)


def line_bytes(values: np.ndarray) -> int:
    """The row size for these offsets and sizes: 0 when they are not all 8-byte aligned."""
    common = int(np.gcd.reduce(values)) if len(values) else 0
    if common == 0 or common % WORD:
        return 0
    line = WORD
    while line * 2 <= MAX_LINE and common % (line * 2) == 0:
        line *= 2
    return line


def _rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices ``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated."""
    first = np.cumsum(counts) - counts  # where each range begins in the output
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


@dataclass(frozen=True)
class _Run:
    """One kernel pair: these rows of the pool <-> these rows of one local buffer."""

    buffer: int
    pool_rows: torch.Tensor
    local_rows: torch.Tensor


class GatherPlan:
    """The copies of ``ranges`` as rows, split into parts (``ends[k]`` is where part k's ranges
    end), each part into runs of one local buffer and at most ``GATHER_BYTES``. Built on the
    stream that will move it (the index upload is queued there)."""

    def __init__(self, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int], line: int,
                 run_bytes: int = GATHER_BYTES) -> None:
        width = line // WORD
        self._pool = _as_rows(pool, line, width)
        self._local = [_as_rows(buffer, line, width) for buffer in ranges.buffers]
        bounds = np.concatenate([[0], np.asarray(ends, dtype=np.int64)])
        # each part's ranges grouped by buffer (a layer's part has one buffer: already grouped)
        order = np.concatenate([begin + np.argsort(ranges.buffer_index[begin:end], kind="stable")
                                for begin, end in zip(bounds[:-1], bounds[1:])] or [np.zeros(0, dtype=np.int64)])
        buffers, counts = ranges.buffer_index[order], ranges.sizes[order] // line
        index = torch.from_numpy(np.stack([_rows(ranges.pool_offsets[order] // line, counts),
                                           _rows(ranges.local_offsets[order] // line, counts)]))
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        row_at = np.concatenate([[0], np.cumsum(counts)])  # range i's first row
        limit = max(1, run_bytes // line)
        self._parts: list[list[_Run]] = []
        for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            runs = []
            cuts = [begin, *(begin + 1 + np.flatnonzero(np.diff(buffers[begin:end]))).tolist(), end]
            for first, last in zip(cuts[:-1], cuts[1:]):
                for at in range(int(row_at[first]), int(row_at[last]), limit):
                    stop = min(int(row_at[last]), at + limit)
                    runs.append(_Run(int(buffers[first]), index[0, at:stop], index[1, at:stop]))
            self._parts.append(runs)

    @classmethod
    def build(cls, pool: torch.Tensor, ranges: Ranges, ends: Sequence[int],
              run_bytes: int = GATHER_BYTES) -> GatherPlan | None:
        """The plan, or None when the ranges or a tensor's start share no 8-byte alignment."""
        if any(t.data_ptr() % WORD for t in (pool, *ranges.buffers)):
            return None
        line = line_bytes(np.concatenate([ranges.sizes, ranges.pool_offsets, ranges.local_offsets]))
        return cls(pool, ranges, ends, line, run_bytes) if line else None

    def move(self, part: int, *, to_pool: bool) -> None:
        """Queue part ``part``'s copies on the current stream: two kernels per run."""
        for run in self._parts[part]:
            local = self._local[run.buffer]
            if to_pool:
                self._pool.index_copy_(0, run.pool_rows, local.index_select(0, run.local_rows))
            else:
                local.index_copy_(0, run.local_rows, self._pool.index_select(0, run.pool_rows))


def _as_rows(flat: torch.Tensor, line: int, width: int) -> torch.Tensor:
    """``flat`` (uint8) as rows of ``line`` bytes (int64 words), its tail short of a row left out."""
    return flat[: flat.numel() - flat.numel() % line].view(torch.int64).view(-1, width)
