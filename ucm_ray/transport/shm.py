"""Same-node data path: the shard's pool is a file in /dev/shm that clients map.

On one host, NIXL/UCX between GPU memory and another process's pinned host
memory fell back to TCP (0.5-0.8 GB/s measured), while a mapped, host-registered
segment copies at PCIe speed. So same-node clients copy straight from/to the
mapping: plain copies on CPU, side-stream async copies on CUDA.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ucm_ray.transport.base import (
    EMPTY,
    CompletedTransfer,
    PoolDescriptor,
    PoolTransport,
    PreparedCopies,
    Ranges,
    RepeatedRanges,
    Transfer,
    TransferError,
)
from ucm_ray.transport.cudart import clear_last_error, copy_ranges, has_copy_ranges
from ucm_ray.transport.gather import DeviceView, GatherPlan

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped
HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
TORCH_COPY_BYTES = 1 << 20
"""CPU ranges from this size up are copied by torch (over threads), smaller ones by memmove."""


class SharedPool:
    """A /dev/shm file mapped as a flat uint8 tensor (owner creates, others attach)."""

    def __init__(self, path: str, size: int, *, create: bool, populate: bool = False) -> None:
        """``populate``: map every page at once (readers: a first touch of a shared page costs
        a fault, and a fresh engine's first loads paid ~0.6 us per 4 KiB on the request's path:
        3 GB/s instead of 12 GB/s on a 2-core box)."""
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # Reserve the pages now: on tmpfs a plain ftruncate reserves nothing, and a full
                # /dev/shm would surface later as SIGBUS mid-copy instead of a clear error here.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(path)
                    raise OSError(e.errno, f"cannot reserve {size} bytes for shard pool {path}: {e.strerror}") from e
            elif os.fstat(fd).st_size < size:
                raise TransferError(f"shared pool {path} is smaller than its descriptor says")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._owner = create

    def close(self) -> None:
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:
            log.warning("pool %s still has live views; leaving the mapping to the GC", self.path)
        if self._owner:
            Path(self.path).unlink(missing_ok=True)


def cluster_tag(session_name: str | None = None) -> str:
    """12 hex digits naming one start of one Ray cluster: a hash of its session name, which every
    node and worker of the cluster shares and no other cluster (or a restart) has. Without a
    ``session_name``, that of the Ray cluster this process is connected to."""
    if session_name is None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("pool file names carry the Ray cluster's id: connect to Ray first")
        session_name = ray.get_runtime_context().get_session_name()
    return hashlib.sha256(session_name.encode()).hexdigest()[:12]


def pool_prefix(shm_dir: str, ray_namespace: str, shard_id: str = "", *, cluster: str | None = None) -> str:
    """Pool files are named ``ucmray-<ray namespace>-<cluster tag>-<shard id>-<random>``: two Ray
    clusters on one host (same Ray namespace or not) never match each other's prefixes, so neither
    removes the other's live pools. ``cluster`` defaults to this process's cluster
    (``cluster_tag()``)."""
    tag = cluster_tag() if cluster is None else cluster
    return os.path.join(shm_dir, f"ucmray-{ray_namespace}-{tag}-{shard_id}")


def is_own_file(st: os.stat_result, uid: int | None = None) -> bool:
    """Whether an ``lstat`` result is a regular file of user ``uid`` (default: this process's
    effective user): the only entries stale-pool cleanup may remove."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == (os.geteuid() if uid is None else uid)


def remove_stale_pools(prefix: str, *, uid: int | None = None) -> int:
    """Unlink pool files left by shards that died without shutting down (kill -9, OOM):
    nothing else would ever free that memory. Callers pass a prefix no live shard uses.

    Only regular files of this user (``uid``) are touched: in a shared, sticky ``/dev/shm``
    another user's file (or a directory, or a link) that happens to match is left alone and
    logged, never a reason for a shard not to start. Returns how many files were removed."""
    removed = 0
    for path in glob.glob(glob.escape(prefix) + "*"):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not is_own_file(st, uid):
            log.warning("leaving %s: not a pool file of this user (owner uid %d)", path, st.st_uid)
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("cannot remove stale shard pool %s: %s", path, e)
            continue
        removed += 1
    if removed:
        log.info("removed %d stale shard pool(s) matching %s*", removed, prefix)
    return removed


class _CudaEventTransfer(Transfer):
    """Copies queued on a stream up to ``event``; ``error``: queuing them failed part-way (what
    was queued still runs: waited for, then reported as a failure)."""

    def __init__(self, event: torch.cuda.Event, error: BaseException | None = None) -> None:
        self._event = event
        self._error = error

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self._event.synchronize()
        except RuntimeError as e:  # a CUDA error surfaces here
            raise TransferError(str(e)) from e
        if self._error is not None:
            raise TransferError(str(self._error)) from self._error

    def order_stream(self, stream: torch.cuda.Stream) -> bool:
        stream.wait_event(self._event)
        return True


FEW_RANGES = 32
"""Up to this many ranges a step's copies go one by one: a gather plan's fixed host cost
(index arrays, their upload, a view per KV buffer: ~1 ms under the profiler on the H200 host)
outweighs a few launches, and decode steps save one block (a range per layer) per request
that filled one."""


class _CudaCopies(PreparedCopies):
    """A step's copies with one pool on CUDA: planned once (one gather plan, its indices
    uploaded once; without one, range by range), each part then posted as a few kernels (or
    staged DMA copies) on the pool's stream for that direction. That stream waits once, as the
    copies are prepared, for the caller's current stream (a save's KV is written, a load's
    blocks zeroed, by then): the worker prepares a step's copies and posts all their parts at
    once, and a wait per post cost each layer's post three more CUDA calls."""

    def __init__(self, transport: HostBufferTransport, ranges: Ranges, ends: Sequence[int], *, to_pool: bool,
                 stream: torch.cuda.Stream, plan: GatherPlan | None) -> None:
        super().__init__(transport, ranges, ends, to_pool=to_pool)
        self._stream = stream
        self._pool = transport.pool_tensor
        self._plan = plan

    def post(self, part: int) -> Transfer:
        with _queued_on(self._stream):
            return self._queue(range(part, part + 1))

    def post_each(self, end: int, start: int = 0) -> list[Transfer]:
        """Parts ``start`` .. ``end`` - 1, the pool's stream made current once for all of them (a
        load posted layer by layer: its first layers in ``start_load_kv``, one a layer hook)."""
        with _queued_on(self._stream):
            return [self._queue(range(part, part + 1)) for part in range(start, end)]

    def post_whole(self) -> Transfer:
        """Every part queued, then one event (a load at once as one layer's ranges repeated:
        32 layers' copies, one event for the step to wait for)."""
        with _queued_on(self._stream):
            return self._queue(range(len(self._bounds) - 1))

    def _queue(self, parts: range) -> Transfer:
        """Queue ``parts`` on the pool's stream (current), then one event after them."""
        error = None
        try:
            for part in parts:
                if self._plan is not None:
                    self._plan.move(part, to_pool=self._to_pool)
                else:
                    _copy_one_by_one(self._pool, self._ranges.slice(self._bounds[part], self._bounds[part + 1]),
                                     to_pool=self._to_pool)
        except Exception as e:  # noqa: BLE001 -- e.g. a copy CUDA refused: what was queued is waited for first
            error = e
        event = torch.cuda.Event()
        event.record(self._stream)  # after whatever was queued, failed part or not
        return _CudaEventTransfer(event, error)


@contextmanager
def _queued_on(stream: torch.cuda.Stream) -> Iterator[torch.cuda.Stream]:
    """Make ``stream`` current for the work queued inside; yields the stream that was current
    on its device. ``torch.cuda.stream`` looks the device up several times a use (~40 us of
    host time on an H200 host, under the profiler), and a step posts a part per layer: on the
    current device (the worker's) it is set directly."""
    if stream.device_index != torch.cuda.current_device():
        with torch.cuda.device(stream.device_index):
            with _queued_on(stream) as caller:
                yield caller
        return
    caller = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        yield caller
    finally:
        torch.cuda.set_stream(caller)


def _copy_one_by_one(pool: torch.Tensor, ranges: Ranges, *, to_pool: bool) -> None:
    """One async copy per range on the current stream: the path of a few ranges (``FEW_RANGES``),
    of ranges no gather plan fits (not 8-byte aligned), or of a pool the GPU cannot address (no
    mapped view). Called on raw addresses (``copy_ranges``) where the CUDA runtime is at hand:
    torch's ``copy_`` of two sliced views cost several times its host time a range.
    (``cudaMemcpyBatchAsync``, one call per layer for the copy engines, measured 0.98x a pinned
    copy in an isolated H200 probe but 0.53x against the gather kernel's 0.66x in the worker's
    path, passes alternating on the same entries: not used.)"""
    if has_copy_ranges():
        bases = np.asarray([buffer.data_ptr() for buffer in ranges.buffers], dtype=np.int64)
        local = (bases[ranges.buffer_index] + ranges.local_offsets).tolist()
        remote = (pool.data_ptr() + ranges.pool_offsets).tolist()
        stream = torch.cuda.current_stream(ranges.device).cuda_stream
        copy_ranges(remote if to_pool else local, local if to_pool else remote, ranges.sizes.tolist(), stream)
        return
    for buffer_at, at, off, size in zip(ranges.buffer_index.tolist(), ranges.local_offsets.tolist(),
                                        ranges.pool_offsets.tolist(), ranges.sizes.tolist()):
        local_view, pool_view = ranges.buffers[buffer_at][at: at + size], pool[off: off + size]
        (pool_view if to_pool else local_view).copy_(local_view if to_pool else pool_view, non_blocking=True)


class HostBufferTransport(PoolTransport):
    """Copies between local tensors and one host byte buffer (``host``): plain copies on CPU,
    stream-ordered copies on CUDA (one gather plan a step, or range by range), the buffer
    page-locked and mapped for the GPU once. A same-node shard's mapped pool is one
    (``ShmPoolTransport``); the pinned staging of NIXL transfers another
    (``nixl.staging``), so both move their bytes the one way. ``what`` names it in messages."""

    name = "host"

    def __init__(self, host: torch.Tensor, what: str) -> None:
        self._host = host
        self._what = what
        self._pinned = False
        self._unpin_at_close = False  # False where another library page-locked it (and unpins it)
        self._streams: dict[bool, torch.cuda.Stream] = {}  # to_pool -> its stream: saves never queue behind loads
        self._uva: torch.Tensor | None = None

    def register_local(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self._pin_for_cuda(tensor.device)

    def read(self, ranges: Ranges) -> Transfer:
        return self.copy(ranges, to_pool=False)

    def write(self, ranges: Ranges) -> Transfer:
        return self.copy(ranges, to_pool=True)

    def close(self) -> None:
        self._uva = None
        if self._unpin_at_close:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        self._pinned = self._unpin_at_close = False

    @property
    def pool_tensor(self) -> torch.Tensor:
        return self._host

    def prepare(self, ranges: Ranges, ends: Sequence[int], *, to_pool: bool,
                follow_caller: bool = True) -> PreparedCopies:
        """On CUDA, the step planned once (``_CudaCopies``); on CPU a post is the copy itself,
        planned as it runs. ``follow_caller``: the copies queue behind the caller's current
        stream (the engine thread's compute stream); off where something else ordered them and
        the caller's stream is one they must never wait for (the NIXL copy thread's current
        stream is the legacy default one, where vLLM runs its forward)."""
        if ranges.device.type != "cuda" or not len(ranges):
            return super().prepare(ranges, ends, to_pool=to_pool)
        ranges.check(self._host.numel(), self._what)
        stream = self._stream_for(to_pool, ranges.device)
        with _queued_on(stream) as caller:
            if follow_caller:
                stream.wait_stream(caller)
            plan = None
            if self._uva is not None and len(ranges) > FEW_RANGES:
                plan = GatherPlan.build(self._uva, ranges, ends, host_pool=self._host)
        return _CudaCopies(self, ranges, ends, to_pool=to_pool, stream=stream, plan=plan)

    def prepare_repeated(self, repeated: RepeatedRanges, *, to_pool: bool) -> PreparedCopies:
        """On CUDA, one gather plan for the part every part repeats (checked once, its shifts
        per part); otherwise, or where it cannot be planned so, as ``prepare`` of every range."""
        if repeated.device.type != "cuda" or len(repeated) <= FEW_RANGES:
            return super().prepare_repeated(repeated, to_pool=to_pool)
        repeated.check(self._host.numel(), self._what)
        stream = self._stream_for(to_pool, repeated.device)
        with _queued_on(stream) as caller:
            plan = None if self._uva is None else \
                GatherPlan.build_repeated(self._uva, repeated, host_pool=self._host)
            if plan is not None:
                stream.wait_stream(caller)
        if plan is None:  # (outside: ``prepare`` waits for the caller's stream itself)
            return super().prepare_repeated(repeated, to_pool=to_pool)
        return _CudaCopies(self, EMPTY, repeated.ends(), to_pool=to_pool, stream=stream, plan=plan)

    def _stream_for(self, to_pool: bool, device: torch.device) -> torch.cuda.Stream:
        """The buffer's stream for that direction (the buffer page-locked and mapped first, for
        ``device``: the local memory's)."""
        self._pin_for_cuda(device)
        return self._streams[to_pool]

    def copy(self, ranges: Ranges, *, to_pool: bool, follow_caller: bool = True) -> Transfer:
        """``ranges`` copied to (``to_pool``) or from the buffer: on CUDA queued (``prepare``'s
        ``follow_caller``), on CPU done before it returns."""
        if not len(ranges):
            return CompletedTransfer()
        if ranges.device.type == "cuda":
            return self.prepare(ranges, [len(ranges)], to_pool=to_pool, follow_caller=follow_caller).post(0)
        ranges.check(self._host.numel(), self._what)
        try:
            self._copy_on_cpu(ranges, to_pool=to_pool)
        except RuntimeError as e:
            return CompletedTransfer(e)
        return CompletedTransfer()

    def _copy_on_cpu(self, ranges: Ranges, *, to_pool: bool) -> None:
        """Small ranges by ``memmove`` (a C call, the GIL released: ~4x torch's per-copy cost
        at 64 KiB), large ones by torch (which splits a large copy over threads)."""
        pool = self._host
        bases = np.asarray([b.data_ptr() for b in ranges.buffers], dtype=np.int64)
        local_addrs = (bases[ranges.buffer_index] + ranges.local_offsets).tolist()
        pool_addrs = (pool.data_ptr() + ranges.pool_offsets).tolist()
        for i, (local, remote, size) in enumerate(zip(local_addrs, pool_addrs, ranges.sizes.tolist())):
            if size < TORCH_COPY_BYTES:
                ctypes.memmove(remote, local, size) if to_pool else ctypes.memmove(local, remote, size)
                continue
            buffer = ranges.buffers[ranges.buffer_index[i]]
            local_view = buffer[ranges.local_offsets[i]: ranges.local_offsets[i] + size]
            pool_view = pool[ranges.pool_offsets[i]: ranges.pool_offsets[i] + size]
            (pool_view if to_pool else local_view).copy_(local_view if to_pool else pool_view)

    def _pin_for_cuda(self, device: torch.device) -> None:
        """Page-lock the buffer once so CUDA copies run at PCIe speed, asynchronously, and map
        it into the GPU's address space for the gather path (checked once; off if it fails).
        Its streams and mapped view are ``device``'s (the KV's), whichever device is current on
        the thread that first uses it: a staging slab is first used where a transfer's later
        piece is posted or scattered, on the thread that polls or waits for it."""
        if self._pinned:
            return
        cudart = torch.cuda.cudart()
        address, nbytes = self._host.data_ptr(), self._host.numel()
        # A call that fails also stays the thread's last CUDA error, which torch's next kernel
        # launch check on this thread would raise as its own: cleared after each.
        rc = int(cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE_MAPPED))
        mapped = rc == 0
        if not mapped:
            clear_last_error()
            rc = int(cudart.cudaHostRegister(address, nbytes, 0))
            if rc != 0:
                clear_last_error()
        if rc == HOST_MEMORY_ALREADY_REGISTERED:
            # Page-locked already by another library: UCX pins host memory NIXL registers where
            # it can move GPU memory itself (a staging slab is registered with NIXL before its
            # first copy; H100, stop 67). Copies run at PCIe speed all the same, one by one (no
            # mapped view: how it was mapped is not ours to know), and it unpins it.
            log.debug("%s: page-locked by another library already", self._what)
        elif rc != 0:
            raise TransferError(f"cudaHostRegister of {self._what} failed: CUDA error {rc}")
        self._pinned = True
        self._unpin_at_close = rc == 0
        self._streams = {False: torch.cuda.Stream(device), True: torch.cuda.Stream(device)}
        if mapped:
            with _queued_on(self._streams[False]):  # the probe's copy waits for nothing of the caller's
                self._uva = self._mapped_view(address)

    def _mapped_view(self, address: int) -> torch.Tensor | None:
        """The pool as a CUDA tensor (its host pointer used on the device, as unified addressing
        allows), if a read through it returns what the CPU sees; else None (copies one by one)."""
        try:
            nbytes = self._host.numel()
            view = DeviceView(address, nbytes, torch.device("cuda", torch.cuda.current_device())).tensor
            probe = min(4096, nbytes)
            if torch.equal(view[:probe].cpu(), self._host[:probe]):
                return view
            log.warning("%s: the GPU reads other bytes through the mapped pointer; copying block by block",
                        self._what)
        except (RuntimeError, TypeError, ValueError) as e:
            log.warning("%s: no GPU-mapped view (%s); copying block by block", self._what, e)
        return None


class ShmPoolTransport(HostBufferTransport):
    """Copies between local tensors and a same-node shard's mapped pool."""

    name = "shm"

    def __init__(self, desc: PoolDescriptor) -> None:
        if not desc.shm_path or not os.path.exists(desc.shm_path):
            raise TransferError(f"shard {desc.shard_id} pool {desc.shm_path!r} is not mapped on this node")
        self._desc = desc
        self._pool = SharedPool(desc.shm_path, desc.pool_bytes, create=False, populate=True)
        super().__init__(self._pool.tensor, f"shard {desc.shard_id}'s pool")

    def close(self) -> None:
        super().close()
        self._pool.close()
