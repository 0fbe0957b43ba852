"""Many small copies between a pool and one local buffer as one gather (or scatter) kernel.

A step moves one 16-64 KiB range per block per layer; issued one ``copy_`` each, the launch
cost dominates (4.5 GB/s measured on an H200 against 53 GB/s for one large pinned copy). On
CUDA the shard's page-locked pool is also addressable from the GPU (unified addressing), so
the ranges become rows of a word matrix and one ``index_select`` + ``index_copy_`` moves them
all, reading or writing host memory over PCIe from the kernel itself.

Rows are ``line`` bytes: the largest power of two up to 4 KiB dividing every offset and size,
so the index tensors stay small; ranges that share no 8-byte alignment are not eligible.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

WORD = 8
MAX_LINE = 4096


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
class _RowPlan:
    """Row indices of one geometry, on the copies' device: ``pool_rows`` relative to the
    lowest pool offset, so the same plan serves the same ranges shifted in the pool."""

    line: int
    pool_rows: torch.Tensor
    local_rows: torch.Tensor


class RowPlans:
    """The row indices of the last few geometries, kept on the device. A step moves the same
    blocks to or from the same entries for every layer, each layer only shifted by its place
    in an entry: the indices are computed and uploaded once per step, not once per layer. On an
    H200 host a layer's gather of 256 ranges cost 0.13 ms of host time with its indices computed
    per call and 0.03 ms with them on the device already; the host's time, not the link's, was
    what a layer's load waited for."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._lock = threading.Lock()  # a worker's copy thread and a store client may share a pool
        self._plans: OrderedDict[tuple[bytes, bytes, bytes], _RowPlan] = OrderedDict()

    def get(self, key: tuple[bytes, bytes, bytes], aligned: Callable[[int], bool],
            build: Callable[[], _RowPlan | None]) -> _RowPlan | None:
        """The plan for ``key`` if its line suits this call (``aligned``), else a new one."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None and aligned(plan.line):
                self._plans.move_to_end(key)
                return plan
        plan = build()
        if plan is not None:
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > self._size:
                    self._plans.popitem(last=False)
        return plan


def copy_ranges(pool: torch.Tensor, local: torch.Tensor, pool_offsets: np.ndarray, local_offsets: np.ndarray,
                sizes: np.ndarray, *, to_pool: bool, plans: RowPlans | None = None) -> bool:
    """Move ``sizes[i]`` bytes between ``pool[pool_offsets[i]:]`` and ``local[local_offsets[i]:]``
    (both flat uint8; int64 arrays) on the current stream, as one gather and one scatter.
    Returns False (nothing moved) when the ranges are not 8-byte aligned: the caller copies
    them one by one. The row indices are computed on the host and sent in one small upload,
    or taken from ``plans`` when the same ranges, shifted in the pool, were moved recently:
    two kernels per call, whatever the number of ranges."""
    shift = int(pool_offsets.min()) if len(pool_offsets) else 0
    relative: np.ndarray = pool_offsets - shift
    ends = np.asarray([shift, pool.data_ptr(), local.data_ptr()], dtype=np.int64)

    def aligned(line: int) -> bool:
        return not (ends % line).any()

    def build() -> _RowPlan | None:
        line = line_bytes(np.concatenate([sizes, relative, local_offsets, ends]))
        if not line:
            return None
        counts: np.ndarray = sizes // line
        index = torch.from_numpy(np.stack([_rows(relative // line, counts), _rows(local_offsets // line, counts)]))
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        return _RowPlan(line, index[0], index[1])

    plan = build() if plans is None else plans.get(
        (relative.tobytes(), local_offsets.tobytes(), sizes.tobytes()), aligned, build)
    if plan is None:
        return False
    width = plan.line // WORD
    pool_rows = _as_rows(pool[shift:], plan.line, width)
    local_rows = _as_rows(local, plan.line, width)
    if to_pool:
        pool_rows.index_copy_(0, plan.pool_rows, local_rows.index_select(0, plan.local_rows))
    else:
        local_rows.index_copy_(0, plan.local_rows, pool_rows.index_select(0, plan.pool_rows))
    return True


def _as_rows(flat: torch.Tensor, line: int, width: int) -> torch.Tensor:
    """``flat`` (uint8) as rows of ``line`` bytes (int64 words), its tail short of a row left out."""
    return flat[: flat.numel() - flat.numel() % line].view(torch.int64).view(-1, width)
