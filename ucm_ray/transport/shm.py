"""Same-node data path: the shard's pool is a file in /dev/shm that clients map.

On one host, NIXL/UCX between GPU memory and another process's pinned host
memory fell back to TCP (0.5-0.8 GB/s measured), while a mapped, host-registered
segment copies at PCIe speed. So same-node clients copy straight from/to the
mapping: plain copies on CPU, side-stream async copies on CUDA.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import torch

from ucm_ray.transport.base import (
    CompletedTransfer,
    CopyOp,
    PoolDescriptor,
    PoolTransport,
    Transfer,
    TransferError,
)
from ucm_ray.transport.gather import UvaView, copy_ranges

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped
GATHER_BYTES = 64 << 20
"""Bytes moved per gather: the kernel stages them in GPU memory."""


class SharedPool:
    """A /dev/shm file mapped as a flat uint8 tensor (owner creates, others attach)."""

    def __init__(self, path: str, size: int, *, create: bool) -> None:
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
            self._mmap = mmap.mmap(fd, size)
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
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self._event.synchronize()
        except RuntimeError as e:  # a CUDA error surfaces here
            raise TransferError(str(e)) from e


class ShmPoolTransport(PoolTransport):
    """Copies between local tensors and a same-node shard's mapped pool."""

    name = "shm"

    def __init__(self, desc: PoolDescriptor) -> None:
        if not desc.shm_path or not os.path.exists(desc.shm_path):
            raise TransferError(f"shard {desc.shard_id} pool {desc.shm_path!r} is not mapped on this node")
        self._desc = desc
        self._pool = SharedPool(desc.shm_path, desc.pool_bytes, create=False)
        self._host_registered = False
        self._stream: torch.cuda.Stream | None = None
        self._uva: torch.Tensor | None = None
        self._bases: list[torch.Tensor] = []  # registered CUDA buffers the ops' views lie in, by address
        self._base_ranges: list[tuple[int, int]] = []  # their [start, end) addresses, sorted

    def register_local(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self._pin_for_cuda()
            flat = tensor.view(torch.uint8).view(-1)
            at = bisect.bisect(self._base_ranges, (flat.data_ptr(), flat.data_ptr() + flat.numel()))
            self._base_ranges.insert(at, (flat.data_ptr(), flat.data_ptr() + flat.numel()))
            self._bases.insert(at, flat)

    def read(self, ops: Sequence[CopyOp]) -> Transfer:
        return self._copy(ops, to_pool=False)

    def write(self, ops: Sequence[CopyOp]) -> Transfer:
        return self._copy(ops, to_pool=True)

    def close(self) -> None:
        self._uva = None
        self._bases, self._base_ranges = [], []
        if self._host_registered:
            torch.cuda.cudart().cudaHostUnregister(self._pool.tensor.data_ptr())
            self._host_registered = False
        self._pool.close()

    def _copy(self, ops: Sequence[CopyOp], *, to_pool: bool) -> Transfer:
        pool = self._pool.tensor
        for op in ops:
            if op.pool_offset < 0 or op.pool_offset + op.nbytes > self._desc.pool_bytes:
                raise ValueError(f"copy [{op.pool_offset}, +{op.nbytes}) is outside shard "
                                 f"{self._desc.shard_id}'s pool of {self._desc.pool_bytes} bytes")
        if not any(op.local.is_cuda for op in ops):
            try:
                for op in ops:
                    view = pool[op.pool_offset: op.pool_offset + op.nbytes]
                    (view if to_pool else op.local).copy_(op.local if to_pool else view)
            except RuntimeError as e:
                return CompletedTransfer(e)
            return CompletedTransfer()
        self._pin_for_cuda()
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for op in self._gathered(ops, to_pool=to_pool):  # what the gather path left
                view = pool[op.pool_offset: op.pool_offset + op.nbytes]
                (view if to_pool else op.local).copy_(op.local if to_pool else view, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _CudaEventTransfer(event)

    def _gathered(self, ops: Sequence[CopyOp], *, to_pool: bool) -> list[CopyOp]:
        """Move what the gather path can (ops grouped by the registered buffer they lie in,
        ``GATHER_BYTES`` at a time: the gather stages that much in GPU memory); return the
        rest, to be copied one by one. Plain integers here: a torch call per op costs more
        than the copy it describes."""
        if self._uva is None:
            return list(ops)
        starts = [start for start, _ in self._base_ranges]
        groups: dict[int, tuple[list[CopyOp], list[int], list[int], list[int]]] = {}
        rest: list[CopyOp] = []
        for op in ops:
            address, size = op.local.data_ptr(), op.local.numel()
            home = bisect.bisect_right(starts, address) - 1
            if home < 0 or address + size > self._base_ranges[home][1]:
                rest.append(op)
                continue
            group = groups.setdefault(home, ([], [], [], []))
            group[0].append(op)
            group[1].append(op.pool_offset)
            group[2].append(address - starts[home])
            group[3].append(size)
        for home, (members, pool_offsets, local_offsets, sizes) in groups.items():
            begin = 0
            while begin < len(members):
                end, total = begin, 0
                while end < len(members) and (end == begin or total + sizes[end] <= GATHER_BYTES):
                    total += sizes[end]
                    end += 1
                if not copy_ranges(self._uva, self._bases[home], pool_offsets[begin:end], local_offsets[begin:end],
                                   sizes[begin:end], to_pool=to_pool):
                    rest.extend(members[begin:end])
                begin = end
        return rest

    def _pin_for_cuda(self) -> None:
        """Page-lock the mapping once so CUDA copies run at PCIe speed, asynchronously, and map
        it into the GPU's address space for the gather path (checked once; off if it fails)."""
        if self._host_registered:
            return
        cudart = torch.cuda.cudart()
        address = self._pool.tensor.data_ptr()
        mapped = int(cudart.cudaHostRegister(address, self._desc.pool_bytes, HOST_REGISTER_PORTABLE_MAPPED)) == 0
        if not mapped:
            rc = cudart.cudaHostRegister(address, self._desc.pool_bytes, 0)
            if int(rc) != 0:
                raise TransferError(f"cudaHostRegister of shard pool {self._desc.shm_path} failed: {rc}")
        self._host_registered = True
        self._stream = torch.cuda.Stream()
        if mapped:
            self._uva = self._mapped_view(address)

    def _mapped_view(self, address: int) -> torch.Tensor | None:
        """The pool as a CUDA tensor (its host pointer used on the device, as unified addressing
        allows), if a read through it returns what the CPU sees; else None (copies one by one)."""
        try:
            view = UvaView(address, self._desc.pool_bytes, torch.device("cuda", torch.cuda.current_device())).tensor
            probe = min(4096, self._desc.pool_bytes)
            if torch.equal(view[:probe].cpu(), self._pool.tensor[:probe]):
                return view
            log.warning("shard %s pool: the GPU reads other bytes through the mapped pointer; "
                        "copying block by block", self._desc.shard_id)
        except (RuntimeError, TypeError, ValueError) as e:
            log.warning("shard %s pool: no GPU-mapped view (%s); copying block by block", self._desc.shard_id, e)
        return None
