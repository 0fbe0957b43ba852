"""The small interface every data path implements.

A shard owns one preallocated byte pool. A client moves bytes between its own
tensors (CPU or CUDA) and byte ranges of that pool. Ray never carries these
bytes: the control plane hands out pool offsets, the transport copies.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

PoolKey = tuple[str, int]
"""(shard id, incarnation): one start of one shard's pool."""


class TransferError(RuntimeError):
    """A transfer failed or timed out; its destination bytes must not be trusted."""


class LocalTransferError(TransferError):
    """A transfer this process could not carry out for a reason of its own (no host staging
    room, a slab it could not allocate): its bytes are failed as any others, but the pool is
    not to blame (a worker's memory limit must not make a healthy shard suspect)."""


class LateReadError(RuntimeError):
    """A read that failed (timed out, or posted after its caller gave up on it) was still in
    flight a whole ``transfer_timeout_s`` later: NIXL cannot cancel it (``Transfer.late``), so its
    bytes may land in its destination whenever the shard answers. Raised rather than let the
    destination be used: the connector's worker stops (vLLM would recompute those KV blocks or
    hand them to another request), ``StoreClient.get`` fails (the caller's tensors may still
    change: they must not be read or reused while the shard may answer)."""


@dataclass(frozen=True)
class CopyOp:
    """One contiguous byte range: ``pool[pool_offset : pool_offset + local.nbytes]`` <-> ``local``
    (a contiguous uint8 view). What callers with a few whole tensors hand to ``Ranges.of``."""

    pool_offset: int
    local: torch.Tensor


def flat_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind ``tensor`` as one flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class LocalBuffers(tuple[torch.Tensor, ...]):
    """Local buffers (flat uint8 tensors, never resized: a worker's KV caches) with each one's
    address and size read once. Every plan checks its ranges against the sizes and aligns to
    the addresses: read from an 8B model's 32 layer buffers at each plan, with the host's caches
    cold, they cost a decode step's save ~80 us of its ~0.3 ms plan on the CPU box
    (docs/performance-log.md, stop 65)."""

    addresses: tuple[int, ...]
    numels: tuple[int, ...]
    sizes: np.ndarray
    """``numels`` as an int64 array (read-only)."""

    def __new__(cls, buffers: Iterable[torch.Tensor]) -> LocalBuffers:
        self = super().__new__(cls, buffers)
        self.addresses = tuple(buffer.data_ptr() for buffer in self)
        self.numels = tuple(buffer.numel() for buffer in self)
        self.sizes = np.asarray(self.numels, dtype=np.int64)
        self.sizes.flags.writeable = False
        return self


def local_buffers(buffers: Sequence[torch.Tensor]) -> LocalBuffers:
    """``buffers`` with their addresses and sizes: read now unless they were already."""
    return buffers if isinstance(buffers, LocalBuffers) else LocalBuffers(buffers)


@dataclass(frozen=True)
class Ranges:
    """A batch of byte ranges between one pool and local memory, as arrays, not objects: range
    ``i`` is ``sizes[i]`` bytes at ``pool[pool_offsets[i]]`` and at
    ``buffers[buffer_index[i]][local_offsets[i]]``. A step moves one 16-64 KiB range per block
    per layer: built and checked as numpy arrays, a layer of 256 blocks costs microseconds of
    Python instead of the milliseconds one object per range did.

    ``buffers`` are flat uint8 tensors, all on one device, that keep the memory alive while
    the copy runs; transports copy only inside them (``check``).
    """

    buffers: tuple[torch.Tensor, ...]
    buffer_index: np.ndarray
    local_offsets: np.ndarray
    pool_offsets: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, ops: Sequence[CopyOp]) -> Ranges:
        """Ranges over whole tensors (each a contiguous uint8 view on the batch's one device)."""
        buffers: dict[int, int] = {}  # storage address -> index
        found: list[torch.Tensor] = []
        index, local, pool, sizes = [], [], [], []
        for i, op in enumerate(ops):
            t = op.local
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or not t.is_contiguous():
                raise ValueError(f"copy {i}: local must be a contiguous uint8 tensor; use as_bytes()")
            base = t.untyped_storage().data_ptr()
            at = buffers.get(base)
            if at is None:
                at = buffers[base] = len(found)
                found.append(flat_buffer(t))
            index.append(at)
            local.append(t.data_ptr() - base)
            pool.append(op.pool_offset)
            sizes.append(t.numel())
        if len({b.device for b in found}) > 1:
            raise ValueError("one batch of copies must stay on one device")
        return cls(tuple(found), *(np.asarray(a, dtype=np.int64) for a in (index, local, pool, sizes)))

    @classmethod
    def concat(cls, parts: Sequence[Ranges]) -> Ranges:
        """One batch of several (their buffers must be the same tuple, as a worker's are)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return EMPTY
        if len(parts) == 1:  # a layer's batch, the common case
            return parts[0]
        if any(p.buffers is not parts[0].buffers for p in parts):
            raise ValueError("concatenated ranges must share their buffers")
        return cls(parts[0].buffers, *(np.concatenate([getattr(p, f) for p in parts])
                                       for f in ("buffer_index", "local_offsets", "pool_offsets", "sizes")))

    def __len__(self) -> int:
        return len(self.sizes)

    def slice(self, begin: int, end: int) -> Ranges:
        """Ranges ``[begin, end)`` (views of the arrays, the same buffers)."""
        return Ranges(self.buffers, self.buffer_index[begin:end], self.local_offsets[begin:end],
                      self.pool_offsets[begin:end], self.sizes[begin:end])

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    def check(self, pool_bytes: int, what: str) -> None:
        """ValueError naming the first range outside the pool or outside its local buffer."""
        limits = local_buffers(self.buffers).sizes
        if self._inside(pool_bytes, limits):
            return
        # each end against its limit less the size, not the offset plus the size: that sum can
        # wrap around int64 to a negative number, and a range far past the pool would pass
        bad = ((self.sizes < 0) | (self.pool_offsets < 0) | (self.pool_offsets > pool_bytes - self.sizes)
               | (self.local_offsets < 0) | (self.buffer_index < 0) | (self.buffer_index >= len(limits)))
        if not bad.any():
            bad = self.local_offsets > limits[self.buffer_index] - self.sizes
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"copy {i}: pool range [{self.pool_offsets[i]}, +{self.sizes[i]}) or local range "
                             f"[{self.local_offsets[i]}, +{self.sizes[i]}) is outside {what} or its buffer")

    def _inside(self, pool_bytes: int, limits: np.ndarray) -> bool:
        """Whether every range lies inside the pool and inside the smallest buffer, from each
        column's extremes (a few reductions; Python's sums cannot overflow): enough for ``check``
        to pass without a pass over the ranges per condition (a 256-block 8B save's 16k-131k
        ranges took ~16 passes, a third of its prepare's host time). False decides nothing."""
        if not len(self) or not len(limits):
            return not len(self)
        high = int(self.sizes.max())
        return (int(self.sizes.min()) >= 0 and int(self.pool_offsets.min()) >= 0 and int(self.local_offsets.min()) >= 0
                and int(self.buffer_index.min()) >= 0 and int(self.buffer_index.max()) < len(limits)
                and int(self.pool_offsets.max()) + high <= pool_bytes
                and int(self.local_offsets.max()) + high <= int(limits.min()))


EMPTY = Ranges((), *(np.zeros(0, dtype=np.int64) for _ in range(4)))


WRAP_FREE = 1 << 61
"""A template's offsets and sizes less than this far from 0 in ``RepeatedRanges.check``: the
sums and differences it computes of them never wrap around int64."""


@dataclass(frozen=True)
class RepeatedRanges:
    """Parts that each repeat one part's ranges elsewhere: part ``k``'s range ``i`` is
    ``template``'s range ``i`` moved into buffer ``buffer_index[k]``, ``local_shifts[k]`` bytes
    on there, and ``pool_shifts[k]`` bytes on in the pool. A load posted layer by layer is so
    (each layer's buffer holds the same blocks, each entry the layer at its own place): its 32
    layers' ranges are one layer's arrays and 32 numbers each side, made and checked once
    instead of 32 times (a 256-block load's ranges and their check were ~0.5 ms of an H100
    host's time). ``template``'s ranges lie in one buffer, ``buffer_index[0]``; part 0's
    shifts are 0."""

    template: Ranges
    buffer_index: np.ndarray
    local_shifts: np.ndarray
    pool_shifts: np.ndarray

    def __len__(self) -> int:
        return len(self.template) * len(self.buffer_index)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.template.buffers

    @property
    def device(self) -> torch.device:
        return self.template.device

    def ends(self) -> list[int]:
        """Where each part's ranges end in ``expand()``."""
        return (len(self.template) * np.arange(1, len(self.buffer_index) + 1)).tolist()

    def expand(self) -> Ranges:
        """Every part's ranges, part after part (for a path that moves ranges one by one)."""
        t, parts = self.template, len(self.buffer_index)
        return Ranges(t.buffers, np.repeat(self.buffer_index, len(t)),
                      (t.local_offsets[None, :] + self.local_shifts[:, None]).ravel(),
                      (t.pool_offsets[None, :] + self.pool_shifts[:, None]).ravel(), np.tile(t.sizes, parts))

    def check(self, pool_bytes: int, what: str) -> None:
        """``Ranges.check`` of every part, from the template's extremes (its ranges lie in one
        buffer) and each part's shifts: a few reductions, not a pass over every part's ranges."""
        t = self.template
        if not len(t):
            return
        limits = np.asarray([b.numel() for b in t.buffers], dtype=np.int64)
        home = int(self.buffer_index[0])
        if int(t.buffer_index.min()) != home or int(t.buffer_index.max()) != home:
            raise ValueError(f"the repeated ranges of {what} lie in more than one buffer, or not in part 0's")
        if ((self.buffer_index < 0) | (self.buffer_index >= len(limits))).any() or int(t.sizes.min()) < 0:
            raise ValueError(f"a part's buffer is not one of the {len(limits)} buffers of {what}, "
                             "or a range's size is negative")
        # each shift against its limits less the template's extremes, not added to them (a shift
        # near int64's limit wrapped the sum to a negative number, and a part far past the pool
        # passed); the template's values within +-2**61 (no buffer or pool comes near), so no
        # difference wraps
        if max(int(t.local_offsets.max()), int(t.pool_offsets.max()), int(t.sizes.max())) >= WRAP_FREE:
            raise ValueError(f"a range of {what} lies past 2**61 bytes")
        local_low, local_high = int(t.local_offsets.min()), int((t.local_offsets + t.sizes).max())
        pool_low, pool_high = int(t.pool_offsets.min()), int((t.pool_offsets + t.sizes).max())
        if min(local_low, pool_low) <= -WRAP_FREE:
            raise ValueError(f"a range of {what} lies before its buffer or the pool")
        bad = ((self.local_shifts < -local_low) | (self.local_shifts > limits[self.buffer_index] - local_high)
               | (self.pool_shifts < -pool_low) | (self.pool_shifts > pool_bytes - pool_high))
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"part {k}: its ranges moved by {self.local_shifts[k]} bytes locally and "
                             f"{self.pool_shifts[k]} in the pool fall outside {what} or its buffer")


@dataclass(frozen=True)
class PoolDescriptor:
    """What a client needs to reach one shard's pool, as published by the shard.

    ``shm_path`` is set when the pool is a shared-memory file on the shard's node;
    ``nixl_metadata`` when the shard registered the pool with a NIXL agent.
    ``incarnation`` is random per shard start: a shard restarted under the same id has
    a new, empty pool, and ``(shard_id, incarnation)`` tells the two apart so no client
    keeps using the old mapping (0 only for stand-alone pools outside a fleet).
    """

    shard_id: str
    node_id: str
    pool_bytes: int
    shm_path: str | None
    nixl_agent: str | None
    nixl_metadata: bytes | None
    pool_base_addr: int
    incarnation: int = 0
    index_path: str | None = None
    """The shard's published index (``store.published_layout``), which same-node readers map."""
    index_base_addr: int = 0
    index_bytes: int = 0
    """Where the same index lies in the shard's memory, registered with its NIXL agent for readers
    on other nodes (0: not exported)."""

    @property
    def key(self) -> PoolKey:
        return (self.shard_id, self.incarnation)


class Transfer(ABC):
    """A posted batch of copies; ``wait`` raises ``TransferError`` on failure."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None: ...

    def order_stream(self, stream: torch.cuda.Stream) -> bool:
        """Make work queued on ``stream`` from now on run after this transfer lands, on the
        device, without blocking the host. False where only the host can wait (the caller
        then calls ``wait``); a failure still surfaces only through ``wait``."""
        return False

    def abandon(self) -> None:
        """Nobody will wait for this transfer (its step's deadline passed before it was
        posted): it may still run, but must deliver nothing more (its destination may be
        another request's by now), and give back what it holds once it is over."""
        return None

    def late(self) -> bool:
        """Whether bytes may still land in this read's destination although ``wait`` failed or
        was never called: a NIXL request in flight, which NIXL cannot cancel (releasing it
        frees it but the read lands whenever the shard answers; docs/performance-log.md, stop
        66). Its destination must not be used until this is False."""
        return False


def still_late(transfers: Iterable[Transfer], deadline: float) -> list[Transfer]:
    """Wait until none of ``transfers`` is ``late``, or until ``deadline`` (``time.monotonic``):
    those still late then. Polled, as ``late`` must be (NIXL posts no completion anyone could
    wait on): spins first, a request that is landing ends within microseconds, then every 1 ms."""
    late = [transfer for transfer in transfers if transfer.late()]
    spins = 0
    while late and time.monotonic() < deadline:
        spins += 1
        time.sleep(0 if spins < 64 else 1e-3)
        late = [transfer for transfer in late if transfer.late()]
    return late


class CompletedTransfer(Transfer):
    """A transfer that finished (or failed) while it was posted, e.g. CPU memcpy."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        if isinstance(self._error, TransferError):
            raise self._error  # as it is: a ``LocalTransferError`` stays one
        if self._error is not None:
            raise TransferError(str(self._error)) from self._error

    def order_stream(self, stream: torch.cuda.Stream) -> bool:
        return True  # nothing left to land


class PreparedCopies:
    """A step's copies with one pool, planned once and posted part by part (a layer each), so
    a post in the step costs no planning. This default posts each part's slice of the ranges
    as its own batch; a transport that can plan ahead returns its own from ``PoolTransport.prepare``
    (shared memory on CUDA: one gather plan for the step)."""

    def __init__(self, transport: PoolTransport, ranges: Ranges, ends: Sequence[int], *, to_pool: bool) -> None:
        self._transport = transport
        self._ranges = ranges
        self._bounds = [0, *ends]
        self._to_pool = to_pool

    def post_each(self, end: int, start: int = 0) -> list[Transfer]:
        """``post`` of parts ``start`` .. ``end`` - 1, in order (one call: a transport may set up
        once for all of them)."""
        return [self.post(part) for part in range(start, end)]

    def post(self, part: int) -> Transfer:
        return self._post_slice(self._bounds[part], self._bounds[part + 1])

    def post_whole(self) -> Transfer:
        """Every part as one transfer: a step's one part, or a load at once planned as one
        layer's ranges repeated (every layer posted, one transfer to wait for)."""
        return self._post_slice(0, self._bounds[-1])

    def _post_slice(self, start: int, end: int) -> Transfer:
        batch = self._ranges.slice(start, end)
        if not len(batch):
            return CompletedTransfer()
        return self._transport.write(batch) if self._to_pool else self._transport.read(batch)


class PoolTransport(ABC):
    """Moves bytes between a client's registered tensors and one shard pool."""

    name: str

    @abstractmethod
    def register_local(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s memory usable as a ``Ranges`` buffer (once, at start-up)."""

    @abstractmethod
    def read(self, ranges: Ranges) -> Transfer:
        """Post pool -> local copies."""

    @abstractmethod
    def write(self, ranges: Ranges) -> Transfer:
        """Post local -> pool copies."""

    def prepare(self, ranges: Ranges, ends: Sequence[int], *, to_pool: bool) -> PreparedCopies:
        """``ranges`` in parts (``ends[k]``: where part k ends), to be posted one part at a time."""
        return PreparedCopies(self, ranges, ends, to_pool=to_pool)

    def prepare_repeated(self, repeated: RepeatedRanges, *, to_pool: bool) -> PreparedCopies:
        """``prepare`` of parts that repeat one part's ranges; by default their ranges in full."""
        return self.prepare(repeated.expand(), repeated.ends(), to_pool=to_pool)

    @abstractmethod
    def close(self) -> None: ...


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("transfer buffers must be contiguous")
    return t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
